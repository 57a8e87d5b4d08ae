"""What a bench record says: the measured steps' metrics summarised, with the update's useful
FLOPs (MFU) and the decode step's share of the memory bandwidth read against this GPU."""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
from functools import partial
from pathlib import Path

import torch

from keel.bench.workloads import Workload, shape_config
from keel.models.families import active_parameters
from keel.models.load import meta_model, stored_parameters

# Datasheet figures by GPU name: bf16 dense TFLOP/s (no sparsity), HBM TB/s. Another GPU gets no
# datasheet numbers rather than an H200's.
DATASHEETS = {"H200": (989.4, 4.8), "H100": (989.4, 3.35), "A100": (312.0, 2.0)}


def summarize(name: str, w: Workload, cfg, steps: list[dict]) -> dict:
    """The record of a run from its measured steps' metrics."""
    mean = partial(_mean, steps)
    gpus = cfg.world_size
    samples = w.prompts * w.n
    # v2: EOS-ended
    seq = w.prompt_length + (mean("response_length/mean") if w.mean_response else w.response_length)
    params = stored_parameters(cfg.actor_rollout_ref.model.path) or _architecture_parameters(
        w.model
    )
    shape = shape_config(w.model)
    active = active_parameters(shape, params)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    datasheet = next((figures for gpu, figures in DATASHEETS.items() if gpu in device), None)
    gen_tokens_per_s, decode_tokens_per_s = _generation_rates(w, samples, mean)
    return {
        "workload": name,
        "date": datetime.date.today().isoformat(),
        "commit": source_commit(),
        "device": device,
        "n_gpus": gpus,
        "rollout": cfg.actor_rollout_ref.rollout.name,
        "parameters": params,
        "active_parameters": active,
        "model_type": shape.model_type,
        "step_time_s": mean("timing_s/step"),
        "response_length_mean": mean("response_length/mean"),
        "steps_per_s": 1 / mean("timing_s/step"),
        "gen_tokens_per_s": gen_tokens_per_s,
        "decode_tokens_per_s": decode_tokens_per_s,
        "decode_bandwidth_utilisation": decode_bandwidth_utilisation(
            w, shape, params, (decode_tokens_per_s or gen_tokens_per_s) / gpus, datasheet
        ),
        **_update_figures(cfg, shape, active, samples * seq, seq, mean, device, datasheet),
        # the samples the pass computed (not the first mini-batch's); an on-policy update has no
        # pass
        "logprob_tokens_per_s": (mean("perf/old_log_prob_samples") or samples)
        * seq
        / mean("timing_s/old_log_prob")
        if mean("timing_s/old_log_prob")
        else None,
        "throughput_tokens_per_s_per_gpu": mean("perf/throughput"),
        **_per_phase(steps, mean),
    }


def engine_figures(info: dict, steps: list[dict]) -> dict:
    """The generating rank's engine (its worker's `info`) in the record: its name, how the actor's
    weights reach it (path, seconds a step) and whether its KV cache and CUDA graphs stay between
    steps (seconds a step capturing graphs: none where they are kept)."""
    mean = partial(_mean, steps)
    return {
        "engine": info["rollout_engine"],
        "weight_sync": {
            "path": info["weight_sync"],
            "seconds": mean("timing_s/sync_rollout_weights"),
        },
        "kv_cache": {"kept": info["kv_cache_kept"], "capture_s": mean("timing_s/gen_capture")},
    }


def _mean(steps: list[dict], key: str) -> float | None:
    """A metric's mean over the measured steps, or None where none has it."""
    values = [m[key] for m in steps if key in m]
    return statistics.fmean(values) if values else None


def _update_figures(
    cfg, shape, active: int, sample_tokens: int, seq: int, mean, device: str, datasheet
) -> dict:
    """The update's tokens/s and its MFU, against this GPU's measured peak and its datasheet's."""
    update_tokens = sample_tokens * cfg.actor_rollout_ref.actor.ppo_epochs
    update_s = mean("timing_s/update_actor")
    update_flops = (
        useful_update_flops(cfg, shape, active, update_tokens, seq) / update_s / cfg.world_size
    )
    peak = measured_peak_tflops() * 1e12 if torch.cuda.is_available() else None
    return {
        "update_tokens_per_s": update_tokens / update_s,
        # None: no GPU to measure a peak on
        "update_mfu": update_flops / peak if peak else None,
        "update_mfu_datasheet": update_flops / (datasheet[0] * 1e12) if datasheet else None,
        "datasheet": f"{device}: {datasheet[0]} TFLOP/s bf16 dense, {datasheet[1]} TB/s"
        if datasheet
        else None,
        "peak_tflops_measured": peak / 1e12 if peak else None,
    }


