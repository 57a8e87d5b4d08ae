"""`keel bench WORKLOAD`: a real GRPO run (keel's trainer, engines and workers) on a random-weight
model, timed per phase; one JSON record per run.

Responses have a fixed length (rollout.ignore_eos) so runs are comparable. The first `warmup`
steps (allocator growth, kernel selection) are left out of every number.
"""

from __future__ import annotations

import datetime
import gc
import json
import logging
import os
import random
import statistics
import subprocess
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from keel.bench.workloads import DRAWN_ON_DEVICE, WORKLOADS, Workload, shape_config
from keel.models.families import active_parameters
from keel.models.load import RANDOM_WEIGHTS, meta_model, stored_parameters

log = logging.getLogger("keel")

# Datasheet figures by GPU name: bf16 dense TFLOP/s (no sparsity), HBM TB/s. Another GPU gets no
# datasheet numbers rather than an H200's.
DATASHEETS = {"H200": (989.4, 4.8), "H100": (989.4, 3.35), "A100": (312.0, 2.0)}
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (sum(map(ord, solution_str)) % 7) / 6\n"
)


def make_model(shape: str, out_dir: Path, mean_response: int | None = None) -> Path:
    """A family's released shapes with random weights and keel's byte-level tokenizer (ids < 300).
    `mean_response`: responses end by EOS, at lengths about geometric with this mean: the generation
    config lists one stop token in every `mean_response` of the vocabulary, which a random model samples
    nearly uniformly (its logits' spread is small)."""
    from transformers import AutoModelForCausalLM

    from keel.models.tiny import build_tokenizer

    if (out_dir / "config.json").exists():
        return out_dir
    tokenizer = build_tokenizer()
    config = shape_config(shape)
    tokenizer.model_max_length = config.max_position_embeddings
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokenizer.save_pretrained(out_dir)
    # config and tokenizer only: the weights are drawn on the device at load
    if shape in DRAWN_ON_DEVICE:
        config.save_pretrained(out_dir)
        (out_dir / RANDOM_WEIGHTS).write_text(json.dumps({"seed": 0}))
        return out_dir
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if mean_response:
        stops = range(mean_response - 1, config.vocab_size, mean_response)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]
    model.save_pretrained(out_dir)
    return out_dir


def _model_dir(workload: Workload) -> str:
    return f"model_{workload.model}" + (
        f"_stop{workload.mean_response}" if workload.mean_response else ""
    )


def _architecture_parameters(shape: str) -> int:
    """A shape's parameters counted on the meta device (one whose weights are never saved)."""
    return sum(p.numel() for p in meta_model(shape_config(shape)).parameters())


