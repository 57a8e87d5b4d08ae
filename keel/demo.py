"""`keel demo`: a tiny model learns addition by SFT, then GRPO raises its held-out accuracy.

Everything is made here, with a seed: the task's data, a Qwen2-architecture model with random
weights and keel's byte-level tokenizer. It runs on 2 CPU cores in minutes (the README says how
many on which machine); `--smoke` runs a few steps of each stage in seconds, to check a setup.
A finished demo's table is kept (RESULT); running it again shows that table.
"""

from __future__ import annotations

import json
import logging
import random
import shlex
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import ClassVar

from keel.demo_result import RESULT, DemoResult, stored_result, val_metric

DATA_SOURCE = "keel/arithmetic"
# marks a directory as the demo's own, so a rerun may clear it
MARKER = "keel_demo.json"


@dataclass(frozen=True)
class DemoSettings:
    """Sized for 2 CPU cores. SFT runs in chunks until a dev set's accuracy reaches `sft_target`:
    part-way through learning to carry, sampled answers are often right and GRPO has a signal to
    amplify. Stopping on accuracy rather than a step count keeps that starting point alike on
    machines whose numerics differ; the climb is steep, so a chunk may overshoot the target (one
    2-core run's dev accuracy: 6% at step 150, 14% at 275, 38% at 300)."""

    # keel demo --task
    TASK: ClassVar[str] = "addition"
    # operands have up to this many digits
    digits: int = 2
    n_sft: int = 4000
    n_rl: int = 2000
    # decides when SFT stops; disjoint from the held-out set
    n_dev: int = 200
    n_heldout: int = 400
    hidden_size: int = 128
    num_layers: int = 4
    sft_target: float = 0.2
    sft_chunk: int = 25
    sft_max_steps: int = 1000
    sft_batch: int = 64
    sft_lr: float = 1e-3
    sft_max_length: int = 64
    grpo_steps: int = 120
    grpo_prompts: int = 64
    grpo_n: int = 8
    grpo_lr: float = 5e-5
    # optimiser steps per rollout
    grpo_mini_batches: int = 4
    test_freq: int = 20
    seed: int = 0
    # `--smoke`: a few steps of each stage, to check a setup
    smoke: bool = False


# `keel demo --smoke`: every stage runs and writes what it writes, in seconds; nothing is learnt.
SMOKE = {
    "smoke": True,
    "n_sft": 80,
    "n_rl": 32,
    "n_dev": 8,
    "n_heldout": 16,
    "sft_batch": 16,
    "sft_chunk": 5,
    "sft_max_steps": 5,
    "grpo_steps": 2,
    "grpo_prompts": 8,
    "grpo_n": 4,
    "grpo_mini_batches": 2,
    "test_freq": 2,
}


def smoke_settings(settings: DemoSettings) -> DemoSettings:
    return replace(settings, **SMOKE)


def addition_problem(rng: random.Random, digits: int) -> tuple[str, int]:
    a, b = rng.randrange(10**digits), rng.randrange(10**digits)
    return f"{a}+{b}=", a + b


def disjoint_problems(
    draw: Callable[[], tuple[str, int]], s: DemoSettings
) -> tuple[list[tuple[str, int]], ...]:
    """(held-out, dev, SFT, RL) problems from `draw`, in that order: no question in two of them."""
    seen: set[str] = set()

    def problems(n: int) -> list[tuple[str, int]]:
        picked = []
        while len(picked) < n:
            question, answer = draw()
            # held-out questions never appear in training
            if question not in seen:
                seen.add(question)
                picked.append((question, answer))
        return picked

    return problems(s.n_heldout), problems(s.n_dev), problems(s.n_sft), problems(s.n_rl)


def prompt_row(question: str, answer: int, data_source: str = DATA_SOURCE) -> dict:
    return {
        "prompt": [{"role": "user", "content": question}],
        "data_source": data_source,
        "reward_model": {"ground_truth": str(answer)},
        "extra_info": {},
    }


def make_data(out: Path, s: DemoSettings) -> dict[str, Path]:
    """SFT chats, RL prompts and a held-out set, disjoint, from one seeded generator."""
    rng = random.Random(s.seed)
    heldout, dev, sft, rl = disjoint_problems(lambda: addition_problem(rng, s.digits), s)
    return write_data(
        out,
        {
            "sft": [
                {
                    "messages": [
                        {"role": "user", "content": q},
                        {"role": "assistant", "content": str(a)},
                    ]
                }
                for q, a in sft
            ],
            "rl": [prompt_row(q, a) for q, a in rl],
            "heldout": [prompt_row(q, a) for q, a in heldout],
            "dev": [prompt_row(q, a) for q, a in dev],
        },
    )