def _per_phase(steps: list[dict], mean) -> dict:
    """Peak memory, and the metrics kept by prefix: each phase's, the agent's and async's."""

    def highest(key: str) -> float:
        return max((m.get(key, 0.0) for m in steps), default=0.0)

    def means(prefix: str) -> dict:
        return {k[len(prefix) :]: mean(k) for k in steps[-1] if k.startswith(prefix)}

    return {
        # the fullest GPU, over the whole step
        "peak_memory_gb": highest("perf/max_memory_allocated_gb"),
        "peak_memory_gb_per_phase": {
            k[len("perf/peak_memory_gb/") :]: highest(k)
            for k in steps[-1]
            if k.startswith("perf/peak_memory_gb/")
        },
        "log_prob_gap": mean("rollout/log_prob_gap"),
        # agent code as the rollout (m1a): how its samples ended
        "agent": means("agent/") or None,
        # trainer.mode=async: how old the trained samples were, how many batches waited
        "async": means("async/") or None,
        "timing_s": means("timing_s/"),
    }


def _architecture_parameters(shape: str) -> int:
    """A shape's parameters counted on the meta device (one whose weights are never saved)."""
    return sum(p.numel() for p in meta_model(shape_config(shape)).parameters())


def busy_unprofiled(gpu_seconds: dict[str, float], steps: list[dict]) -> dict[str, float]:
    """Each timed phase's GPU-busy seconds (from the profiled step) over its mean wall time in the
    unprofiled steps: how busy the GPU is when no profiler slows the host (capped at 1)."""
    shares = {}
    for phase, busy_s in gpu_seconds.items():
        walls = [m[f"timing_s/{phase}"] for m in steps if f"timing_s/{phase}" in m]
        if walls and busy_s > 0:
            shares[phase] = round(min(1.0, busy_s / statistics.fmean(walls)), 4)
    return shares


def useful_update_flops(cfg, shape, active: int, update_tokens: int, seq: int) -> float:
    """Useful training FLOPs of the update: 6 per parameter per token (forward 2, input and weight
    gradients 2 each), 4 for LoRA's frozen base, which has no weight gradients (the adapters' are a
    rounding error), plus causal attention (QK^T and AV). Gradient checkpointing's recompute is not
    useful."""
    # per token, causal mean seq/2 x 2
    attention = 6 * 2 * shape.num_hidden_layers * shape.num_attention_heads * _head_dim(shape) * seq
    per_parameter = 4 if cfg.actor_rollout_ref.model.lora_rank else 6
    return update_tokens * (per_parameter * active + attention)


def _generation_rates(w: Workload, samples: int, mean) -> tuple[float, float | None]:
    """(tokens/s of generation, tokens/s of its decode steps alone); `mean(key)`: a metric's mean
    over the measured steps."""
    # The model's own tokens (multi-turn: not the tools' or the template's between its turns).
    generated = mean("response_length/mean") or w.response_length
    gen_tokens_per_s = samples * generated / mean("timing_s/gen")
    # Decode steps alone (the native engine times them): every token but each turn's first, which
    # prefill samples (multi-turn: an assistant turn and a user turn alternate after the prompt).
    decode_s = mean("timing_s/gen_decode")
    turns = (mean("num_turns/mean") or 2) / 2
    return gen_tokens_per_s, (samples * (generated - turns) / decode_s if decode_s else None)


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def decode_bandwidth_utilisation(
    w: Workload,
    shape,
    params: int,
    tokens_per_s_per_gpu: float,
    datasheet: tuple[float, float] | None,
) -> float | None:
    """Bytes a decode step must read (bf16 weights once, every expert of a mixture included, plus
    every sequence's KV cache at its mean context) per generated token, times tokens/s, over the
    datasheet's HBM bandwidth."""
    if datasheet is None:
        return None
    batch = w.prompts * w.n
    kv_per_token = 2 * shape.num_hidden_layers * shape.num_key_value_heads * _head_dim(shape) * 2
    mean_context = w.prompt_length + w.response_length / 2
    bytes_per_token = (2 * params + batch * mean_context * kv_per_token) / batch
    return bytes_per_token * tokens_per_s_per_gpu / (datasheet[1] * 1e12)


_PEAK: list[float] = []


def measured_peak_tflops() -> float:
    """bf16 matmul throughput of this GPU (8192^3, best of several): the ceiling MFU is read
    against."""
    if not _PEAK:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        best = 0.0
        for _ in range(5):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                a @ b
            end.record()
            torch.cuda.synchronize()
            best = max(best, 20 * 2 * 8192**3 / (start.elapsed_time(end) / 1e3) / 1e12)
        _PEAK.append(best)
    return _PEAK[0]


def source_commit() -> str:
    """KEEL_COMMIT if set (a copy of the tree without its own git history, as on a lent GPU
    machine), else the checkout's commit, marked +dirty when files differ from it."""
    if os.environ.get("KEEL_COMMIT"):
        return os.environ["KEEL_COMMIT"]
    try:
        return (
            subprocess.run(
                ["git", "describe", "--always", "--dirty=+dirty"],
                capture_output=True,
                text=True,
                cwd=Path(__file__).parent,
                timeout=10,
            ).stdout.strip()
            or "unknown"
        )
    except OSError:
        return "unknown"