def make_prompts(workload: Workload, path: Path, count: int) -> Path:
    """Prompts of exactly `prompt_length` tokens (one byte per token, no chat template)."""
    rng = random.Random(0)
    rows = [
        {
            "prompt": "".join(
                rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(workload.prompt_length)
            ),
            "data_source": "bench",
            "reward_model": {"ground_truth": ""},
        }
        for _ in range(count)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def bench_config(name: str, workload: Workload, root: Path, steps: int, gpus: int) -> dict:
    samples_per_mini = max(1, workload.prompts // 4) * workload.n
    tokens = workload.prompt_length + workload.response_length
    per_gpu = max(1, samples_per_mini // gpus)
    # About 16k tokens per forward, in micro-batches that split each GPU's share evenly (KEEL-C004).
    micro = max(
        d for d in range(1, per_gpu + 1) if per_gpu % d == 0 and d <= max(1, 16384 // tokens)
    )
    policy = {
        "model": {
            "path": str(
                make_model(workload.model, root / _model_dir(workload), workload.mean_response)
            )
        },
        "actor": {
            "ppo_mini_batch_size": max(1, workload.prompts // 4),
            "ppo_micro_batch_size_per_gpu": micro,
            "use_kl_loss": workload.kl_loss,
            "optim": {"lr": 1e-6},
        },
        "rollout": {
            "n": workload.n,
            "ignore_eos": workload.mean_response is None,
            "log_prob_micro_batch_size_per_gpu": 2 * micro,
            "max_num_seqs": workload.prompts * workload.n,
        },
        "ref": {"log_prob_micro_batch_size_per_gpu": 2 * micro},
    }
    return {
        "data": {
            "train_files": [
                str(
                    make_prompts(
                        workload, root / f"prompts_{name}.jsonl", workload.prompts * (steps + 1)
                    )
                )
            ],
            "apply_chat_template": False,
            "max_prompt_length": workload.prompt_length,
            "max_response_length": workload.response_length,
            "train_batch_size": workload.prompts,
        },
        "actor_rollout_ref": policy,
        "algorithm": {"adv_estimator": "grpo"},
        "custom_reward_function": {"path": str(_write(root / "reward.py", REWARD))},
        "trainer": {
            "total_training_steps": steps,
            "logger": [],
            "test_freq": -1,
            "val_before_train": False,
            "n_gpus_per_node": gpus,
            "default_local_dir": str(root / f"run_{name}_{gpus}"),
            "log_samples": 0,
        },
    }


def run_bench(
    name: str,
    steps: int = 5,
    warmup: int = 2,
    gpus: int = 1,
    overrides: list[str] | None = None,
    out: Path | None = None,
    workdir: Path | None = None,
    profile_dir: Path | None = None,
) -> dict:
    from keel.config.load import load_config
    from keel.observe.metrics import MetricsLogger
    from keel.trainer.rl import RLTrainer

    workload = WORKLOADS[name]
    root = Path(workdir or tempfile.mkdtemp(prefix="keel_bench_"))
    root.mkdir(parents=True, exist_ok=True)
    # The profiled step (--profile) is one more after the measured ones: the profiler slows the
    # host, so its time is left out of the record's timings.
    total = warmup + steps + (profile_dir is not None)
    settings = [f"{k}={v}" for k, v in workload.overrides.items()] + list(overrides or [])
    cfg = load_config(bench_config(name, workload, root, total, gpus), settings)
    # the run goes on past the measured steps, so they all generate ahead
    if cfg.trainer.mode == "async":
        cfg = load_config(
            bench_config(name, workload, root, total + cfg.trainer.max_off_policy_steps, gpus),
            settings,
        )
    trainer = RLTrainer(cfg)
    trainer._open_run_dir()
    logger = MetricsLogger(trainer.run_dir, False, total, 0)
    per_step, gpu_busy = [], {}
    try:
        for i in range(total):
            trainer.step += 1
            with _profiled(
                trainer.components.workers,
                profile_dir if i == warmup + steps else None,
                f"{name}_{gpus}gpu",
                gpu_busy,
            ):
                per_step.append(trainer.guarded_step(logger))
        generating = trainer.components.workers.rollout_group or trainer.components.workers.group
        engine = generating.call("info", [()] * generating.world_size)[0]["rollout_engine"]
    finally:
        logger.close()
        # async: the batches generated ahead are dropped before the reward stops
        trainer.rollout.close()
        trainer.components.reward.shutdown()
        trainer.components.workers.shutdown()
        # a one-worker run holds its GPU memory in this process: free it for the next run
        del trainer
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    measured = per_step[warmup : warmup + steps]
    record = summarize(name, workload, cfg, measured)
    record["engine"] = engine
    record["overrides"] = list(overrides or [])
    # --profile on a GPU: the profiled step's phases, rank 0's GPU
    if gpu_busy.get("busy"):
        record["gpu_busy"] = gpu_busy["busy"]
        record["gpu_busy_unprofiled"] = busy_unprofiled(gpu_busy["gpu_s"], measured)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
    return record


def busy_unprofiled(gpu_seconds: dict[str, float], steps: list[dict]) -> dict[str, float]:
    """Each timed phase's GPU-busy seconds (from the profiled step) over its mean wall time in the
    unprofiled steps: how busy the GPU is when no profiler slows the host (capped at 1)."""
    shares = {}
    for phase, busy_s in gpu_seconds.items():
        walls = [m[f"timing_s/{phase}"] for m in steps if f"timing_s/{phase}" in m]
        if walls and busy_s > 0:
            shares[phase] = round(min(1.0, busy_s / statistics.fmean(walls)), 4)
    return shares


@contextmanager
def _profiled(workers, profile_dir: Path | None, label: str, gpu_busy: dict):
    """`keel bench --profile DIR`: a step under torch.profiler on every worker;
    rank 0's kernels and phases (keel's timers are named ranges) go to DIR as a table, and the
    share of each phase its GPU was busy into `gpu_busy`. With one worker it runs in this process,
    so the table has the driver's phases too."""
    if profile_dir is None:
        yield
        return
    profile_dir.mkdir(parents=True, exist_ok=True)
    path = profile_dir / f"profile_{label}.txt"
    workers.group.call("start_profile", [()] * workers.world)
    try:
        yield
    finally:
        gpu_busy.update(workers.group.call("stop_profile", [(str(path),)] * workers.world)[0])
    log.info("profile of one step (rank 0): %s", path)


def summarize(name: str, w: Workload, cfg, steps: list[dict]) -> dict:
    def highest(key: str) -> float:
        return max((m.get(key, 0.0) for m in steps), default=0.0)

    def mean(key: str) -> float | None:
        values = [m[key] for m in steps if key in m]
        return statistics.fmean(values) if values else None

    gpus = cfg.world_size
    samples = w.prompts * w.n
    # v2: EOS-ended
    seq = w.prompt_length + (mean("response_length/mean") if w.mean_response else w.response_length)
    params = stored_parameters(cfg.actor_rollout_ref.model.path) or _architecture_parameters(
        w.model
    )
    update_tokens = samples * seq * cfg.actor_rollout_ref.actor.ppo_epochs
    update_s = mean("timing_s/update_actor")
    shape = shape_config(w.model)
    active = active_parameters(shape, params)
    update_flops = useful_update_flops(cfg, shape, active, update_tokens, seq) / update_s / gpus
    peak = measured_peak_tflops() * 1e12 if torch.cuda.is_available() else None
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
        "update_tokens_per_s": update_tokens / update_s,
        # None: no GPU to measure a peak on
        "update_mfu": update_flops / peak if peak else None,
        "update_mfu_datasheet": update_flops / (datasheet[0] * 1e12) if datasheet else None,
        "datasheet": f"{device}: {datasheet[0]} TFLOP/s bf16 dense, {datasheet[1]} TB/s"
        if datasheet
        else None,
        "peak_tflops_measured": peak / 1e12 if peak else None,
        # the samples the pass computed (not the first mini-batch's); an on-policy update has no
        # pass
        "logprob_tokens_per_s": (mean("perf/old_log_prob_samples") or samples)
        * seq
        / mean("timing_s/old_log_prob")
        if mean("timing_s/old_log_prob")
        else None,
        "throughput_tokens_per_s_per_gpu": mean("perf/throughput"),
        # the fullest GPU, over the whole step
        "peak_memory_gb": highest("perf/max_memory_allocated_gb"),
        "peak_memory_gb_per_phase": {
            k[len("perf/peak_memory_gb/") :]: highest(k)
            for k in steps[-1]
            if k.startswith("perf/peak_memory_gb/")
        },
        "log_prob_gap": mean("rollout/log_prob_gap"),
        # agent code as the rollout (m1a): how its samples ended
        "agent": {k[len("agent/") :]: mean(k) for k in steps[-1] if k.startswith("agent/")} or None,
        # trainer.mode=async: how old the trained samples were, how many batches waited
        "async": {k[len("async/") :]: mean(k) for k in steps[-1] if k.startswith("async/")} or None,
        "timing_s": {
            k[len("timing_s/") :]: mean(k) for k in steps[-1] if k.startswith("timing_s/")
        },
    }


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
    """bf16 matmul throughput of this GPU (8192^3, best of several): the ceiling MFU is read against."""
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


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
