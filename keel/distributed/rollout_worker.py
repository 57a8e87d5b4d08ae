"""The rollout on workers of its own (actor_rollout_ref.hybrid_engine=false): a rank holds the
rollout engine (and the agent loop around it, for multi-turn or agent rollouts) and nothing that
trains. It starts from the policy's weights (the model path, or a checkpoint's actor) and takes the
actor's after each update, tagged with their policy version (`load_policy`); every sample it
generates carries the version it was sampled from. Its ranks generate independently: no process
group, no collectives.

`generate_samples` is the generation both kinds of worker run (RoleWorker's colocated engine and
this one), so a sample is made the same way wherever it is made.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

import torch

from keel.errors import INCOMPATIBLE_OPTIONS, KeelError
from keel.models.load import (
    load_causal_lm,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
)
from keel.rollout.agent import build_agent_loop
from keel.rollout.agent.external import build_external_agent
from keel.rollout.select import make_rollout_engine
from keel.types import GeneratedBatch, PartialSample, SamplingParams


@dataclass
class PolicyWeights:
    """What the actor sends a rollout on workers of its own after an update, on the host: its whole
    weights, or with LoRA its adapters and the modules it trains in full (the base never
    changes)."""

    # (Hugging Face name, tensor): what the engine loads whole
    named: list
    # LoRA: (adapted weight's name, A, B times scaling)
    adapters: list | None = None


@dataclass(frozen=True)
class Generator:
    """What a worker generates with: its engine, or the agent rollout around it (`agent`), and
    whether that tells of each sample as it finishes (`generate(..., on_finished=)`)."""

    engine: object
    agent: object | None
    streams_finished: bool

    @property
    def generates(self):
        """What a batch's `generate` is called on."""
        return self.agent or self.engine

    def close(self) -> None:
        """Processes the agent rollout started (an endpoint and agents) stop."""
        if hasattr(self.agent, "close"):
            self.agent.close()


def generate_samples(
    generator: Generator,
    prompts,
    sampling: SamplingParams,
    seed: int,
    version: int,
    on_finished=None,
):
    """(this rank's samples, each stamped with `version`, and the generator's timing of its parts
    (`timing_s/gen_<part>`: prefill, decode, ...) with what else it measured (an agent rollout's
    `agent/engine/*`)); (None, {}) for a rank with no prompts. `on_finished(row, record, response
    text)`: told of each sample as it finishes, by a generator that can (the native engine; keel's
    agent loop, for episodes whose record is final when they end)."""
    try:
        # fewer prompts than ranks
        if prompts is None:
            return None, {}
        # per step and rank: a resumed run samples what an uninterrupted one would
        torch.manual_seed(seed)
        start = time.perf_counter()
        if on_finished is not None and generator.streams_finished:
            batch = generator.generates.generate(prompts, sampling, on_finished=on_finished)
        else:
            # the engine applies the compute dtype itself
            batch = generator.generates.generate(prompts, sampling)
    finally:
        # a teller to the driver (keel/distributed/finished.py): all told
        if hasattr(on_finished, "close"):
            on_finished.close()
    version_of = torch.full((len(batch),), version, dtype=torch.long)
    batch = dataclasses.replace(batch, policy_version=version_of)
    generates = generator.generates
    return batch, {**_timing(generates, start), **getattr(generates, "metrics", {})}


def continue_samples(
    engine, samples: list[PartialSample], sampling: SamplingParams, seed: int, version: int, end
):
    """Partial rollouts: a round of this rank's `samples` (GeneratedBatch's siblings, the engine's
    `generate_round`) -> the samples with the tokens sampled now, tagged with `version`, and the
    engine's timing; ([], {}) for a rank with none."""
    if not samples:
        return [], {}
    # rollout.name=auto fell back to hf for this model
    if not engine.capabilities.generate_round:
        raise KeelError(
            INCOMPATIBLE_OPTIONS,
            "trainer.partial_rollout=true, but this model generates with "
            f"{type(engine).__name__}, which cannot end a round part-way (keel's native engine "
            "does not support the model)",
            "set `trainer.partial_rollout=false`",
        )
    torch.manual_seed(seed)
    start = time.perf_counter()
    sampled = engine.generate_round(samples, sampling, end)
    samples = [
        dataclasses.replace(
            s,
            ids=s.ids + ids,
            log_probs=s.log_probs + lps,
            versions=s.versions + [version] * len(ids),
            finished=done,
            truncated=truncated,
        )
        for s, (ids, lps, done, truncated) in zip(samples, sampled)
    ]
    return samples, _timing(engine, start)


