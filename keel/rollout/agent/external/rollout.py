"""Agent code as the rollout (`actor_rollout_ref.rollout.agent.function`): an async function
written against an OpenAI client, run for every sample of the batch at once (at most `concurrency`
at a time, each within `timeout_s`), its requests served by keel's endpoint over the engine
service, so the samples' turns share the continuous batch.

    async def agent(client: openai.AsyncOpenAI, row: dict, extra_info: dict) -> float | None

`row` holds the sample's prompt as the data gave it (`prompt`, messages or text), its
`data_source` and `ground_truth`. The client names the sample on every request (a header), so the
agent may pass any model name. What it returns is the sample's reward; None leaves the sample to
the reward function, which scores the text of its last turn.

What is trained is each sample's token trace (trace.py): the exact prompt and sampled tokens.
An agent that raises or runs past its timeout, or whose requests rewrote its history
(rollout.agent.on_prefix_break=drop), leaves the update and is counted (`agent/errors`,
`agent/timeouts`, `agent/prefix_breaks`, `agent/dropped`); the step goes on. With
on_prefix_break=segments a rewritten sample trains each continuous stretch as a row of its own
(GeneratedBatch.sample_index ties them), scored once and counted once in its group.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
from dataclasses import dataclass

import torch

from keel.errors import AGENT_FUNCTION, KeelError
from keel.rollout.agent.episode import last_sampled_turn
from keel.rollout.agent.external.agents import Job, build_agent, run_agents
from keel.rollout.agent.external.endpoints import EndpointProcesses, InProcessEndpoint
from keel.rollout.agent.external.outcome import Outcome
from keel.rollout.agent.external.trace import Stretch, Trace
from keel.rollout.service import EngineService
from keel.types import GeneratedBatch, PromptBatch, SamplingParams


@dataclass
class ExternalAgentOptions:
    # data.max_response_length: tokens a sample may add after its first prompt
    budget: int
    # tokens a sample's context may reach
    max_len: int
    concurrency: int = 64
    timeout_s: float = 600.0
    host: str = "127.0.0.1"
    # an environment's: its samples never reach the reward function
    scored_by_agent: bool = False
    # the engine service's admission window
    admission_s: float = 0.0
    # 0: the endpoint is a thread of the engine's process
    endpoint_processes: int = 0
    # a sample whose history was rewritten trains each stretch as a row (else dropped)
    segments: bool = False


class InProcessAgents:
    """The agents in the engine's own process (rollout.agent.processes=0): simplest to debug."""

    def __init__(self, agent):
        self.agent = agent

    def run(
        self, urls: list[str], token: str, jobs, at_once: int, timeout_s: float, on_ended
    ) -> list[Outcome]:
        return asyncio.run(
            run_agents(self.agent, urls[0], token, jobs, at_once, timeout_s, on_ended)
        )


class ExternalAgentRollout:
    """`agents`: InProcessAgents, or AgentProcesses (agent_processes.py)."""

    def __init__(self, engine, tokenizer, agents, options: ExternalAgentOptions):
        self.engine, self.tokenizer, self.agents, self.options = engine, tokenizer, agents, options
        # seconds of the engine's parts, and idle (waiting on the agents)
        self.timing: dict[str, float] = {}
        # how the turns reached the engine
        self.metrics: dict[str, float] = {}
        token, in_flight = secrets.token_urlsafe(16), max(1024, options.concurrency)
        if options.endpoint_processes:
            self.endpoints = EndpointProcesses(
                tokenizer, options.endpoint_processes, options.host, token, in_flight
            )
        else:
            self.endpoints = InProcessEndpoint(tokenizer, options.host, token, in_flight)

    def generate(self, prompts: PromptBatch, params: SamplingParams) -> GeneratedBatch:
        names = [f"sample-{secrets.token_hex(4)}-{i}" for i in range(len(prompts))]
        rows = min(len(prompts), self.options.concurrency)
        options = self.options
        one = dataclasses.replace(params, n=1)
        # a prompt's samples share the prefill of their first turn
        groups = {name: record.index for name, record in zip(names, prompts.records)}
        service = EngineService(
            self.engine, one, rows, options.max_len, options.budget, options.admission_s, groups
        )
        outcomes = None
        try:
            urls = self.endpoints.begin(service, options.budget)
            # As many agents at once as the engine holds rows: one waiting for a row would spend its
            # timeout.
            at_once = min(options.concurrency, service.batcher.shape[0])
            jobs = [
                Job(name, job_row(r), dict(r.extra_info), r.index)
                for name, r in zip(names, prompts.records)
            ]
            outcomes = self.agents.run(
                urls, self.endpoints.token, jobs, at_once, options.timeout_s, service.end
            )
        finally:
            # first: a request still waiting is answered, so the endpoint can stop
            service.close()
            found = self._traces(quietly=outcomes is None or service.error is not None)
        # the engine failed (out of memory, ...): not the agents' fault
        if service.error is not None:
            raise service.error
        self.timing = {**self.engine.timing, "idle": service.stats["idle_s"]}
        self.metrics = engine_service_metrics(service.stats)
        traces = [found.get(name) or Trace() for name in names]
        batch = traces_batch(
            prompts, traces, outcomes, self.tokenizer, options.scored_by_agent, options.segments
        )
        _refuse_all_dropped(batch.records, outcomes)
        return batch

    def _traces(self, quietly: bool) -> dict:
        """The endpoint's traces; `quietly` when the rollout failed: its error is the one to say."""
        try:
            return self.endpoints.collect()
        except KeelError:
            if quietly:
                return {}
            raise

    def close(self) -> None:
        """The endpoint's and the agents' processes stop (they are daemons: they also end with this
        process)."""
        self.endpoints.close()
        if hasattr(self.agents, "close"):
            self.agents.close()


