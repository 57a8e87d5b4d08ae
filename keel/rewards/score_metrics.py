"""What a scored batch reports: not-scored shares and reasons, scoring latency, each scorer's mean;
and the same for several batches a step scored, merged."""

from __future__ import annotations

from keel.rewards.worker import SampleResult


def score_metrics(results: list[SampleResult], failed: list[tuple[int, str]]) -> dict[str, float]:
    """Not-scored share and reasons, scoring latency, each scorer's mean when there are several, and
    the mean of each numeric extra a dict result gave."""
    metrics = {
        "reward/not_scored_ratio": len(failed) / max(len(results), 1),
        "timing_s/score_sample/mean": sum(r.seconds for r in results) / max(len(results), 1),
        "timing_s/score_sample/max": max((r.seconds for r in results), default=0.0),
    }
    for _, reason in failed:
        key = f"reward/not_scored/{reason.split(':')[0].split(' (')[0].replace(' ', '_')}"
        metrics[key] = metrics.get(key, 0.0) + 1
    parts: dict[str, list[float]] = {}
    for res in results:
        for name, value in (res.values or {}).items():
            parts.setdefault(name, []).append(value)
    if len(parts) > 1:
        metrics.update({f"reward/{name}/mean": sum(v) / len(v) for name, v in parts.items()})
    extras: dict[str, list[float]] = {}
    for res in results:
        for key, value in (res.extras or {}).items():
            if not isinstance(value, str):
                extras.setdefault(key, []).append(float(value))
    metrics.update({f"reward_extra/{key}/mean": sum(v) / len(v) for key, v in extras.items()})
    return metrics


# per batch, counted
AGENT_COUNTS = ("agent/errors", "agent/timeouts", "agent/prefix_breaks", "agent/dropped")


def merge_score_metrics(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The metrics of several scored batches, (metrics, samples) each, as one batch's would read:
    not-scored and agent counts summed, maxima (and the service's running retry count) the largest,
    the rest means weighted by samples."""
    merged: dict[str, float] = {}
    for name in dict.fromkeys(name for metrics, _ in parts for name in metrics):
        values = [(metrics[name], count) for metrics, count in parts if name in metrics]
        if name.startswith("reward/not_scored/") or name in AGENT_COUNTS:
            merged[name] = sum(value for value, _ in values)
        elif name.endswith("/max") or name == "reward/service_retries":
            merged[name] = max(value for value, _ in values)
        else:
            merged[name] = sum(value * count for value, count in values) / max(
                sum(c for _, c in values), 1
            )
    return merged
