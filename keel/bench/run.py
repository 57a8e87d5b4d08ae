"""`keel bench WORKLOAD`: a real GRPO run (keel's trainer, engines and workers) on a random-weight
model, timed per phase; one JSON record per run.

Responses have a fixed length (rollout.ignore_eos) so runs are comparable. The first `warmup`
steps (allocator growth, kernel selection) are left out of every number.
"""

from __future__ import annotations

import gc
import json
import logging
import random
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from keel.bench.record import busy_unprofiled, engine_figures, summarize
from keel.bench.workloads import DRAWN_ON_DEVICE, WORKLOADS, Workload, shape_config
from keel.models.load import RANDOM_WEIGHTS

log = logging.getLogger("keel")

REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return (sum(map(ord, solution_str)) % 7) / 6\n"
)


def make_model(shape: str, out_dir: Path, mean_response: int | None = None) -> Path:
    """A family's released shapes with random weights and keel's byte-level tokenizer (ids < 300).
    `mean_response`: responses end by EOS, at lengths about geometric with this mean: the generation
    config lists one stop token in every `mean_response` of the vocabulary, which a random model
    samples nearly uniformly (its logits' spread is small)."""
    from transformers import AutoModelForCausalLM

    if (out_dir / "config.json").exists():
        return out_dir
    config = shape_config(shape)
    if shape in DRAWN_ON_DEVICE:
        return write_drawn_model(config, out_dir)
    tokenizer = _save_tokenizer(config, out_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if mean_response:
        stops = range(mean_response - 1, config.vocab_size, mean_response)
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]
    model.save_pretrained(out_dir)
    return out_dir


def write_drawn_model(config, out_dir: Path, seed: int = 0) -> Path:
    """A model directory of `config` and keel's byte-level tokenizer only: its random weights are
    drawn on the device at load (keel.models.load.RANDOM_WEIGHTS), the same at every load."""
    _save_tokenizer(config, out_dir)
    config.save_pretrained(out_dir)
    (out_dir / RANDOM_WEIGHTS).write_text(json.dumps({"seed": seed}))
    return out_dir


def _save_tokenizer(config, out_dir: Path):
    """keel's byte-level tokenizer, saved to `out_dir`; its EOS and padding become `config`'s."""
    from keel.models.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    tokenizer.model_max_length = config.max_position_embeddings
    config.eos_token_id, config.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def _model_dir(workload: Workload) -> str:
    return f"model_{workload.model}" + (
        f"_stop{workload.mean_response}" if workload.mean_response else ""
    )


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


def micro_batch_size(workload: Workload, gpus: int) -> int:
    """The update's samples per micro-batch on each GPU (log-prob passes take twice as many)."""
    samples_per_mini = max(1, workload.prompts // 4) * workload.n
    tokens = workload.prompt_length + workload.response_length
    per_gpu = max(1, samples_per_mini // gpus)
    # About 16k tokens per forward, in micro-batches that split each GPU's share evenly (KEEL-C004).
    return max(
        d for d in range(1, per_gpu + 1) if per_gpu % d == 0 and d <= max(1, 16384 // tokens)
    )


def bench_config(name: str, workload: Workload, root: Path, steps: int, gpus: int) -> dict:
    micro = micro_batch_size(workload, gpus)
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
    root = Path(workdir or tempfile.mkdtemp(prefix="keel_bench_"))
    run = measure(
        name, WORKLOADS[name], (warmup, steps), gpus, list(overrides or []), root, profile_dir
    )
    run.record["overrides"] = list(overrides or [])
    append_record(out, run.record)
    return run.record


@dataclass(frozen=True)
class Measured:
    """A bench run: its record, every step's metrics (warm-up first) and the config it ran."""

    record: dict
    steps: list[dict]
    warmup: int
    cfg: object


def measure(
    name: str,
    workload: Workload,
    warmup_and_steps: tuple[int, int],
    gpus: int,
    settings: list[str],
    root: Path,
    profile_dir: Path | None = None,
) -> Measured:
    """`workload` run under `name` with `settings` (after the workload's own overrides) for its
    warm-up and measured steps, and the record of the measured ones."""
    from keel.config.load import load_run

    warmup, steps = warmup_and_steps
    root.mkdir(parents=True, exist_ok=True)
    # The profiled step (--profile) is one more after the measured ones: the profiler slows the
    # host, so its time is left out of the record's timings.
    total = warmup + steps + (profile_dir is not None)
    settings = [f"{k}={v}" for k, v in workload.overrides.items()] + settings
    cfg, plan = load_run(bench_config(name, workload, root, total, gpus), settings)
    # the run goes on past the measured steps, so they all generate ahead
    if plan.off_policy.ahead:
        cfg, plan = load_run(
            bench_config(name, workload, root, total + plan.off_policy.bound, gpus),
            settings,
        )
    profiled = {warmup + steps: profile_dir} if profile_dir is not None else {}
    per_step, engine, gpu_busy = _run_steps(cfg, plan, total, profiled, f"{name}_{gpus}gpu")
    measured = per_step[warmup : warmup + steps]
    record = summarize(name, workload, cfg, measured)
    record.update(engine_figures(engine, measured))
    # --profile on a GPU: the profiled step's phases, rank 0's GPU
    if gpu_busy.get("busy"):
        record["gpu_busy"] = gpu_busy["busy"]
        record["gpu_busy_unprofiled"] = busy_unprofiled(gpu_busy["gpu_s"], measured)
    return Measured(record, per_step[: warmup + steps], warmup, cfg)


def append_record(out: Path | None, record: dict) -> None:
    """One JSON line appended to `out` (None: nowhere)."""
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")


def _run_steps(
    cfg, plan, total: int, profiled: dict[int, Path], label: str
) -> tuple[list, dict, dict]:
    """`total` trainer steps of cfg under its plan (those in `profiled` under the profiler, into its
    folder) -> each step's metrics, the generating rank's info (its engine's name, whether its KV
    cache is kept, how its weights are synced) and the profiled GPU's busy shares."""
    from keel.observe.metrics import MetricsLogger
    from keel.trainer.rl import RLTrainer

    trainer = RLTrainer(cfg, plan=plan)
    trainer._open_run_dir()
    logger = MetricsLogger(trainer.run_dir, False, total, 0)
    per_step, gpu_busy = [], {}
    try:
        for i in range(total):
            trainer.step += 1
            with _profiled(trainer.components.workers, profiled.get(i), label, gpu_busy):
                per_step.append(trainer.guarded_step(logger))
        generating = trainer.components.workers.rollout_group or trainer.components.workers.group
        engine = generating.call("info", [()] * generating.world_size)[0]
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
    return per_step, engine, gpu_busy


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


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
