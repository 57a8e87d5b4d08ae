"""Running reward normalisation: scores become z-scores against the recent window of scores."""

from __future__ import annotations

from collections import deque

import torch


class RunningNormalizer:
    """z = clip((score - mean) / (std + eps), -clip, clip), mean and std over the last
    `window_size` scores including this batch's. Its window is saved in checkpoints, so a resumed
    run normalises exactly as the uninterrupted one."""

    def __init__(self, window_size: int, eps: float, clip: float | None):
        self.window: deque[float] = deque(maxlen=window_size)
        self.eps = eps
        self.clip = clip

    def __call__(self, scores: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:  # [N] -> [N]
        self.window.extend(scores.tolist())
        history = torch.tensor(list(self.window))
        mean = history.mean()
        std = history.std() if len(history) > 1 else torch.tensor(0.0)
        normalised = (scores - mean) / (std + self.eps)
        if self.clip is not None:
            normalised = normalised.clamp(-self.clip, self.clip)
        return normalised, {"reward/norm_mean": mean.item(), "reward/norm_std": std.item()}

    def state_dict(self) -> dict:
        return {"window": list(self.window)}

    def load_state_dict(self, state: dict) -> None:
        self.window.clear()
        self.window.extend(state["window"])
