"""The TRL side of benchmark d1: TRL 1.16's DPOTrainer (sigmoid loss, beta 0.1, a separate
reference model) on synthetic pre-tokenized pairs, each optimiser step timed.

    python benchmarks/trl_dpo.py --model DIR --pairs 64 --prompt 512 --completion 512 \\
        --micro 8 --steps 5 --warmup 2 --out FILE.jsonl [--shape 0.5b]

DIR is a model keel made (`keel.bench.run.make_model("0.5b", DIR)`: Qwen2.5-0.5B's shapes, random
weights, keel's byte-level tokenizer); with `--shape`, a missing DIR is made so. An optimiser step
takes `--pairs` pairs in micro-batches of `--micro` pairs (gradient accumulation), each pair a
prompt of exactly `--prompt` tokens and two completions of exactly `--completion` tokens.

What a step's time covers: from TRL's on_step_begin to on_step_end, with the device synchronised
at both: every micro-batch's policy and reference forward, the backward, clipping and the
optimiser step. transformers collates a step's micro-batches before on_step_begin and logs after
on_step_end, so those fall outside it. Appends one JSON line to --out.
"""

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import DPOConfig, DPOTrainer


class PretokenizedDPOTrainer(DPOTrainer):
    """TRL's DPOTrainer on rows already in the form its `_prepare_dataset` leaves them
    (`prompt_ids`, `chosen_ids`, `rejected_ids`, which its collator reads). TRL 1.16 has no path
    for token ids: `_prepare_dataset` always tokenizes text columns and appends EOS to each
    completion. Skipping that one-time step keeps every row at exactly the lengths asked for, and
    lies outside the timed steps."""

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        return dataset


class StepTimer(TrainerCallback):
    """Seconds of each optimiser step, the device synchronised at its start and end."""

    def __init__(self):
        self.seconds = []
        self._start = None

    def on_step_begin(self, args, state, control, **kwargs):
        synchronize()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        synchronize()
        self.seconds.append(time.perf_counter() - self._start)


def synchronize():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def synthetic_pairs(rows: int, prompt: int, completion: int, vocab_size: int) -> Dataset:
    """Random token ids below 300 (keel's byte-level tokenizer's range), seed 0; below the
    vocabulary's size where a test's tiny model has fewer."""
    generator = torch.Generator().manual_seed(0)
    below = min(300, vocab_size)

    def ids(length):
        # [rows, length]
        return torch.randint(0, below, (rows, length), generator=generator).tolist()

    return Dataset.from_dict(
        {"prompt_ids": ids(prompt), "chosen_ids": ids(completion), "rejected_ids": ids(completion)}
    )


def dpo_config(args, output_dir: str) -> DPOConfig:
    return DPOConfig(
        output_dir=output_dir,
        per_device_train_batch_size=args.micro,
        gradient_accumulation_steps=args.pairs // args.micro,
        max_steps=args.warmup + args.steps,
        bf16=True,
        # the CPU test of this harness; d1 itself runs on a GPU
        use_cpu=not torch.cuda.is_available(),
        learning_rate=1e-6,
        # every row is exactly this long, so the collator truncates nothing
        max_length=args.prompt + args.completion,
        eval_strategy="no",
        save_strategy="no",
        report_to=[],
        logging_steps=1,
        # TRL turns it on by default; d1 measures without it
        gradient_checkpointing=False,
        loss_type=["sigmoid"],
        beta=0.1,
    )


def check_lengths(trainer, args):
    """The collated micro-batch is as long as asked: no EOS, no truncation."""
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(args.micro)])
    # [2 * micro, prompt + completion]: chosen rows, then rejected rows
    shape = tuple(batch["input_ids"].shape)
    completions = set(batch["completion_mask"].sum(1).tolist())
    if shape != (2 * args.micro, args.prompt + args.completion) or completions != {args.completion}:
        raise SystemExit(f"collated batch {shape} with completion lengths {completions}")


def run(args) -> dict:
    if args.pairs % args.micro:
        raise SystemExit(f"--pairs {args.pairs} is not a multiple of --micro {args.micro}")
    model_dir = Path(args.model)
    if args.shape and not (model_dir / "config.json").exists():
        from keel.bench.run import make_model

        make_model(args.shape, model_dir)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="sdpa"
    )
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rows = args.pairs * (args.warmup + args.steps)
    timer = StepTimer()
    with tempfile.TemporaryDirectory() as output_dir:
        # no ref_model and no peft: TRL loads its own reference copy of DIR, as the policy
        trainer = PretokenizedDPOTrainer(
            model=model,
            args=dpo_config(args, output_dir),
            train_dataset=synthetic_pairs(
                rows, args.prompt, args.completion, model.config.vocab_size
            ),
            processing_class=tokenizer,
            callbacks=[timer],
        )
        check_lengths(trainer, args)
        trainer.train()
    measured = timer.seconds[args.warmup :]
    return {
        "workload": "d1",
        "side": "trl",
        "trl_version": trl.__version__,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "trl_step_time_s": statistics.mean(measured),
        "trl_step_times_s": measured,
        "trl_peak_memory_gb": (
            torch.cuda.max_memory_allocated() / 1e9 if torch.cuda.is_available() else None
        ),
        "pairs": args.pairs,
        "prompt": args.prompt,
        "completion": args.completion,
        "micro": args.micro,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a model directory keel made")
    parser.add_argument("--shape", help="make DIR with keel's make_model(SHAPE) if missing")
    parser.add_argument("--pairs", type=int, default=64, help="pairs an optimiser step")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--completion", type=int, default=512, help="tokens of each completion")
    parser.add_argument("--micro", type=int, default=8, help="pairs a micro-batch")
    parser.add_argument("--steps", type=int, default=5, help="steps measured")
    parser.add_argument("--warmup", type=int, default=2, help="steps run first, not measured")
    parser.add_argument("--out", required=True, help="JSON-lines file the record is appended to")
    args = parser.parse_args()
    if args.steps < 1:
        raise SystemExit("--steps must be at least 1")
    record = run(args)
    with open(args.out, "a") as out:
        out.write(json.dumps(record) + "\n")
    print(json.dumps(record))


if __name__ == "__main__":
    main()
