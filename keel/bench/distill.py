"""On-policy distillation benchmarks: a student's GRPO workload with a frozen teacher scoring its
samples (distillation.enable), the teacher's pass timed against the student's own.

o1: Qwen2.5-1.5B shapes teaching Qwen2.5-0.5B shapes at t1's batch (16 prompts x 8 samples, 256
prompt and 256 response tokens, four mini-batches), both with random weights and keel's
tokenizer, distillation.mode=reverse_kl (`keel bench o1 distillation.mode=gkd` for GKD). The
record's `teacher_share` is the teacher's pass over the student's old-log-prob pass and update
together; issue 48's target is at most 0.5.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

from keel.bench.run import append_record, measure, micro_batch_size, write_drawn_model
from keel.bench.workloads import QWEN25_COMMON, QWEN25_SHAPES, WORKLOADS, shape_config

# Teacher shapes beyond bench.workloads' (any of whose keys a teacher may also be): the tiny
# student's layers at twice its width, as 1.5B is to 0.5B (a CPU check of the harness).
TEACHER_SHAPES = {
    "tiny-wide": dict(QWEN25_SHAPES["tiny"], hidden_size=128, intermediate_size=256),
}
# the bound on the teacher's share
TEACHER_SHARE_TARGET = 0.5


@dataclass(frozen=True)
class DistillWorkload:
    # the student's workload (a key of bench.workloads.WORKLOADS): its model, batch and lengths
    student: str
    # the teacher's shape (TEACHER_SHAPES, or a key of bench.workloads' shapes), random weights
    teacher: str
    mode: str = "reverse_kl"


DISTILL_WORKLOADS = {
    "o1": DistillWorkload("t1", "1.5b"),
    "tinyo": DistillWorkload("tiny", "tiny-wide"),
}


def teacher_config(shape: str):
    """The transformers config of a teacher shape."""
    from transformers import AutoConfig

    if shape in TEACHER_SHAPES:
        return AutoConfig.for_model("qwen2", **QWEN25_COMMON, **TEACHER_SHAPES[shape])
    return shape_config(shape)


def make_teacher(shape: str, out_dir: Path) -> Path:
    """The teacher's directory: its config and the student's tokenizer (keel's byte-level one); its
    random weights are drawn on the device at load, so nothing of its size is written."""
    if (out_dir / "config.json").exists():
        return out_dir
    # seed 1: not the student's draw
    return write_drawn_model(teacher_config(shape), out_dir, seed=1)


def distill_settings(w: DistillWorkload, teacher_dir: Path, gpus: int) -> list[str]:
    """The distillation section of a workload: the teacher's pass takes as many samples per forward
    as the student's old-log-prob pass, so the two compare per token."""
    micro = micro_batch_size(WORKLOADS[w.student], gpus)
    return [
        "distillation.enable=true",
        f"distillation.mode={w.mode}",
        f"distillation.teacher.path={teacher_dir}",
        f"distillation.teacher.log_prob_micro_batch_size_per_gpu={2 * micro}",
    ]


def run_distill_bench(
    name: str,
    steps: int = 5,
    warmup: int = 2,
    gpus: int = 1,
    overrides: list[str] | None = None,
    out: Path | None = None,
    workdir: Path | None = None,
    profile_dir: Path | None = None,
) -> dict:
    """A distillation workload as `keel bench` runs a GRPO one; the record adds the teacher's
    figures (distill_figures). `overrides` come after the workload's distillation settings."""
    w = DISTILL_WORKLOADS[name]
    root = Path(workdir or tempfile.mkdtemp(prefix="keel_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    teacher_dir = make_teacher(w.teacher, root / f"teacher_{w.teacher}")
    settings = distill_settings(w, teacher_dir, gpus) + list(overrides or [])
    run = measure(name, WORKLOADS[w.student], (warmup, steps), gpus, settings, root, profile_dir)
    record = run.record
    record["overrides"] = list(overrides or [])
    record.update(distill_figures(w, run.cfg, run.steps, run.warmup))
    append_record(out, record)
    return record


def distill_figures(w: DistillWorkload, cfg, steps: list[dict], warmup: int) -> dict:
    """The teacher, its pass's time against the student's passes (`teacher_share`: over the
    old-log-prob pass and the update, or over the update alone where the run has no old-log-prob
    pass), and distill/* of every step, warm-up first."""
    measured = steps[warmup:]
    teacher_s = _mean(measured, "timing_s/teacher")
    old_s = _mean(measured, "timing_s/old_log_prob")
    update_s = _mean(measured, "timing_s/update_actor")
    student_s = (old_s or 0.0) + update_s
    d = cfg.distillation
    samples = cfg.data.train_batch_size * cfg.actor_rollout_ref.rollout.n
    recomputed = _mean(measured, "perf/old_log_prob_samples")
    return {
        "student": w.student,
        "teacher": w.teacher,
        "teacher_parameters": _parameters(teacher_config(w.teacher)),
        "distill_mode": d.mode,
        "gkd_top_k": d.gkd.top_k if d.mode == "gkd" else None,
        # auto: the student's compute dtype (bf16 on a GPU)
        "teacher_dtype": d.teacher.dtype,
        "old_log_prob_pass": _old_log_prob_pass(recomputed, samples),
        "teacher_s": teacher_s,
        "old_log_prob_s": old_s,
        "update_actor_s": update_s,
        "teacher_share": teacher_s / student_s if teacher_s and student_s else None,
        "teacher_share_of": "old_log_prob + update_actor" if old_s else "update_actor",
        "teacher_share_target": TEACHER_SHARE_TARGET,
        "distill_reverse_kl_per_step": [m.get("distill/reverse_kl") for m in steps],
        "distill_per_step_warmup": warmup,
        "distill": {
            key[len("distill/") :]: _mean(measured, key)
            for key in measured[-1]
            if key.startswith("distill/")
        },
    }


def _old_log_prob_pass(recomputed: float | None, samples: int) -> str:
    """Which student pass the old log-probs came from, in words."""
    if not recomputed:
        return "none: on-policy (one mini-batch, one epoch), the update's own forward gives them"
    return (
        f"recomputed for {recomputed:.0f} of {samples} samples (the first mini-batch's are the "
        "update's own forward)"
        if recomputed < samples
        else f"recomputed for all {samples} samples"
    )


def _mean(steps: list[dict], key: str) -> float | None:
    values = [m[key] for m in steps if key in m]
    return sum(values) / len(values) if values else None


def _parameters(config) -> int:
    from keel.models.load import meta_model

    return sum(p.numel() for p in meta_model(config).parameters())
