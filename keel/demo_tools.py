"""`keel demo --task tools`: a tiny model that cannot multiply 3-digit numbers learns to ask a
calculator. SFT on tool-use demonstrations (a call, the tool's answer, the final answer), until a
dev set's accuracy shows it is part-way there; then multi-turn GRPO, the calculator answering every
call, raises its held-out accuracy.

Everything is made here with a seed, as for the arithmetic demo; it runs on 2 CPU cores in minutes.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from keel.demo import DemoResult, prepare_out_dir, sft_config

DATA_SOURCE = "keel/tool_arithmetic"


@dataclass(frozen=True)
class ToolDemoSettings:
    digits: int = 3
    n_sft: int = 3000
    n_rl: int = 2000
    n_dev: int = 64
    n_heldout: int = 200
    hidden_size: int = 128
    num_layers: int = 4
    sft_target: float = 0.2
    sft_chunk: int = 25
    sft_max_steps: int = 1000
    sft_batch: int = 32
    sft_lr: float = 1e-3
    max_response_length: int = 128  # the whole trajectory: call, the tool's turn, the answer
    grpo_steps: int = 40
    grpo_prompts: int = 32
    grpo_n: int = 8
    grpo_lr: float = 5e-5
    grpo_mini_batches: int = 2
    test_freq: int = 10
    val_n: int = 2                   # held-out samples per prompt
    seed: int = 0


def tool_call(question: str) -> str:
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": question}}) + "</tool_call>"


def make_data(out: Path, s: ToolDemoSettings) -> dict[str, Path]:
    """Tool-use chats for SFT, RL prompts, a dev and a held-out set: disjoint questions `a*b`."""
    rng, seen = random.Random(s.seed), set()

    def problems(n: int) -> list[tuple[str, int]]:
        picked = []
        while len(picked) < n:
            a, b = rng.randrange(10 ** (s.digits - 1), 10 ** s.digits), rng.randrange(10 ** (s.digits - 1), 10 ** s.digits)
            if f"{a}*{b}" not in seen:
                seen.add(f"{a}*{b}")
                picked.append((f"{a}*{b}", a * b))
        return picked

    heldout, dev, sft, rl = problems(s.n_heldout), problems(s.n_dev), problems(s.n_sft), problems(s.n_rl)

    def prompt_row(question: str, answer: int) -> dict:
        return {"prompt": [{"role": "user", "content": question}], "data_source": DATA_SOURCE,
                "reward_model": {"ground_truth": str(answer)}, "extra_info": {}}

    def demonstration(question: str, answer: int) -> dict:
        return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": tool_call(question)},
                             {"role": "tool", "content": str(answer)}, {"role": "assistant", "content": str(answer)}]}

    files = {"sft": [demonstration(q, a) for q, a in sft], "rl": [prompt_row(q, a) for q, a in rl],
             "heldout": [prompt_row(q, a) for q, a in heldout], "dev": [prompt_row(q, a) for q, a in dev]}
    paths = {name: out / "data" / f"{name}.jsonl" for name in files}
    for name, rows in files.items():
        paths[name].parent.mkdir(parents=True, exist_ok=True)
        paths[name].write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths["tools"] = out / "data" / "tools.yaml"
    paths["tools"].write_text("tools:\n  - class_name: keel.tools.Calculator\n    config: {type: native}\n")
    return paths


def multi_turn(data: dict[str, Path]) -> dict:
    return {"enable": True, "tool_config_path": str(data["tools"]), "max_assistant_turns": 2}


def grpo_config(out: Path, data: dict[str, Path], s: ToolDemoSettings) -> dict:
    mini = s.grpo_prompts // s.grpo_mini_batches
    return {
        "data": {"train_files": [str(data["rl"])], "val_files": [str(data["heldout"])], "max_prompt_length": 32,
                 "max_response_length": s.max_response_length, "train_batch_size": s.grpo_prompts},
        "actor_rollout_ref": {
            "model": {"path": str(out / "sft")},
            "actor": {"ppo_mini_batch_size": mini, "ppo_micro_batch_size_per_gpu": mini * s.grpo_n,
                      "optim": {"lr": s.grpo_lr, "weight_decay": 0.0}},
            # Held-out accuracy as the policy samples (temperature 1): once SFT has taught the call,
            # greedy decoding copies the tool's answer well; what GRPO raises is how often a sample does.
            "rollout": {"n": s.grpo_n, "temperature": 1.0, "log_prob_micro_batch_size_per_gpu": 256,
                        "multi_turn": multi_turn(data),
                        "val_kwargs": {"do_sample": True, "temperature": 1.0, "n": s.val_n}},
        },
        "algorithm": {"adv_estimator": "grpo"},
        "trainer": {"default_local_dir": str(out / "grpo"), "total_training_steps": s.grpo_steps,
                    "test_freq": s.test_freq, "save_freq": s.grpo_steps, "seed": s.seed, "log_samples": 8,
                    "log_val_generations": 4},
    }


def greedy_accuracy(model_dir: Path, data: dict[str, Path], s: ToolDemoSettings) -> float:
    """Greedy multi-turn accuracy on the dev set, the calculator answering the model's calls."""
    import torch

    from keel.config.schema import DataConfig, MultiTurnConfig, ValKwargs
    from keel.data.prompts import build_prompt_dataset, load_rows
    from keel.models.load import load_causal_lm, load_tokenizer, resolve_device
    from keel.rewards.reward_fn import RewardScorer
    from keel.rollout.agent import build_agent_loop
    from keel.rollout.hf import HFRolloutEngine
    from keel.trainer.evaluate import evaluate

    tokenizer = load_tokenizer(model_dir)
    records, _ = build_prompt_dataset(load_rows([data["dev"]]), tokenizer, max_prompt_length=32)
    engine = HFRolloutEngine(load_causal_lm(model_dir, resolve_device("auto")), tokenizer)
    loop = build_agent_loop(MultiTurnConfig(**multi_turn(data)), engine, tokenizer, s.max_response_length)
    with torch.no_grad():
        metrics, _ = evaluate(loop.generate, RewardScorer(), records, tokenizer.pad_token_id, ValKwargs(),
                              DataConfig(max_response_length=s.max_response_length))
    return metrics[f"val/{DATA_SOURCE}/acc"]


