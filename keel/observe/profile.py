"""`keel bench --profile`: a rank's work under torch.profiler, written as a kernel and phase table."""

from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class RankProfile:
    def __init__(self, device: torch.device):
        self.device = device
        cuda = [ProfilerActivity.CUDA] if device.type == "cuda" else []
        self.profiler = profile(activities=[ProfilerActivity.CPU] + cuda)
        self.profiler.__enter__()

    def stop(self, path: str | None) -> None:
        """Ends the profile; writes the table to `path` when given."""
        self.profiler.__exit__(None, None, None)
        if path:
            sort = "cuda_time_total" if self.device.type == "cuda" else "cpu_time_total"
            Path(path).write_text(self.profiler.key_averages().table(sort_by=sort, row_limit=60,
                                                                     max_name_column_width=90))