def write_data(out: Path, files: dict[str, list[dict]]) -> dict[str, Path]:
    """Each named list of rows as out/data/<name>.jsonl; -> their paths."""
    paths = {name: out / "data" / f"{name}.jsonl" for name in files}
    for name, rows in files.items():
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def sft_config(out: Path, data: dict[str, Path], model: Path, s: DemoSettings, steps: int) -> dict:
    return {
        "data": {
            "train_files": [str(data["sft"])],
            "max_length": s.sft_max_length,
            "train_batch_size": s.sft_batch,
            "micro_batch_size_per_gpu": s.sft_batch,
        },
        "model": {"partial_pretrain": str(model)},
        # constant after warm-up, so extending the run by a chunk continues the same schedule
        "optim": {
            "lr": s.sft_lr,
            "weight_decay": 0.0,
            "lr_warmup_steps": 5,
            "warmup_style": "constant",
        },
        "trainer": {
            "default_local_dir": str(out / "sft"),
            "total_training_steps": steps,
            "save_freq": s.sft_chunk,
            "max_ckpt_to_keep": 1,
            "seed": s.seed,
        },
    }


def grpo_config(out: Path, data: dict[str, Path], s: DemoSettings) -> dict:
    return {
        "data": {
            "train_files": [str(data["rl"])],
            "val_files": [str(data["heldout"])],
            "max_prompt_length": 64,
            "max_response_length": s.digits + 3,
            "train_batch_size": s.grpo_prompts,
        },
        "actor_rollout_ref": {
            "model": {"path": str(out / "sft")},
            "actor": {
                "ppo_mini_batch_size": s.grpo_prompts // s.grpo_mini_batches,
                "ppo_micro_batch_size_per_gpu": s.grpo_prompts // s.grpo_mini_batches * s.grpo_n,
                "optim": {"lr": s.grpo_lr, "weight_decay": 0.0},
            },
            "rollout": {
                "n": s.grpo_n,
                "temperature": 1.0,
                "log_prob_micro_batch_size_per_gpu": 256,
            },
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {
            "default_local_dir": str(out / "grpo"),
            "total_training_steps": s.grpo_steps,
            "test_freq": s.test_freq,
            "save_freq": s.grpo_steps,
            "seed": s.seed,
            "log_samples": 8,
        },
    }


def demo_command(s: DemoSettings, out: Path) -> str:
    """The `keel demo` command line that runs these settings' demo in `out`."""
    task = f" --task {s.TASK}" if s.TASK != DemoSettings.TASK else ""
    return f"keel demo{task} --out {shlex.quote(str(out))}{' --smoke' if s.smoke else ''}"


def prepare_out_dir(out: Path, s: DemoSettings, fresh: bool) -> None:
    """Resume a demo with the same settings; clear one with other settings or when asked.

    Only a directory the demo made (it holds MARKER) is ever deleted.
    """
    marker = out / MARKER
    if out.exists() and any(out.iterdir()) and not marker.exists():
        from keel.errors import DEMO_DIR, KeelError
        from keel.errors.fixes import free_directory

        raise KeelError(
            DEMO_DIR,
            f"{out} exists and was not made by keel demo; not touching it",
            f"run `{demo_command(s, free_directory(out))}` (a directory of its own), or empty "
            f"{out}",
        )
    if marker.exists() and (fresh or json.loads(marker.read_text()) != asdict(s)):
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(asdict(s)))


@dataclass(frozen=True)
class DemoTask:
    """What a demo's task decides; the stages around it are the same for every task."""

    make_data: Callable[[Path, DemoSettings], dict[str, Path]]
    grpo_config: Callable[[Path, dict[str, Path], DemoSettings], dict]
    # the SFT model's, greedy
    dev_accuracy: Callable[[Path, dict[str, Path], DemoSettings], float]
    # the held-out metric reported
    accuracy_key: str
    # the tools demo's correct calls
    calls_key: Callable[[DemoSettings], str] | None = None


