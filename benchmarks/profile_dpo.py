"""Where a DPO step's time goes: d1 (or another pair workload) after two warm-up steps, one step
under torch.profiler, its kernel table and how busy the GPU was.

    python benchmarks/profile_dpo.py OUT.txt [d1] [key=value ...]
"""

import sys
import tempfile
import time
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.bench.preference import PAIR_WORKLOADS, make_pairs, pair_config
from keel.bench.run import make_model
from keel.config.load import load_config, to_yaml
from keel.config.preference import PreferenceConfig
from keel.trainer.preference import PreferenceTrainer


def main(out: Path, name: str, overrides: list[str]) -> None:
    w = PAIR_WORKLOADS[name]
    root = Path(tempfile.mkdtemp(prefix="keel_profile_dpo_"))
    model_dir = make_model(w.model, root / "model")
    data = make_pairs(w, root / "pairs.jsonl", w.pairs * 3)
    cfg = load_config(
        pair_config(w, model_dir, data, root / "run", 3), overrides, schema=PreferenceConfig
    )
    trainer = PreferenceTrainer(cfg)
    ckpt.init_run_dir(trainer.run_dir, to_yaml(cfg), None)
    trainer.reference.prepare(trainer.splits)
    for _ in range(2):
        trainer.step += 1
        trainer.train_step()
    cuda = torch.cuda.is_available()
    activities = [torch.profiler.ProfilerActivity.CPU] + (
        [torch.profiler.ProfilerActivity.CUDA] if cuda else []
    )
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as profile:
        trainer.step += 1
        trainer.train_step()
        sync()
    wall = time.perf_counter() - start
    table = profile.key_averages().table(
        sort_by="self_device_time_total", row_limit=45, max_name_column_width=70
    )
    # the table ends with the kernels' total ("Self CUDA time total"); the profiler slows the host,
    # so set it against an unprofiled step's time (keel bench d1), not this wall time
    out.write_text(f"{name} {overrides}: profiled step {wall:.3f} s wall\n\n{table}\n")
    print(out.read_text()[:400])


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "d1", sys.argv[3:])
