"""Typed records passed between the stages of an RL step.

N = samples in the batch (prompts x rollout.n), P = longest prompt (left-padded),
R = longest response (right-padded). A full sequence is `[prompt | response]`, length P + R.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor


@dataclass(slots=True)
class PromptRecord:
    """One dataset row as the rollout and the reward function see it."""

    # row index in the dataset, before filtering
    index: int
    prompt_ids: list[int]
    # the templated text fed to the model (re-decoded if truncated)
    prompt_text: str
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    # as in the data: a reward model templates it its own way
    raw_prompt: str | list[dict] | None = None
    # the row's own response (distillation.response_key), which gkd's data steps train on; None:
    # no step does (keel.data.responses)
    response: str | None = None


@dataclass(slots=True)
class PromptBatch:
    """Prompts collated for generation: token ids left-padded, and each prompt's record."""

    input_ids: torch.Tensor  # [B, P] left-padded with pad_token_id
    attention_mask: torch.Tensor  # [B, P] 1 on prompt tokens, 0 on padding
    records: list[PromptRecord]

    def __len__(self) -> int:
        return len(self.records)

    def repeat_interleave(self, n: int) -> PromptBatch:
        """Each prompt n times in a row ([p0, p0, p1, p1, ...]), for n samples per prompt."""
        return PromptBatch(
            input_ids=self.input_ids.repeat_interleave(n, dim=0),  # [B*n, P]
            attention_mask=self.attention_mask.repeat_interleave(n, dim=0),
            records=[r for r in self.records for _ in range(n)],
        )


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How a generation call samples: n per prompt, temperature and the rest."""

    n: int = 1
    do_sample: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    # -1: off
    top_k: int = -1
    max_new_tokens: int = 512
    # every response is max_new_tokens long (benchmarks)
    ignore_eos: bool = False


@dataclass(slots=True)
class PartialSample:
    """One sample of a partial rollout (trainer.partial_rollout): generated over rounds, each with
    the policy of its time; a round that ends before it does keeps its tokens, and the next
    continues it."""

    # the samples of one prompt share it; unique over the run
    group: int
    record: PromptRecord
    # sampled so far; a stop token ends a finished one
    ids: list[int] = field(default_factory=list)
    # the sampler's, per token
    log_probs: list[float] = field(default_factory=list)
    # the policy version each token was sampled from
    versions: list[int] = field(default_factory=list)
    # ended: a stop token, or the response length
    finished: bool = False
    # ended at the response length without a stop token
    truncated: bool = False
    # which of its group's samples it is
    sample: int = 0


def groups_of(samples: list[PartialSample]) -> list[int]:
    """The groups of `samples`, each once, in order."""
    return list(dict.fromkeys(s.group for s in samples))


@dataclass(frozen=True)
class RoundEnd:
    """When a round of partial rollouts ends: once every sample of `groups` has finished and at
    least `count` groups have all their samples finished; what is under way then is cut."""

    groups: frozenset = frozenset()
    count: int = 0

    def reached(self, groups: list[int], finished: list[bool]) -> bool:
        """`groups`, `finished`: per sample of the round."""
        open_groups = {g for g, done in zip(groups, finished) if not done}
        if open_groups & self.groups:
            return False
        return len(set(groups) - open_groups) >= self.count


class OldLogProbSource(enum.Enum):
    """Where the update's old log-probs come from (keel.config.plan.old_log_probs_source
    decides)."""

    # rollout_correction.bypass_mode: the sampler's log-probs are the old ones, no pass
    SAMPLER = "sampler"
    # on-policy (one mini-batch, one epoch): the update's own forward, detached, no pass
    UPDATE = "update"
    # one epoch of several mini-batches: the pass skips the first one, whose forward is its own
    FIRST_MINI_BATCH = "first_mini_batch"
    # the old-log-prob pass over the whole batch
    RECOMPUTED = "recomputed"


@dataclass(slots=True, kw_only=True, frozen=True)
class GeneratedBatch:
    """What generation gives: the sampled tokens, the sampler's log-probs and the policy version
    each sample (or token) was sampled from.

    A step's records are one per stage, each built once from the stage before (`of`):
    GeneratedBatch, then ScoredBatch (the reward function's scores), then TrainBatch (what the
    trainer consumes: old and reference log-probs, values, rewards per token, advantages, rollout
    correction). Every field is per sample (a row), so a sub-batch of any of them is a `select`.
    None in an optional field means what its comment says, never "not computed yet"."""

    prompt_ids: Tensor  # [N, P] left-padded
    prompt_mask: Tensor  # [N, P] 1 on prompt tokens
    response_ids: Tensor  # [N, R] right-padded after EOS
    response_mask: Tensor  # [N, R] 1 on response tokens, EOS included
    sampling_log_probs: Tensor  # [N, R] log-probs of the sampled tokens under the sampler
    group_index: Tensor  # [N] samples of the same prompt share a value
    records: list[PromptRecord]  # [N] the prompt's record (data_source, ground_truth, ...)
    response_texts: list[str]  # [N]
    truncated: Tensor  # [N] bool: hit max_response_length without EOS
    # Multi-turn: 1 on every real response token, the model's and the tools' and template's between
    # its turns (attended to, never trained on); response_mask is then the model's tokens only.
    # None: the response is the model's alone, response_mask both.
    response_attention: Tensor | None = None
    # [N] multi-turn: what tools and interactions gave, summed; None: no turns
    turn_rewards: Tensor | None = None
    # Agent rollouts with on_prefix_break=segments: rows of one value are one sample's continuous
    # stretches, in order, trained as sequences of their own; the last is the sample's final
    # segment, the one scored and counted in its group, and the others take its score and advantage.
    # None: every row is a whole sample.
    sample_index: Tensor | None = None
    # [N] the policy version (actor updates so far) it was sampled from; None: a generator outside
    # the workers (validation, benchmarks), which stamp it
    policy_version: Tensor | None = None
    # Partial rollouts: [N, R] the policy version each token was sampled from (a sample cut by a
    # weight update continues under the next one); policy_version is then each sample's oldest.
    # None: every token is its sample's policy_version.
    token_versions: Tensor | None = None
    # [N] bool: True where the response is the data's own (gkd's off-policy steps,
    # distillation.gkd.lmbda < 1), not sampled: its sampling_log_probs are 0 and mean nothing.
    # None: every response was sampled.
    from_data: Tensor | None = None

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    @property
    def sampled(self) -> bool:
        """Every response was sampled (none is the data's): sampling_log_probs are the sampler's."""
        return self.from_data is None or not bool(self.from_data.any())

    @property
    def input_ids(self) -> Tensor:  # [N, P + R]
        return torch.cat([self.prompt_ids, self.response_ids], dim=1)

    @property
    def response_tokens(self) -> Tensor:  # [N, R] 1 on every real response token
        return self.response_mask if self.response_attention is None else self.response_attention

    @property
    def attention_mask(self) -> Tensor:  # [N, P + R]
        return torch.cat([self.prompt_mask, self.response_tokens], dim=1)

    @property
    def last_token_index(self) -> Tensor:  # [N] the model's last token (0 for an empty response)
        positions = torch.arange(self.response_mask.shape[1])
        return (self.response_mask.bool() * positions).max(-1).values

    @property
    # [N] each row's sample's final segment (itself without segments)
    def final_segments(self) -> Tensor:
        if self.sample_index is None:
            return torch.arange(len(self))
        _, sample = torch.unique(self.sample_index, return_inverse=True)
        last = torch.full((int(sample.max()) + 1,), -1, dtype=torch.long)
        return last.scatter_reduce(0, sample, torch.arange(len(self)), reduce="amax")[sample]

    @property
    def response_lengths(self) -> Tensor:  # [N]
        return self.response_mask.sum(-1)

    def masked_copies(self, count: int):
        """`count` copies of the first sample with the response masked out: fillers that add
        nothing to any loss or count, for ranks or passes that must run in step with others."""
        filler = self.select([0] * count)
        return dataclasses.replace(filler, response_mask=torch.zeros_like(filler.response_mask))

    def to(self, device: torch.device):
        """Every tensor field on `device`. Host-to-device copies do not wait for the GPU
        (non_blocking): a blocking copy waits until every kernel queued before it has run, and the
        update made eight of them per micro-batch, each draining the GPU's queue mid-step. CUDA
        stages a pageable source before the call returns, so the host tensor may change afterwards.
        (Towards the host a copy stays blocking: the values must be there when it returns.)"""
        to_gpu = torch.device(device).type == "cuda"
        moved = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            moved[f.name] = (
                value.to(device, non_blocking=to_gpu) if isinstance(value, Tensor) else value
            )
        return type(self)(**moved)

    def select(self, index: Tensor | list[int]):
        """A sub-batch (mini- or micro-batch) with every per-sample field indexed alike."""
        index = torch.as_tensor(index, dtype=torch.long)
        picked = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, Tensor):
                picked[f.name] = value[index]
            elif isinstance(value, list):
                picked[f.name] = [value[i] for i in index.tolist()]
            else:
                picked[f.name] = value
        return type(self)(**picked)

    @classmethod
    def of(cls, earlier: GeneratedBatch, **fields):
        """This stage's record of `earlier`'s samples: its fields, and this stage's `fields`."""
        return cls(
            **{f.name: getattr(earlier, f.name) for f in dataclasses.fields(earlier)}, **fields
        )


# The later records extend the one before: keyword-only fields, so a field is required wherever
# the stage always sets it, whatever came before it. A record of another kind (DPO's pair of
# scored rows, a teacher's log-probs for distillation) is one more record of this kind, built by
# `of` from the stage it follows.
@dataclass(slots=True, kw_only=True, frozen=True)
class ScoredBatch(GeneratedBatch):
    """The generated samples and the reward function's results."""

    scores: Tensor  # [N] outcome reward from the reward function
    # [N] other keys of dict results (verl's reward_extra_info); None: the results were numbers
    reward_extras: list[dict] | None = None
    # ReMax: [N] the score of the sample's prompt's greedy response, generated by the policy that
    # sampled it; None: no baseline rollout
    baselines: Tensor | None = None


@dataclass(slots=True, kw_only=True, frozen=True)
class TrainBatch(ScoredBatch):
    """The record the trainer consumes: the scored samples and what the step's passes computed
    over them for the update."""

    # [N, R] score on the last token, minus KL if in reward
    token_level_rewards: Tensor
    advantages: Tensor  # [N, R]
    returns: Tensor  # [N, R]
    # [N, R] the actor's log-probs before the update; None: the update's own forward gives them
    # all (on-policy: one mini-batch, one epoch)
    old_log_probs: Tensor | None = None
    # [N] bool: the samples of the update's first mini-batch, whose old log-probs are that update's
    # own forward (the policy has not moved yet), so the pass skipped them (0 in old_log_probs).
    # None: old_log_probs holds every sample's.
    own_old_log_probs: Tensor | None = None
    # [N, R]; None: no reference model
    ref_log_probs: Tensor | None = None
    # [N, R] critic values; None: no critic
    values: Tensor | None = None
    # distillation: the teacher's log-prob of each sampled token [N, R]; None: no teacher
    teacher_log_probs: Tensor | None = None
    # distillation.mode=gkd: the teacher's top-k tokens at each response position [N, R, k] and
    # their log-probs (over the whole vocabulary) [N, R, k]; None: reverse_kl or no teacher
    teacher_top_ids: Tensor | None = None
    teacher_top_log_probs: Tensor | None = None
    # algorithm.rollout_correction (decoupled mode): truncated IS weights on the policy loss, and
    # rejection sampling's mask (1: kept), which leaves rejected tokens out of every loss.
    # None: no decoupled correction (no rejection, for rollout_keep).
    rollout_is_weights: Tensor | None = None  # [N, R]
    rollout_keep: Tensor | None = None  # [N, R]

    @property
    def loss_mask(self) -> Tensor:  # [N, R] the tokens the losses train on
        return (
            self.response_mask
            if self.rollout_keep is None
            else self.response_mask * self.rollout_keep
        )


@dataclass(slots=True, kw_only=True)
class GenerationResult:
    """One generation call's samples on their way to scoring, with what came with them."""

    batch: GeneratedBatch
    # the engine's parts (timing_s/gen_*)
    timing: dict[str, float]
    # per sample, its scoring as begun when it finished (a rewards StartedSample; None: not begun);
    # None: nothing began ahead
    started: list | None = None
    # ReMax: each prompt's greedy response, from the same policy; None: no baseline rollout
    greedy: GeneratedBatch | None = None
    # partial rollouts: samples dropped past the off-policy bound in this round
    dropped: int = 0


@dataclass(slots=True, kw_only=True, frozen=True)
class StepSamples:
    """A step's scored samples as its rollout hands them to the trainer, with what producing them
    measured."""

    batch: ScoredBatch
    # reward, dynamic-sampling and async metrics (reward/*, dynamic_sampling/*, async/*)
    metrics: dict[str, float]
    # generation's parts (timing_s/gen_*): seconds summed over the step's generation calls
    timing: dict[str, float]


def trim_padding(batch: GeneratedBatch):
    """The same samples without the columns that are padding in all of them: prompt columns on the
    left, response columns on the right. A micro-batch of short samples then costs what they cost,
    not what the longest sample of the whole batch does."""
    prompt_width = int(batch.prompt_mask.sum(-1).max())
    real = batch.response_tokens.bool()
    # past the last real token
    response_width = max(int((real * torch.arange(1, real.shape[1] + 1)).max()), 1)
    full_width = batch.response_ids.shape[1]
    trimmed = {}
    for f in dataclasses.fields(batch):
        value = getattr(batch, f.name)
        if f.name in ("prompt_ids", "prompt_mask"):
            value = value[:, value.shape[1] - prompt_width :]
        elif isinstance(value, Tensor) and value.dim() >= 2 and value.shape[1] == full_width:
            value = value[:, :response_width]  # [n, R] and [n, R, k] fields
        trimmed[f.name] = value
    return type(batch)(**trimmed)


def pad_responses(values: Tensor, width: int, value: float = 0) -> Tensor:
    """[n, r, ...] -> [n, width, ...], `value` on the right of dimension 1: undoes trim_padding for
    per-token outputs."""
    trailing = (0, 0) * (values.dim() - 2)
    return torch.nn.functional.pad(values, (*trailing, 0, width - values.shape[1]), value=value)


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """Positions that skip left padding, as `generate` computes them: [B, L] -> [B, L]."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)
