"""A step's samples, generated and scored: n per prompt of the sampler's next batch, or, with
algorithm.filter_groups, as many generation batches as DAPO's dynamic sampling needs; and ReMax's
baseline, the score of each prompt's greedy response."""

from __future__ import annotations

import dataclasses
import logging
from concurrent.futures import Future

import torch

from keel.config.schema import KeelConfig
from keel.data.prompts import PromptBatch, collate_prompts
from keel.observe.metrics import Timer
from keel.rewards.reward_fn import ScoreResult, StartedSample
from keel.rewards.score_metrics import merge_score_metrics
from keel.rollout.agent.metrics import external_agent_metrics
from keel.trainer.dynamic_sampling import fill_with_signal
from keel.trainer.generation import then
from keel.trainer.seeds import batch_seed
from keel.trainer.setup import Components, needs_baseline_rollout
from keel.types import (
    GeneratedBatch,
    GenerationResult,
    PartialSample,
    RoundEnd,
    SamplingParams,
    ScoredBatch,
    StepSamples,
)

log = logging.getLogger("keel")


def training_sampling(cfg: KeelConfig) -> SamplingParams:
    """How the training rollout samples (actor_rollout_ref.rollout; validation has val_kwargs)."""
    rollout = cfg.actor_rollout_ref.rollout
    return SamplingParams(
        n=rollout.n,
        do_sample=rollout.do_sample,
        temperature=rollout.temperature,
        top_p=rollout.top_p,
        top_k=rollout.top_k,
        max_new_tokens=cfg.data.max_response_length,
        ignore_eos=rollout.ignore_eos,
    )


