"""Make the quick-start's data and model: a tiny random-weight Qwen2 and a digits task.

The task: answer each prompt with digits only. The reward (reward.py) is the share of digit
characters in the response: the random model starts near 0.03 and GRPO raises it to about 1.0 in
the 30 steps of grpo.yaml. sft.jsonl holds the same task as chats (`messages`) whose answer is the
prompt's digits, for `keel sft examples/quickstart/sft.yaml`; preference.jsonl pairs the digits
(chosen) with an answer in words (rejected), for dpo.yaml and reward_model.yaml.

    python examples/quickstart/prepare.py [OUT_DIR]     # default: examples/data
"""

import json
import random
import sys
from pathlib import Path

from keel.models.tiny import make_tiny_model


def write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def make_rows(n: int, rng: random.Random) -> list[dict]:
    rows = []
    for _ in range(n):
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"Reply with digits only: {a} {b}"}],
                "data_source": "digits",
                "reward_model": {"ground_truth": f"{a}{b}"},
                "extra_info": {},
            }
        )
    return rows


def make_chats(n: int, rng: random.Random) -> list[dict]:
    """SFT demonstrations: the prompt's question, answered with its digits."""
    return [
        {
            "messages": [
                row["prompt"][0],
                {"role": "assistant", "content": row["reward_model"]["ground_truth"]},
            ]
        }
        for row in make_rows(n, rng)
    ]


def make_pairs(n: int, rng: random.Random) -> list[dict]:
    """Preference pairs (TRL's prompt/chosen/rejected): the digits-only answer is chosen over one
    that spells the numbers out in words, for DPO and reward-model training."""
    rejected_forms = ("The numbers are {a} and {b}.", "Sure! {a} and {b}", "I think {a}, {b}")
    pairs = []
    for row in make_rows(n, rng):
        a, b = row["prompt"][0]["content"].split(": ")[1].split()
        pairs.append(
            {
                "prompt": row["prompt"],
                "chosen": row["reward_model"]["ground_truth"],
                "rejected": rng.choice(rejected_forms).format(a=a, b=b),
            }
        )
    return pairs


def main(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    write_jsonl(out / "train.jsonl", make_rows(256, rng))
    write_jsonl(out / "val.jsonl", make_rows(32, rng))
    write_jsonl(out / "sft.jsonl", make_chats(256, rng))
    write_jsonl(out / "preference.jsonl", make_pairs(256, rng))
    write_jsonl(out / "preference_val.jsonl", make_pairs(32, rng))
    # A wider initialisation than transformers' 0.02: the random output layer can then express a
    # confident answer, as a pretrained model's can, so LoRA (which leaves it frozen) learns too.
    make_tiny_model(
        out / "model", arch="qwen2", hidden_size=64, num_layers=2, initializer_range=0.2
    )
    # distill.yaml's student: half as wide, one layer, the same tokenizer
    make_tiny_model(
        out / "student", arch="qwen2", hidden_size=32, num_layers=1, initializer_range=0.2
    )
    print(
        f"wrote {out}/train.jsonl, val.jsonl, sft.jsonl, preference.jsonl, "
        "preference_val.jsonl, model and student"
    )


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "examples/data"))