def _timing(generator, start: float) -> dict[str, float]:
    """The generator's seconds per part of its last call (`timing_s/gen_<part>`: prefill, decode,
    ...), and the whole call's since `start` (`timing_s/gen_engine`)."""
    timing = {f"timing_s/gen_{part}": seconds for part, seconds in generator.timing.items()}
    return {**timing, "timing_s/gen_engine": time.perf_counter() - start}


def generator_around(policy, engine, tokenizer, budget: int) -> Generator:
    """The engine, or what drives it through a multi-turn or agent rollout."""
    # agent code behind an OpenAI client: told of none as it finishes
    if policy.rollout.agent.function or policy.rollout.agent.environment:
        agent = build_external_agent(policy.rollout.agent, engine, tokenizer, budget)
        return Generator(engine, agent, streams_finished=False)
    # keel's agent loop tells of each episode as it ends, whatever the engine
    if policy.rollout.multi_turn.enable:
        agent = build_agent_loop(policy.rollout.multi_turn, engine, tokenizer, budget)
        return Generator(engine, agent, streams_finished=True)
    return Generator(engine, None, engine.capabilities.streams_finished)


class RolloutWorker:
    """One rank of the rollout's own workers; `spec` is the policy's WorkerSpec."""

    def __init__(self, spec, rank: int = 0, world_size: int = 1, master=None, tokenizer=None):
        quiet_transformers()
        self.spec, self.rank = spec, rank
        policy = spec.policy
        self.device = resolve_device(spec.device)
        # a Ray worker sees only its own GPU
        if self.device.type == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device())
        compute_dtype = resolve_dtype(policy.model.dtype, self.device)
        self.tokenizer = tokenizer or load_tokenizer(
            policy.model.path, policy.model.trust_remote_code
        )
        torch.manual_seed(spec.seed)
        # the base alone: the actor sends its adapters (PolicyWeights)
        lora = policy.model.lora_rank > 0
        weights = policy.model.path if lora else (spec.actor_weights or policy.model.path)
        model = load_causal_lm(weights, self.device, policy.model.trust_remote_code)
        self.engine = make_rollout_engine(
            policy.rollout,
            model,
            self.tokenizer,
            self.device,
            compute_dtype,
            log_choice=rank == 0,
            lora=lora,
        )
        if lora and not self.engine.capabilities.load_adapters:
            raise KeelError(
                INCOMPATIBLE_OPTIONS,
                "LoRA with the rollout on workers of its own needs keel's native engine, which "
                "applies the adapters the actor sends; this model generates with "
                f"{type(self.engine).__name__}",
                "set `actor_rollout_ref.hybrid_engine=true` (the engine beside the actor)",
            )
        self.generator = generator_around(
            policy, self.engine, self.tokenizer, spec.max_response_length
        )
        # the policy version of the weights the engine holds
        self.weights_version = 0

    def info(self) -> dict:
        return {
            "rollout_engine": type(self.engine).__name__,
            "kv_cache_kept": getattr(self.engine, "keeps_cache_now", None),
            # the actor's weights come gathered to the host and are loaded from there
            "weight_sync": "through the host",
        }

    def generate(
        self, prompts, sampling: SamplingParams, seed: int, on_finished=None
    ) -> tuple[GeneratedBatch | None, dict]:
        return generate_samples(
            self.generator, prompts, sampling, seed, self.weights_version, on_finished
        )

    def generate_round(
        self, samples: list[PartialSample], sampling: SamplingParams, seed: int, end
    ):
        return continue_samples(self.engine, samples, sampling, seed, self.weights_version, end)

    def load_policy(self, weights: PolicyWeights, version: int) -> None:
        """The actor's weights as of policy version `version`: whole, or a LoRA policy's
        adapters."""
        if weights.adapters is None:
            self.engine.load_weights(weights.named)
        # the base never changes
        else:
            self.engine.load_adapters(weights.adapters)
            self.engine.load_weights(weights.named, every=False)
        self.weights_version = version

    def load(self, directory: str, weights_version: int = 0) -> None:
        """A resumed run: the checkpoint's actor weights came with the spec; their version is the
        step's."""
        self.weights_version = weights_version

    def close(self) -> None:
        """Processes the agent rollout started (its endpoint and agents) stop."""
        self.generator.close()