class ScoredRollout:
    def __init__(self, cfg: KeelConfig, components: Components, sampling: SamplingParams):
        self.cfg = cfg
        self.components = components
        self.sampling = sampling
        # ReMax
        self.needs_baseline = needs_baseline_rollout(cfg)
        self.greedy = SamplingParams(n=1, do_sample=False, max_new_tokens=sampling.max_new_tokens)

    def __call__(self, timer: Timer, seed: int) -> StepSamples:
        """The step's generated and scored samples, with reward metrics and generation timing. With
        algorithm.filter_groups, DAPO's dynamic sampling: prompts whose samples all scored alike are
        dropped and more generated until data.train_batch_size prompts remain."""
        # each generation batch of a step samples with a seed of its own
        return self.fill(timer, lambda call, _: self.generate(timer, batch_seed(seed, call)))

    def fill(self, timer: Timer, next_generated, whole_groups: bool = False) -> StepSamples:
        """What __call__ returns, from `next_generated(call, groups wanted)` -> a GenerationResult:
        called once, or until enough groups are kept: with algorithm.filter_groups those with a
        signal (DAPO), with `whole_groups` (partial rollouts) those that lost no sample to a failed
        scoring."""
        pad, filter_groups = (
            self.components.tokenizer.pad_token_id,
            self.cfg.algorithm.filter_groups,
        )
        # the calls' generation: seconds summed, the rest the last call's
        gen: dict[str, float] = {}
        # each call's reward metrics, and its samples
        scored: list[tuple[dict[str, float], int]] = []

        def next_scored_batch(call: int = 0, wanted: int = 0) -> ScoredBatch:
            generated = next_generated(call, wanted)
            gen.update(
                {
                    k: v + (gen.get(k, 0.0) if k.startswith("timing_s/") else 0.0)
                    for k, v in generated.timing.items()
                }
            )
            with timer("reward"):
                samples = self.score(generated)
            scored.append((samples.metrics, len(generated.batch)))
            return samples.batch

        if not (filter_groups.enable or whole_groups):
            batch = next_scored_batch(0, self.cfg.data.train_batch_size)
            return StepSamples(batch=batch, metrics=scored[0][0], timing=gen)
        batch, counts = fill_with_signal(
            next_scored_batch,
            self.cfg.data.train_batch_size,
            filter_groups.metric if filter_groups.enable else None,
            filter_groups.max_num_gen_batches if filter_groups.enable else 0,
            pad,
            self.sampling.n if whole_groups else 0,
        )
        prefix = "dynamic_sampling" if filter_groups.enable else "async/refill"
        metrics = {
            **merge_score_metrics(scored),
            **{f"{prefix}/{name}": value for name, value in counts.items()},
        }
        return StepSamples(batch=batch, metrics=metrics, timing=gen)

    def generate(self, timer: Timer, seed: int) -> GenerationResult:
        """The samples of the sampler's next prompts (n each), the engine's timing of its parts,
        each sample's scoring as begun when it finished while the rest generated, and ReMax's greedy
        responses, generated next by the same policy."""
        prompts = self._next_prompts()
        started, finished = self._scoring_as_finished(prompts)
        with timer("gen"):
            batch, timing = self.components.workers.generation.generate(
                prompts, self.sampling, seed, finished
            )
        greedy = None
        if self.needs_baseline:
            with timer("gen_baseline"):
                greedy, _ = self.components.workers.generation.generate(
                    _each_once(prompts, self.components.tokenizer.pad_token_id), self.greedy, seed
                )
        return GenerationResult(batch=batch, timing=timing, started=started, greedy=greedy)

    def submit_generate(self, seed: int) -> Future:
        """generate, started on the rollout's own workers (the sampler's next prompts drawn now;
        ReMax's greedy responses sent right after, so the same weights answer): a future of a
        GenerationResult."""
        prompts, workers = self._next_prompts(), self.components.workers
        started, finished = self._scoring_as_finished(prompts)
        sampled = workers.generation.submit_generate(prompts, self.sampling, seed, finished)
        if not self.needs_baseline:
            return then(
                sampled,
                lambda generated: GenerationResult(
                    batch=generated[0], timing=generated[1], started=started
                ),
            )
        greedy = workers.generation.submit_generate(
            _each_once(prompts, self.components.tokenizer.pad_token_id), self.greedy, seed
        )

        def with_baseline(baseline) -> GenerationResult:
            batch, timing = sampled.result()
            # the greedy call's, on the rollout's workers
            seconds = baseline[1].get("timing_s/gen_engine", 0.0)
            return GenerationResult(
                batch=batch,
                timing={**timing, "timing_s/gen_baseline": seconds},
                started=started,
                greedy=baseline[0],
            )

        return then(greedy, with_baseline)

    def _scoring_as_finished(self, prompts: PromptBatch) -> tuple[list, object]:
        """(per sample, its scoring as begun when it finishes (None until then), the engine's
        `on_finished` that begins it, None where nothing can begin ahead)."""
        started: list[StartedSample | None] = [None] * len(prompts)
        if not self.scores_ahead:
            # nothing to tell: generation decodes and sends nothing for it
            return started, None

        # the record as the batch will hold it
        def finished(row: int, record, text: str) -> None:
            try:
                started[row] = self.start_scoring(record, text)
            # never a generation's failure: its batch scores it, and says why
            except Exception:  # noqa: BLE001
                log.exception("beginning a finished sample's scoring failed; its batch scores it")

        return started, finished

    @property
    def scores_ahead(self) -> bool:
        """Whether samples begin scoring as they finish (reward.score_ahead, and a reward that
        can)."""
        return self.cfg.reward.score_ahead and self.components.reward.can_start

    def start_scoring(self, record, response_text: str) -> StartedSample | None:
        """A finished sample's reward, begun in the scoring processes (see RewardScorer.start)."""
        return self.components.reward.start(record, response_text) if self.scores_ahead else None

    def generate_round(self, samples: list[PartialSample], seed: int, end: RoundEnd):
        """Partial rollouts: a round of `samples` until `end` -> (them continued, the engine's
        timing)."""
        return self.components.workers.generation.generate_round(samples, self.sampling, seed, end)

    @property
    def apart(self) -> bool:
        """The rollout has workers of its own (hybrid_engine=false): it may generate while the actor
        trains."""
        return self.components.workers.rollout_group is not None

    def _next_prompts(self) -> PromptBatch:
        parts = self.components
        prompts = collate_prompts(
            [parts.train_data[i] for i in parts.sampler.next_batch()], parts.tokenizer.pad_token_id
        )
        return prompts.repeat_interleave(self.sampling.n)

    def score(self, generated: GenerationResult) -> StepSamples:
        """The batch scored (and ReMax's baselines), less the samples that leave the update
        (reward.on_error=mask's not-scored ones, and those an agent's rollout dropped), with the
        reward metrics and the generation's timing."""
        batch = generated.batch
        scored = score_samples(self.components.reward, batch, generated.started)
        baselines = None if generated.greedy is None else self._baselines(generated.greedy, batch)
        batch = ScoredBatch.of(
            batch, scores=scored.scores, reward_extras=scored.extras, baselines=baselines
        )
        metrics = {**scored.metrics, **external_agent_metrics(batch.records, batch.final_segments)}
        kept = scored.scored & torch.tensor(
            ["agent_dropped" not in r.extra_info for r in batch.records]
        )
        if not kept.all():
            batch = batch.select(kept.nonzero().squeeze(-1))
        return StepSamples(batch=batch, metrics=metrics, timing=generated.timing)

    def _baselines(self, greedy: GeneratedBatch, batch: GeneratedBatch) -> torch.Tensor:  # [N]
        """ReMax (arXiv 2310.10505): the greedy response's score is each prompt's baseline, given
        to each of the prompt's samples in the batch."""
        result = self.components.reward.score_batch(
            greedy.records, greedy.response_texts, greedy.response_lengths, on_error="zero"
        )
        by_prompt = dict(zip((r.index for r in greedy.records), result.scores.tolist()))
        return torch.tensor([by_prompt[r.index] for r in batch.records])


def score_samples(reward, batch: GeneratedBatch, started: list | None = None) -> ScoreResult:
    """The reward of each sample, on its final segment (its last answer), given to its other
    segments too: a sample is scored once however many rows it trains as. `started`: per row, its
    scoring begun as it finished (a batch whose rows are whole samples)."""
    finals = batch.final_segments
    # sorted: the final segments, in batch order
    rows = finals.unique()
    if len(rows) == len(batch):
        ahead = started if started is not None and len(started) == len(batch) else None
        return reward.score_batch(
            batch.records, batch.response_texts, batch.response_lengths, started=ahead
        )
    picked = rows.tolist()
    scored = reward.score_batch(
        [batch.records[i] for i in picked],
        [batch.response_texts[i] for i in picked],
        batch.response_lengths[rows],
    )
    # each row's sample among the scored
    of = torch.searchsorted(rows, finals)
    return dataclasses.replace(
        scored,
        scores=scored.scores[of],
        scored=scored.scored[of],
        reasons=[scored.reasons[i] for i in of.tolist()],
        extras=[scored.extras[i] for i in of.tolist()] if scored.extras else scored.extras,
    )


def _each_once(prompts: PromptBatch, pad_token_id: int) -> PromptBatch:
    """The prompts of a batch that repeats each n times, each once (ReMax's greedy responses)."""
    first: dict[int, object] = {}
    for record in prompts.records:
        first.setdefault(record.index, record)
    return collate_prompts(list(first.values()), pad_token_id)
