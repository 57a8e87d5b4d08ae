"""What a user looks at after a multi-turn step, from each sample's record (extra_info, which the
agent loop fills and every worker's samples carry to the driver)."""

from __future__ import annotations

import statistics

from keel.types import PromptRecord


def agent_metrics(records: list[PromptRecord]) -> dict[str, float]:
    infos = [r.extra_info for r in records if "num_turns" in r.extra_info]
    if not infos:
        return {}
    turns = [info["num_turns"] for info in infos]
    metrics = {
        "num_turns/mean": statistics.fmean(turns),
        "num_turns/max": float(max(turns)),
        "num_turns/min": float(min(turns)),
        "tools/calls_per_sample": statistics.fmean(info["tool_calls"] for info in infos),
        "tools/malformed_calls": float(sum(info["malformed_tool_calls"] for info in infos)),
        "tools/cut_by_budget": statistics.fmean(float(info["cut_by_budget"]) for info in infos),
        "tools/turn_reward/mean": statistics.fmean(info["turn_reward"] for info in infos),
    }
    if any(info["user_turns"] or info["environment_errors"] for info in infos):
        metrics["environment/user_turns/mean"] = statistics.fmean(
            info["user_turns"] for info in infos
        )
        metrics["environment/errors"] = float(sum(info["environment_errors"] for info in infos))
    totals: dict[str, dict[str, float]] = {}
    for info in infos:
        for name, counts in info["tools"].items():
            total = totals.setdefault(name, dict.fromkeys(counts, 0.0))
            for key, value in counts.items():
                total[key] += value
    for name, total in totals.items():
        for key in ("calls", "error", "timeout", "unknown", "truncated"):
            if total.get(key) or key == "calls":
                metrics[f"tools/{name}/{key if key == 'calls' else key + 's'}"] = total[key]
        metrics[f"tools/{name}/latency_s"] = total["seconds"] / max(total["calls"], 1)
    return metrics


def external_agent_metrics(records: list[PromptRecord], final_segments=None) -> dict[str, float]:
    """Agent code as the rollout (rollout.agent.function): how its samples ended, before the
    dropped ones leave the batch. `final_segments` ([N] each row's sample's final row): a sample
    trained as segments (on_prefix_break=segments) counts once."""
    if final_segments is not None:
        records = [records[i] for i in final_segments.unique().tolist()]
    infos = [r.extra_info for r in records if "agent_status" in r.extra_info]
    if not infos:
        return {}
    metrics = {
        "agent/errors": float(sum(info["agent_status"] == "error" for info in infos)),
        "agent/timeouts": float(sum(info["agent_status"] == "timeout" for info in infos)),
        "agent/prefix_breaks": float(sum(info["prefix_breaks"] for info in infos)),
        "agent/dropped": float(sum("agent_dropped" in info for info in infos)),
        "agent/requests_per_sample": statistics.fmean(info["agent_requests"] for info in infos),
    }
    # the agent's or its environment's metrics (a rubric's functions, ...)
    own: dict[str, list[float]] = {}
    for info in infos:
        for name, value in info.get("agent_metrics", {}).items():
            own.setdefault(name, []).append(value)
    metrics.update(
        {f"agent/metrics/{name}/mean": statistics.fmean(values) for name, values in own.items()}
    )
    return metrics