def engine_service_metrics(stats: dict) -> dict[str, float]:
    """How the agents' turns reached the engine: its prefill passes of arrived turns and the turns a
    pass took, the rows a decode call stepped."""
    return {
        "agent/engine/prefill_passes": stats["admissions"],
        "agent/engine/turns_per_pass": stats["turns"] / max(1, stats["admissions"]),
        "agent/engine/rows_per_decode": stats["row_steps"] / max(1, stats["decode_calls"]),
    }


def job_row(record) -> dict:
    return {
        "prompt": record.raw_prompt,
        "data_source": record.data_source,
        "ground_truth": record.ground_truth,
    }


def build_external_agent(agent, engine, tokenizer, budget: int) -> ExternalAgentRollout:
    """The rollout of a rollout.agent section around the engine; `budget`:
    data.max_response_length."""
    what = "environment" if agent.environment else "function"
    if not engine.capabilities.continuous:
        raise KeelError(
            AGENT_FUNCTION,
            f"actor_rollout_ref.rollout.agent.{what}={getattr(agent, what)!r} runs on keel's "
            f"native engine, and this model generates with {type(engine).__name__}",
            "set actor_rollout_ref.rollout.name=native (keel check says whether the model runs "
            f"on it), or unset actor_rollout_ref.rollout.agent.{what}",
        )
    max_len = agent.max_prompt_length + budget
    options = ExternalAgentOptions(
        budget,
        max_len,
        agent.concurrency,
        agent.timeout_s,
        agent.host,
        scored_by_agent=bool(agent.environment),
        admission_s=agent.admission_window_ms / 1000,
        endpoint_processes=_endpoint_processes(agent),
        segments=agent.on_prefix_break == "segments",
    )
    processes = _agent_processes(agent)
    if not processes:
        return ExternalAgentRollout(engine, tokenizer, InProcessAgents(build_agent(agent)), options)
    from keel.rollout.agent.external.agent_processes import AgentProcesses

    # Each process builds the agent; `keel check` (before training) has loaded it here already.
    return ExternalAgentRollout(engine, tokenizer, AgentProcesses(agent, processes), options)


