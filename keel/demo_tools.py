"""`keel demo --task tools`: a tiny model that cannot multiply 3-digit numbers learns to ask a
calculator. SFT on tool-use demonstrations (a call, the tool's answer, the final answer), until a
dev set's accuracy shows it is part-way there; then multi-turn GRPO, the calculator answering every
call, raises its held-out accuracy.

Everything is made here with a seed, as for the arithmetic demo; it runs on 2 CPU cores in minutes.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from keel.demo import (
    DemoSettings,
    DemoTask,
    disjoint_problems,
    greedy_accuracy,
    prompt_row,
    run_demo,
    write_data,
)
from keel.demo_result import DemoResult

DATA_SOURCE = "keel/tool_arithmetic"


@dataclass(frozen=True)
class ToolDemoSettings(DemoSettings):
    """The arithmetic demo's stages, sized for a longer task: a call, the tool's turn, the
    answer."""

    TASK: ClassVar[str] = "tools"
    digits: int = 3
    n_sft: int = 3000
    n_dev: int = 64
    n_heldout: int = 200
    sft_batch: int = 32
    sft_max_length: int = 256
    # the whole trajectory
    max_response_length: int = 128
    grpo_steps: int = 40
    grpo_prompts: int = 32
    grpo_mini_batches: int = 2
    test_freq: int = 10
    # held-out samples per prompt
    val_n: int = 2


def tool_call(question: str) -> str:
    return (
        "<tool_call>"
        + json.dumps({"name": "calculator", "arguments": {"expression": question}})
        + "</tool_call>"
    )


def make_data(out: Path, s: ToolDemoSettings) -> dict[str, Path]:
    """Tool-use chats for SFT, RL prompts, a dev and a held-out set: disjoint questions `a*b`."""
    rng = random.Random(s.seed)
    low, high = 10 ** (s.digits - 1), 10**s.digits

    def multiplication() -> tuple[str, int]:
        a, b = rng.randrange(low, high), rng.randrange(low, high)
        return f"{a}*{b}", a * b

    heldout, dev, sft, rl = disjoint_problems(multiplication, s)

    def demonstration(question: str, answer: int) -> dict:
        return {
            "messages": [
                {"role": "user", "content": question},
                {"role": "assistant", "content": tool_call(question)},
                {"role": "tool", "content": str(answer)},
                {"role": "assistant", "content": str(answer)},
            ]
        }

    paths = write_data(
        out,
        {
            "sft": [demonstration(q, a) for q, a in sft],
            "rl": [prompt_row(q, a, DATA_SOURCE) for q, a in rl],
            "heldout": [prompt_row(q, a, DATA_SOURCE) for q, a in heldout],
            "dev": [prompt_row(q, a, DATA_SOURCE) for q, a in dev],
        },
    )
    paths["tools"] = out / "data" / "tools.yaml"
    paths["tools"].write_text(
        "tools:\n  - class_name: keel.tools.Calculator\n    config: {type: native}\n"
    )
    return paths


def multi_turn(data: dict[str, Path]) -> dict:
    return {"enable": True, "tool_config_path": str(data["tools"]), "max_assistant_turns": 2}


def grpo_config(out: Path, data: dict[str, Path], s: ToolDemoSettings) -> dict:
    mini = s.grpo_prompts // s.grpo_mini_batches
    return {
        "data": {
            "train_files": [str(data["rl"])],
            "val_files": [str(data["heldout"])],
            "max_prompt_length": 32,
            "max_response_length": s.max_response_length,
            "train_batch_size": s.grpo_prompts,
        },
        "actor_rollout_ref": {
            "model": {"path": str(out / "sft")},
            "actor": {
                "ppo_mini_batch_size": mini,
                "ppo_micro_batch_size_per_gpu": mini * s.grpo_n,
                "optim": {"lr": s.grpo_lr, "weight_decay": 0.0},
            },
            # Held-out accuracy as the policy samples (temperature 1): once SFT has taught the call,
            # greedy decoding copies the tool's answer well; what GRPO raises is how often a sample
            # does.
            "rollout": {
                "n": s.grpo_n,
                "temperature": 1.0,
                "log_prob_micro_batch_size_per_gpu": 256,
                "multi_turn": multi_turn(data),
                "val_kwargs": {"do_sample": True, "temperature": 1.0, "n": s.val_n},
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
            "log_val_generations": 4,
        },
    }


def dev_accuracy(model_dir: Path, data: dict[str, Path], s: ToolDemoSettings) -> float:
    """Greedy multi-turn accuracy on the dev set, the calculator answering the model's calls."""
    from keel.config.schema import MultiTurnConfig
    from keel.rollout.agent import build_agent_loop

    def agent(engine, tokenizer):
        return build_agent_loop(
            MultiTurnConfig(**multi_turn(data)), engine, tokenizer, s.max_response_length
        )

    return greedy_accuracy(model_dir, data["dev"], DATA_SOURCE, s.max_response_length, agent)


TOOLS = DemoTask(
    make_data,
    grpo_config,
    dev_accuracy,
    f"val/{DATA_SOURCE}/acc",
    lambda s: f"val-aux/{DATA_SOURCE}/correct_call/mean@{s.val_n}",
)


def run_tools_demo(
    out: str | Path = "keel_demo_tools",
    settings: ToolDemoSettings = ToolDemoSettings(),
    fresh: bool = False,
    console: bool = True,
) -> DemoResult:
    return run_demo(out, settings, fresh, console, TOOLS)
