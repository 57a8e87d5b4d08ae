"""Which prompt groups carry a group-relative learning signal."""

from __future__ import annotations

import torch
from torch import Tensor


def groups_with_signal(values: Tensor, group_index: Tensor) -> Tensor:
    """[N] bool: samples whose group's values are not all equal (DAPO's dynamic sampling keeps
    these; a group whose samples all scored alike gives every one of them advantage 0)."""
    _, group = torch.unique(group_index, return_inverse=True)  # [N] 0..G-1
    count = torch.bincount(group).float()
    low = torch.full_like(count, float("inf")).scatter_reduce(0, group, values.float(), "amin")
    high = torch.full_like(count, -float("inf")).scatter_reduce(0, group, values.float(), "amax")
    return (high > low)[group]
