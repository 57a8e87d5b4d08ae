"""Held-out evaluation: generate on held-out prompts with `val_kwargs`, report accuracy per data_source
(`val/<data_source>/acc`, as verl logs validation)."""

from __future__ import annotations

from collections import defaultdict

from keel.data.prompts import collate_prompts
from keel.types import SamplingParams


def evaluate(generate, reward, records, pad_token_id: int, val_kwargs, data_cfg) -> dict[str, float]:
    """`val/<data_source>/acc`: the mean score over every sample (mean@n when val_kwargs.n > 1).
    `generate(prompts, params)` is a rollout engine's or the worker group's."""
    params = SamplingParams(n=val_kwargs.n, do_sample=val_kwargs.do_sample and val_kwargs.temperature > 0,
                            temperature=val_kwargs.temperature or 1.0, top_p=val_kwargs.top_p,
                            top_k=val_kwargs.top_k, max_new_tokens=data_cfg.max_response_length)
    batch_size = data_cfg.val_batch_size or len(records)
    scores_by_source: dict[str, list[float]] = defaultdict(list)
    lengths: list[float] = []
    not_scored = 0
    for start in range(0, len(records), batch_size):
        prompts = collate_prompts(records[start:start + batch_size], pad_token_id).repeat_interleave(params.n)
        batch = generate(prompts, params)
        # a sample the scorer fails on counts as wrong here, and is counted
        result = reward.score_batch(batch.records, batch.response_texts, on_error="zero", may_skip=False)
        scores = result.scores
        not_scored += int(result.metrics["reward/not_scored_ratio"] * len(batch))
        for record, score in zip(batch.records, scores.tolist()):
            scores_by_source[record.data_source].append(score)
        lengths += batch.response_lengths.float().tolist()
    metrics = {f"val/{source}/acc": sum(s) / len(s) for source, s in sorted(scores_by_source.items())}
    metrics["val/response_length/mean"] = sum(lengths) / len(lengths)
    metrics["val/not_scored_ratio"] = not_scored / len(lengths)
    return metrics
