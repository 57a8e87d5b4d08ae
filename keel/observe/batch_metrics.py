"""Metrics computed from a finished batch, with verl's names."""

from __future__ import annotations

import torch

from keel.algorithms.utils import masked_mean
from keel.types import TrainBatch


def _stats(prefix: str, values: torch.Tensor) -> dict[str, float]:
    values = values.float()
    return {
        f"{prefix}/mean": values.mean().item(),
        f"{prefix}/max": values.max().item(),
        f"{prefix}/min": values.min().item(),
    }


def _masked_stats(prefix: str, values: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = values[mask.bool()]
    if valid.numel() == 0:
        return {}
    return {
        f"{prefix}/mean": masked_mean(values, mask).item(),
        f"{prefix}/max": valid.max().item(),
        f"{prefix}/min": valid.min().item(),
    }


def batch_metrics(batch: TrainBatch) -> dict[str, float]:
    mask = batch.response_mask
    lengths = batch.response_lengths.float()
    # a sample trained as segments is one score
    finals = batch.final_segments.unique()
    metrics = {
        **_stats("critic/score", batch.scores[finals]),
        **_stats("critic/rewards", batch.token_level_rewards.sum(-1)),
        **_masked_stats("critic/advantages", batch.advantages, mask),
        **_masked_stats("critic/returns", batch.returns, mask),
        **_stats("response_length", lengths),
        # responses cut at max_response_length without EOS: their reward may be for half an answer
        "response_length/clip_ratio": batch.truncated.float().mean().item(),
        **_stats("prompt_length", batch.prompt_mask.sum(-1).float()),
    }
    if batch.values is not None:
        metrics.update(_masked_stats("critic/values", batch.values, mask))
    # (rollout/log_prob_gap and actor/ref_kl are the trainer's, measured where the old log-probs
    # are.)
    return metrics


def throughput_metrics(batch: TrainBatch, step_seconds: float, workers: int) -> dict[str, float]:
    """Prompt and response tokens per second per worker over the whole step (verl's
    perf/throughput)."""
    tokens = batch.attention_mask.sum().item()
    return {
        "perf/total_num_tokens": float(tokens),
        "perf/throughput": tokens / max(step_seconds, 1e-9) / workers,
    }
