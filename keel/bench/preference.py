"""Preference-training benchmarks: DPO steps on a family's released shapes with random weights and
pairs of fixed lengths, beside TRL's DPOTrainer on the same model and shapes in the same call.

d1: Qwen2.5-0.5B shapes, 64 pairs a step, 512 prompt and 512 completion tokens per sequence. keel
takes its defaults (the reference's log-probs computed once before step 1, the record says how
long that took); `--trl` also runs benchmarks/trl_dpo.py (TRL's own DPOTrainer, its reference a
frozen copy) and the record carries both sides.
"""

from __future__ import annotations

import datetime
import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.bench.record import source_commit

# keel's byte-level tokenizer reads a lowercase letter as one token
LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class PairWorkload:
    # a key of bench.workloads' shapes
    model: str
    # pairs per optimiser step, and per forward/backward
    pairs: int
    micro: int
    # tokens of each sequence's prompt and completion (the completion's last is EOS)
    prompt_length: int
    completion_length: int


PAIR_WORKLOADS = {
    "d1": PairWorkload("0.5b", 64, 8, 512, 512),
    "tinyd": PairWorkload("tiny", 8, 4, 16, 16),
}


def make_pairs(w: PairWorkload, path: Path, count: int) -> Path:
    """`count` pairs of random letters: prompts of exactly prompt_length tokens, completions of
    completion_length with their EOS."""
    rng = random.Random(0)

    def text(n: int) -> str:
        return "".join(rng.choice(LETTERS) for _ in range(n))

    rows = [
        {
            "prompt": text(w.prompt_length),
            "chosen": text(w.completion_length - 1),
            "rejected": text(w.completion_length - 1),
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def pair_config(w: PairWorkload, model_dir: Path, data: Path, run_dir: Path, steps: int) -> dict:
    return {
        "objective": "dpo",
        "data": {
            "train_files": [str(data)],
            "max_length": w.prompt_length + w.completion_length,
            "truncation": "error",
            "train_batch_size": w.pairs,
            "micro_batch_size_per_gpu": w.micro,
            "shuffle": False,
        },
        "model": {"path": str(model_dir)},
        "optim": {"lr": 1e-6},
        "trainer": {
            "default_local_dir": str(run_dir),
            "total_training_steps": steps,
            "logger": [],
            "resume_mode": "disable",
        },
    }


def run_pair_bench(
    name: str,
    steps: int,
    warmup: int,
    overrides: list[str] | None,
    out: Path | None,
    workdir: Path,
    with_trl: bool = False,
) -> dict:
    from keel.bench.run import make_model
    from keel.config.load import load_config
    from keel.config.preference import PreferenceConfig

    w = PAIR_WORKLOADS[name]
    model_dir = make_model(w.model, workdir / f"model_{w.model}")
    data = make_pairs(w, workdir / f"pairs_{name}.jsonl", w.pairs * (warmup + steps))
    run_dir = workdir / f"run_{name}"
    cfg = load_config(
        pair_config(w, model_dir, data, run_dir, warmup + steps),
        overrides,
        schema=PreferenceConfig,
    )
    record = {
        "workload": name,
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "pairs": w.pairs,
        "micro_pairs": w.micro,
        "prompt_length": w.prompt_length,
        "completion_length": w.completion_length,
        "reference": cfg.reference,
        "share_prompt": cfg.data.share_prompt,
        "overrides": list(overrides or []),
        **_keel_steps(cfg, steps, warmup),
    }
    if with_trl:
        try:
            peer = _trl_record(w, model_dir, workdir, steps, warmup)
        except subprocess.CalledProcessError as e:
            # keel's figures are kept; the record says the other side did not run
            record["trl_error"] = f"benchmarks/trl_dpo.py exited with {e.returncode}"
        else:
            record.update({key: value for key, value in peer.items() if key.startswith("trl_")})
            record["speedup_vs_trl"] = record["trl_step_time_s"] / record["step_time_s"]
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def _keel_steps(cfg, steps: int, warmup: int) -> dict:
    from keel import checkpoint as ckpt
    from keel.config.load import to_yaml
    from keel.trainer.preference import PreferenceTrainer

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    trainer = PreferenceTrainer(cfg)
    ckpt.init_run_dir(trainer.run_dir, to_yaml(cfg), None)
    start = time.perf_counter()
    trainer.reference.prepare(trainer.splits)
    reference_s = time.perf_counter() - start
    per_step = []
    for _ in range(warmup + steps):
        trainer.step += 1
        per_step.append(trainer.train_step())
    measured = per_step[warmup:]
    step_times = [m["timing_s/step"] for m in measured]
    figures = {
        "step_time_s": sum(step_times) / len(step_times),
        "step_times_s": step_times,
        "tokens_per_s": sum(m["perf/throughput"] for m in measured) / len(measured),
        # once per run (per epoch of pairs): the cached reference's pass
        "reference_precompute_s": reference_s if cfg.reference == "cached" else None,
        "peak_memory_gb": torch.cuda.max_memory_allocated() / 1e9
        if torch.cuda.is_available()
        else None,
        "loss_first": per_step[0]["train/loss"],
    }
    del trainer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return figures


def _trl_record(w: PairWorkload, model_dir: Path, workdir: Path, steps: int, warmup: int) -> dict:
    """TRL's DPOTrainer on the same model and shapes: benchmarks/trl_dpo.py in a process of its
    own (its memory peak is its own)."""
    script = Path(__file__).parents[2] / "benchmarks" / "trl_dpo.py"
    out = workdir / "trl_dpo.jsonl"
    out.unlink(missing_ok=True)
    command = [
        sys.executable,
        str(script),
        "--model",
        str(model_dir),
        "--pairs",
        str(w.pairs),
        "--prompt",
        str(w.prompt_length),
        "--completion",
        str(w.completion_length),
        "--micro",
        str(w.micro),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--out",
        str(out),
    ]
    subprocess.run(command, check=True)
    return json.loads(out.read_text().splitlines()[-1])
