"""Turn responses into scores: pick a scorer per data_source, call it, refuse bad results."""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path

import torch

from keel.diagnostics.codes import MISSING_GROUND_TRUTH, NO_SCORER, REWARD_FN_LOAD, REWARD_NOT_NUMBER, KeelError
from keel.rewards.scorers import DATA_SOURCE_SCORERS, NO_GROUND_TRUTH, SCORERS, RewardFn


def load_custom_reward_fn(path: str, name: str) -> RewardFn:
    """Import `name` from the python file at `path` (verl's custom_reward_function)."""
    file = Path(path)
    if not file.is_file():
        raise KeelError(REWARD_FN_LOAD, f"custom_reward_function.path={path!r} does not exist")
    spec = importlib.util.spec_from_file_location(f"keel_custom_reward_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # the user's file: any import-time error is theirs to fix
        raise KeelError(REWARD_FN_LOAD, f"importing {path} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise KeelError(REWARD_FN_LOAD, f"{path} has no function {name!r} (it defines: {found})",
                        f"set custom_reward_function.name to one of {found}")
    return fn


class RewardScorer:
    """Scores a batch of responses.

    Per data_source: the weighted scorers named in `reward.scorers`, else the custom function (it
    serves every data_source, as in verl), else the built-in scorer for that data_source. The name
    `custom` in `reward.scorers` refers to the custom function, so it can be combined with rules.
    """

    def __init__(self, custom_fn: RewardFn | None = None, by_source: dict[str, dict[str, float]] | None = None,
                 overlong=None, max_response_length: int | None = None):
        self.custom_fn = custom_fn
        self.by_source = by_source or {}
        self.overlong = overlong if overlong is not None and overlong.enable else None
        self.max_response_length = max_response_length
        known = set(SCORERS) | ({"custom"} if custom_fn else set())
        for source, weights in self.by_source.items():
            unknown = sorted(set(weights) - known)
            if unknown:
                raise KeelError(NO_SCORER, f"reward.scorers.{source} names {unknown}, which are not scorers",
                                f"use built-in scorers {sorted(SCORERS)}" + (" or custom" if custom_fn else
                                " (set custom_reward_function.path to use `custom`)"))

    def scorers_for(self, data_source: str) -> dict[str, tuple[RewardFn, float]]:
        """{name: (function, weight)} for one data_source."""
        if data_source in self.by_source:
            return {name: (self.custom_fn if name == "custom" else SCORERS[name], weight)
                    for name, weight in self.by_source[data_source].items()}
        if self.custom_fn is not None:
            return {"custom": (self.custom_fn, 1.0)}
        name = DATA_SOURCE_SCORERS.get(data_source) or ("gsm8k" if "gsm8k" in data_source else None)
        if name is None:
            raise KeelError(
                NO_SCORER,
                f"no scorer for data_source={data_source!r}; built-in ones serve {sorted(DATA_SOURCE_SCORERS)}",
                "set custom_reward_function.path to a file with compute_score(data_source, solution_str, "
                "ground_truth, extra_info), map the source in reward.scorers, or set data_source to a built-in one")
        return {name: (SCORERS[name], 1.0)}

    def check_records(self, records: list) -> None:
        """Fail before any generation if some row could not be scored: no scorer for its
        data_source, or no ground truth for a built-in scorer (which would score it 0 forever)."""
        needs_truth = set()
        for source in sorted({r.data_source for r in records}):
            if any(name in SCORERS and name not in NO_GROUND_TRUTH for name in self.scorers_for(source)):
                needs_truth.add(source)
        missing = [r.index for r in records if r.data_source in needs_truth and r.ground_truth is None]
        if missing:
            raise KeelError(MISSING_GROUND_TRUTH, f"{len(missing)} rows (first: row {missing[0]}) have no "
                            "reward_model.ground_truth, which the built-in scorers compare against")

    def score(self, records: list, response_texts: list[str]) -> torch.Tensor:      # -> [N]
        return self.score_batch(records, response_texts)[0]

    def score_batch(self, records: list, response_texts: list[str],
                    response_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
        """Scores [N] and a per-scorer breakdown (`reward/<scorer>/mean`)."""
        totals, parts = [], {}
        for record, text in zip(records, response_texts):
            total = 0.0
            for name, (fn, weight) in self.scorers_for(record.data_source).items():
                value = self._call(fn, record, text)
                parts.setdefault(name, []).append(value)
                total += weight * value
            totals.append(total)
        scores = torch.tensor(totals, dtype=torch.float32)
        metrics = {f"reward/{name}/mean": sum(v) / len(v) for name, v in parts.items()} if len(parts) > 1 else {}
        if self.overlong is not None and response_lengths is not None:
            penalty = overlong_penalty(response_lengths, self.max_response_length, self.overlong)
            scores = scores + penalty
            metrics["reward/overlong_penalty/mean"] = penalty.mean().item()
        return scores, metrics

    def _call(self, fn: RewardFn, record, response: str) -> float:
        result = fn(record.data_source, response, record.ground_truth, record.extra_info)
        if isinstance(result, dict):  # verl's scorers may return {"score": x, ...}
            result = result.get("score")
        if isinstance(result, torch.Tensor) and result.numel() == 1:
            result = result.item()
        if not isinstance(result, numbers.Real) or not math.isfinite(result):  # numpy scalars are Real
            raise KeelError(
                REWARD_NOT_NUMBER,
                f"the reward function {getattr(fn, '__name__', fn)!r} returned {result!r} for a sample "
                f"of data_source={record.data_source!r} (response {response[:80]!r})")
        return float(result)


def overlong_penalty(lengths: torch.Tensor, max_response_length: int, cfg) -> torch.Tensor:
    """DAPO's soft overlong punishment (arXiv 2503.14476): 0 up to max_response_length - len, then
    falling linearly to -penalty_factor at max_response_length."""
    exceed = lengths.float() - (max_response_length - cfg.len)                   # [N]
    return torch.clamp(-exceed / cfg.len * cfg.penalty_factor, max=0.0)