def _agent_processes(agent) -> int:
    """rollout.agent.processes, by default one per two cores (m1a on a 16-core H200 host: 8 agent
    and 8 endpoint processes took 10.6 s a step, 4 and 2 took 12.4 s;
    benchmarks/results/m1a.jsonl)."""
    if agent.processes is not None:
        return agent.processes
    return min(8, max(1, (os.cpu_count() or 2) // 2))


def _endpoint_processes(agent) -> int:
    """rollout.agent.endpoint_processes, by default as many as the agents' (none for in-process
    agents: the simplest to debug stays in one process)."""
    return (
        agent.endpoint_processes
        if agent.endpoint_processes is not None
        else _agent_processes(agent)
    )


def traces_batch(
    prompts: PromptBatch,
    traces: list[Trace],
    outcomes: list[Outcome],
    tokenizer,
    scored_by_agent: bool = False,
    segments: bool = False,
) -> GeneratedBatch:
    """The batch the samples' traces make: a row for each sample's first stretch, its prompt the
    agent's own first prompt; with `segments` (on_prefix_break=segments), a row for each stretch of
    a sample whose history was rewritten, rows of one sample sharing its sample_index. A sample to
    drop (its agent failed, or its history was rewritten and segments are off) keeps its tokens but
    trains none of them, and says why in extra_info (`agent_dropped`)."""
    # (sample, its stretch, its segment number or None, why the sample is dropped)
    rows = []
    for i, (trace, record, outcome) in enumerate(zip(traces, prompts.records, outcomes)):
        why = _why_dropped(trace, outcome, scored_by_agent, segments)
        if why is None and segments and trace.prefix_breaks:
            rows += [(i, stretch, k, None) for k, stretch in enumerate(trace.stretches)]
        else:
            rows.append((i, _first_stretch(trace, record), None, why))
    stretches = [stretch for _, stretch, _, _ in rows]
    trained = [s.trained if why is None else [0] * len(s.ids) for _, s, _, why in rows]
    last_turns = [last_sampled_turn(s.ids, s.trained) for s in stretches]
    texts = [tokenizer.decode(turn, skip_special_tokens=True) for turn in last_turns]
    records = [
        _agent_record(prompts.records[i], traces[i], outcomes[i], why, text, k)
        for (i, _, k, why), text in zip(rows, texts)
    ]
    # a segment before a sample's last ended where its history was rewritten: neither cut nor
    # finished
    cut = [
        (k is None or k == len(traces[i].stretches) - 1) and _cut(traces[i]) for i, _, k, _ in rows
    ]
    prompt_ids, prompt_mask = _left_padded([s.prompt for s in stretches], tokenizer.pad_token_id)
    width = max(1, max(len(s.ids) for s in stretches))
    trained = _right_padded(trained, width)
    return GeneratedBatch(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        response_ids=_right_padded([s.ids for s in stretches], width, tokenizer.pad_token_id),
        response_mask=trained,
        sampling_log_probs=_right_padded(
            [s.log_probs for s in stretches], width, dtype=torch.float32
        )
        * trained,
        group_index=torch.tensor([r.index for r in records]),
        records=records,
        response_texts=texts,
        truncated=torch.tensor(cut),
        response_attention=_right_padded([[1] * len(s.ids) for s in stretches], width),
        sample_index=torch.tensor([i for i, *_ in rows]) if segments else None,
    )


def _cut(trace: Trace) -> bool:
    return trace.budget_spent or not trace.finished_turn


def _agent_record(
    record, trace: Trace, outcome: Outcome, why: str | None, last_turn: str, segment: int | None
):
    """A row's record: the sample's, with how its agent ended (and, trained as segments, which this
    is)."""
    return dataclasses.replace(
        record,
        extra_info={
            **record.extra_info,
            "agent_status": outcome.status,
            **({"agent_error": outcome.error} if outcome.error else {}),
            **({"agent_dropped": why} if why else {}),
            "agent_requests": trace.requests,
            **({"agent_metrics": outcome.metrics} if outcome.metrics and why is None else {}),
            "prefix_breaks": trace.prefix_breaks,
            **({"agent_segment": segment} if segment is not None else {}),
            **(
                {"agent_reward": outcome.reward}
                if outcome.reward is not None and why is None
                else {}
            ),
            # not scored: it leaves the update
            **({"agent_reward": 0.0} if why else {}),
            "last_turn": last_turn,
        },
    )


def _left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) [N, widest], each prompt at the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt) :] = 1
    return ids, mask


# [N, width]
def _right_padded(values: list[list], width: int, fill=0, dtype=torch.long) -> torch.Tensor:
    out = torch.full((len(values), width), fill, dtype=dtype)
    for i, v in enumerate(values):
        out[i, : len(v)] = torch.tensor(v, dtype=dtype)
    return out


def _refuse_all_dropped(records, outcomes: list[Outcome]) -> None:
    """A step whose every sample its agent lost is the agent's bug, not data: said, with the first
    error."""
    if records and all("agent_dropped" in r.extra_info for r in records):
        first = next((o.error for o in outcomes if o.error), None)
        reasons = sorted({r.extra_info["agent_dropped"] for r in records})
        said = f"every sample's agent failed this step ({', '.join(reasons)})"
        raise KeelError(AGENT_FUNCTION, said + (f"; the first: {first}" if first else ""))


def _first_stretch(trace: Trace, record) -> Stretch:
    """What is trained of a sample: its first stretch (a sample that never asked: its prompt
    alone)."""
    return trace.stretches[0] if trace.stretches else Stretch(list(record.prompt_ids))


def _why_dropped(
    trace: Trace, outcome: Outcome, scored_by_agent: bool, segments: bool = False
) -> str | None:
    # An agent stopped by the budget is a cut sample, kept where something scores it: its own
    # reward, or the reward function (which an environment's samples never reach).
    cut = trace.budget_spent and (outcome.reward is not None or not scored_by_agent)
    if outcome.status != "ok" and not cut:
        return outcome.status
    if trace.prefix_breaks and not segments:
        return "prefix_break"
    if not trace.stretches:
        return "no_request"
    return None