def run_demo(
    out: str | Path = "keel_demo",
    settings: DemoSettings = DemoSettings(),
    fresh: bool = False,
    console: bool = True,
    task: DemoTask | None = None,
) -> DemoResult:
    from keel.api import train
    from keel.models.load import stored_parameters
    from keel.models.tiny import make_tiny_model
    from keel.observe.report import write_report

    task = task or ADDITION
    start = time.perf_counter()
    out = Path(out)
    prepare_out_dir(out, settings, fresh)
    if (earlier := stored_result(out)) is not None:
        return earlier
    data = task.make_data(out, settings)
    model = out / "init_model"
    if not (model / "config.json").exists():
        make_tiny_model(
            model,
            hidden_size=settings.hidden_size,
            num_layers=settings.num_layers,
            num_heads=4,
            num_kv_heads=2,
            seed=settings.seed,
        )
    logger = {"trainer.logger": ["console"] if console else []}
    sft_steps = sft_until_partly_competent(
        out,
        data,
        model,
        settings,
        logger,
        lambda sft_dir: task.dev_accuracy(sft_dir, data, settings),
    )
    grpo = train(task.grpo_config(out, data, settings), logger)
    write_report(grpo.run_dir)
    write_report(out / "sft")
    last = grpo.last_step
    calls = task.calls_key(settings) if task.calls_key else None
    result = DemoResult(
        out,
        val_metric(grpo.run_dir, 0, task.accuracy_key),
        val_metric(grpo.run_dir, last, task.accuracy_key),
        sft_steps,
        settings.grpo_steps,
        time.perf_counter() - start,
        stored_parameters(grpo.run_dir / f"global_step_{last}" / "actor"),
        val_metric(grpo.run_dir, 0, calls) if calls else None,
        val_metric(grpo.run_dir, last, calls) if calls else None,
        settings.smoke,
    )
    (out / RESULT).write_text(json.dumps({**asdict(result), "out_dir": str(out)}))
    return result


def sft_until_partly_competent(
    out: Path,
    data: dict[str, Path],
    model: Path,
    s: DemoSettings,
    logger: dict,
    dev_accuracy: Callable[[Path], float],
) -> int:
    """Extend the SFT run chunk by chunk until greedy dev accuracy reaches `sft_target`."""
    from keel.checkpoint import find_resume_checkpoint
    from keel.trainer.sft import sft

    # a rerun continues where the last one stopped
    done = find_resume_checkpoint(out / "sft", "auto")
    steps = max(s.sft_chunk, int(done.name.rsplit("_", 1)[1]) if done else 0)
    keel_log = logging.getLogger("keel")
    while True:
        level = keel_log.level
        # one "resumed" line per chunk is noise
        keel_log.setLevel(logging.WARNING if steps > s.sft_chunk else level)
        try:
            sft(sft_config(out, data, model, s, steps), logger)
        finally:
            keel_log.setLevel(level)
        accuracy = dev_accuracy(out / "sft")
        print(
            f"SFT step {steps}: dev accuracy {100 * accuracy:.1f}% (target "
            f"{100 * s.sft_target:.0f}%)",
            file=sys.stderr,
        )
        if accuracy >= s.sft_target or steps >= s.sft_max_steps:
            return steps
        steps += s.sft_chunk


def greedy_accuracy(
    model_dir: Path,
    prompts_file: Path,
    data_source: str = DATA_SOURCE,
    max_response_length: int = 6,
    agent: Callable | None = None,
) -> float:
    """Greedy accuracy of a saved model on a prompts file; `agent(engine, tokenizer)`: the
    multi-turn loop to generate through (the tools demo), else the engine itself."""
    import torch

    from keel.config.schema import DataConfig, ValKwargs
    from keel.data.prompts import build_prompt_dataset, load_rows
    from keel.models.load import load_causal_lm, load_tokenizer, resolve_device
    from keel.rewards.reward_fn import RewardScorer
    from keel.rollout.hf import HFRolloutEngine
    from keel.trainer.evaluate import evaluate

    tokenizer = load_tokenizer(model_dir)
    records, _ = build_prompt_dataset(load_rows([prompts_file]), tokenizer, max_prompt_length=64)
    engine = HFRolloutEngine(load_causal_lm(model_dir, resolve_device("auto")), tokenizer)
    generate = agent(engine, tokenizer).generate if agent else engine.generate
    with torch.no_grad():
        metrics, _ = evaluate(
            generate,
            RewardScorer(),
            records,
            tokenizer.pad_token_id,
            ValKwargs(),
            DataConfig(max_response_length=max_response_length),
        )
    return metrics[f"val/{data_source}/acc"]


ADDITION = DemoTask(
    make_data,
    grpo_config,
    lambda sft_dir, data, s: greedy_accuracy(sft_dir, data["dev"]),
    f"val/{DATA_SOURCE}/acc",
)
