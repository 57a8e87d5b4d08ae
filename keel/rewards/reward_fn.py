"""Turn responses into scores: pick a scorer per data_source, call it, refuse bad results."""

from __future__ import annotations

import importlib.util
import math
import numbers
from pathlib import Path

import torch

from keel.diagnostics.codes import MISSING_GROUND_TRUTH, NO_SCORER, REWARD_FN_LOAD, REWARD_NOT_NUMBER, KeelError
from keel.rewards.scorers import DATA_SOURCE_SCORERS, SCORERS, RewardFn


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
    """Scores a batch of responses; a custom function, when given, scores every data_source."""

    def __init__(self, custom_fn: RewardFn | None = None):
        self.custom_fn = custom_fn

    def scorer_for(self, data_source: str) -> RewardFn:
        if self.custom_fn is not None:
            return self.custom_fn
        name = DATA_SOURCE_SCORERS.get(data_source) or ("gsm8k" if "gsm8k" in data_source else None)
        if name is None:
            raise KeelError(
                NO_SCORER,
                f"no scorer for data_source={data_source!r}; built-in ones serve "
                f"{sorted(DATA_SOURCE_SCORERS)}",
                "set custom_reward_function.path to a file with compute_score(data_source, "
                "solution_str, ground_truth, extra_info), or set data_source to a built-in one")
        return SCORERS[name]

    def check_records(self, records: list) -> None:
        """Fail before any generation if some row could not be scored: no scorer for its
        data_source, or no ground truth for a built-in scorer (which would score it 0 forever)."""
        for source in sorted({r.data_source for r in records}):
            self.scorer_for(source)
        if self.custom_fn is None:
            missing = [r.index for r in records if r.ground_truth is None]
            if missing:
                raise KeelError(MISSING_GROUND_TRUTH, f"{len(missing)} rows (first: row {missing[0]}) have no "
                                "reward_model.ground_truth, which the built-in scorers compare against")

    def score(self, records: list, response_texts: list[str]) -> torch.Tensor:      # -> [N]
        scores = [self._score_one(r, text) for r, text in zip(records, response_texts)]
        return torch.tensor(scores, dtype=torch.float32)

    def _score_one(self, record, response: str) -> float:
        fn = self.scorer_for(record.data_source)
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
