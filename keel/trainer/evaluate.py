"""Held-out evaluation: generate on held-out prompts with `val_kwargs`, report accuracy per
data_source as keel logs it (`val/<data_source>/acc`) and as verl does
(`val-core/<data_source>/<var>/mean@N`, `val-aux/...` for the other variables of dict results)."""

from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from keel.data.prompts import collate_prompts
from keel.types import SamplingParams

# `evaluate` alone (keel demo's) stays a light import
if TYPE_CHECKING:
    from keel.config.schema import KeelConfig
    from keel.observe.metrics import MetricsLogger
    from keel.trainer.setup import Components


class Validation:
    """Held-out evaluation within an RL run: when it is due, and its generations logged."""

    def __init__(self, cfg: KeelConfig, components: Components):
        self.cfg = cfg
        self.components = components

    def due(self, step: int) -> bool:
        """Every test_freq steps, and after the last step so a run always ends with a number."""
        freq = self.cfg.trainer.test_freq
        last = step == self.components.total_steps and freq > 0
        return bool(self.components.val_data) and ((freq > 0 and step % freq == 0) or last)

    def __call__(self, step: int, seed: int, logger: MetricsLogger) -> dict[str, float]:
        parts = self.components
        logger.phase("validate")

        def generate(prompts, params):
            return parts.workers.generation.generate(prompts, params, seed)[0]

        metrics, samples = evaluate(
            generate,
            parts.reward,
            parts.val_data,
            parts.tokenizer.pad_token_id,
            self.cfg.actor_rollout_ref.rollout.val_kwargs,
            self.cfg.data,
            keep_samples=self.cfg.trainer.log_val_generations,
        )
        # trainer.log_val_generations, as verl logs them: a table per evaluation
        if samples:
            logger.log_table(step, "val/generations", samples)
            # keel report's
            logger.log_samples(step, [{"split": "val", **sample} for sample in samples])
        return metrics


def evaluate(
    generate, reward, records, pad_token_id: int, val_kwargs, data_cfg, keep_samples: int = 0
) -> tuple[dict[str, float], list[dict]]:
    """(metrics, the first `keep_samples` generations). `val/<data_source>/acc`: the mean score over
    every sample (mean@n when val_kwargs.n > 1). `generate(prompts, params)` is a rollout engine's
    or the worker group's."""
    params = SamplingParams(
        n=val_kwargs.n,
        do_sample=val_kwargs.do_sample and val_kwargs.temperature > 0,
        temperature=val_kwargs.temperature or 1.0,
        top_p=val_kwargs.top_p,
        top_k=val_kwargs.top_k,
        max_new_tokens=data_cfg.max_response_length,
    )
    batch_size = data_cfg.val_batch_size or len(records)
    # source -> var -> values
    values: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    lengths: list[float] = []
    samples: list[dict] = []
    not_scored = 0
    for start in range(0, len(records), batch_size):
        prompts = collate_prompts(
            records[start : start + batch_size], pad_token_id
        ).repeat_interleave(params.n)
        batch = generate(prompts, params)
        # a sample trained as segments is judged once, on its final one
        if batch.sample_index is not None:
            batch = batch.select(batch.final_segments.unique())
        # a sample the scorer fails on counts as wrong here, and is counted
        result = reward.score_batch(
            batch.records, batch.response_texts, on_error="zero", may_skip=False
        )
        not_scored += int(result.metrics["reward/not_scored_ratio"] * len(batch))
        for record, text, score, extras in zip(
            batch.records,
            batch.response_texts,
            result.scores.tolist(),
            result.extras or [{}] * len(batch),
        ):
            values[record.data_source]["reward"].append(score)
            for key, value in extras.items():
                if not isinstance(value, str):
                    values[record.data_source][key].append(float(value))
            if len(samples) < keep_samples:
                samples.append(_kept_sample(record, text, score))
        lengths += batch.response_lengths.float().tolist()
    metrics = {
        f"val/{source}/acc": _mean(by_var["reward"]) for source, by_var in sorted(values.items())
    }
    metrics.update(verl_validation_metrics(values, params.n))
    metrics["val/response_length/mean"] = _mean(lengths)
    metrics["val/not_scored_ratio"] = not_scored / len(lengths)
    return metrics, samples


def _kept_sample(record, text: str, score: float) -> dict:
    """A validation generation as it is logged (trainer.log_val_generations)."""
    conversation = record.extra_info.get("conversation")
    return {
        "data_source": record.data_source,
        "prompt": record.prompt_text,
        "response": text,
        "ground_truth": str(record.ground_truth),
        "score": score,
        **({"conversation": conversation} if "conversation" in record.extra_info else {}),
    }


def verl_validation_metrics(values: dict[str, dict[str, list[float]]], n: int) -> dict[str, float]:
    """verl's names: the core variable (`acc` when the reward function returns one, else `reward`)
    under val-core, every other one under val-aux; mean@n over all samples (each prompt has n)."""
    metrics = {}
    for source, by_var in sorted(values.items()):
        core = "acc" if "acc" in by_var else "reward"
        for var, vals in by_var.items():
            metrics[f"{'val-core' if var == core else 'val-aux'}/{source}/{var}/mean@{n}"] = _mean(
                vals
            )
    return metrics


def _mean(values: list[float]) -> float:
    return sum(values) / max(len(values), 1)