def val_metric(run_dir: Path, step: int, key: str) -> float:
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == step and key in record:
            return record[key]
    raise ValueError(f"no {key} at step {step} in {run_dir}")


def run_tools_demo(out: str | Path = "keel_demo_tools", settings: ToolDemoSettings = ToolDemoSettings(),
                   fresh: bool = False, console: bool = True) -> DemoResult:
    from keel.api import train
    from keel.models.load import stored_parameters
    from keel.models.tiny import make_tiny_model
    from keel.observe.report import write_report
    from keel.trainer.sft import sft

    start = time.perf_counter()
    out = Path(out)
    prepare_out_dir(out, settings, fresh)
    data = make_data(out, settings)
    model = out / "init_model"
    if not (model / "config.json").exists():
        make_tiny_model(model, hidden_size=settings.hidden_size, num_layers=settings.num_layers, num_heads=4,
                        num_kv_heads=2, seed=settings.seed)
    logger = {"trainer.logger": ["console"] if console else []}
    steps = settings.sft_chunk
    while True:  # SFT in chunks until the dev set's greedy accuracy shows partial competence
        cfg = sft_config(out, data, model, settings, steps)
        cfg["data"]["max_length"] = 256
        sft(cfg, logger)
        accuracy = greedy_accuracy(out / "sft", data, settings)
        print(f"SFT step {steps}: dev accuracy {100 * accuracy:.1f}% (target {100 * settings.sft_target:.0f}%)",
              file=sys.stderr)
        if accuracy >= settings.sft_target or steps >= settings.sft_max_steps:
            break
        steps += settings.sft_chunk
    grpo = train(grpo_config(out, data, settings), logger)
    write_report(grpo.run_dir)
    write_report(out / "sft")
    acc = f"val/{DATA_SOURCE}/acc"
    calls = f"val-aux/{DATA_SOURCE}/correct_call/mean@{settings.val_n}"
    return DemoResult(out, val_metric(grpo.run_dir, 0, acc), val_metric(grpo.run_dir, grpo.last_step, acc), steps,
                      settings.grpo_steps, time.perf_counter() - start,
                      stored_parameters(grpo.run_dir / f"global_step_{grpo.last_step}" / "actor"),
                      val_metric(grpo.run_dir, 0, calls), val_metric(grpo.run_dir, grpo.last_step, calls))
