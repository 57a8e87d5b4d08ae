"""The SFT configuration tree, with the key names of verl's SFT trainer where they exist."""

from __future__ import annotations

from dataclasses import dataclass

from keel.config.fields import opt
from keel.config.rules import check_betas, largest_divisor_at_most
from keel.config.schema import LoraOptions, ModelOptions, OptimConfig
from keel.config.trainer import OFFLINE_RESUME_MAY_CHANGE, NamedRun, RunOptions
from keel.errors import BATCH_ARITHMETIC, INCOMPATIBLE_OPTIONS, KeelError
from keel.errors.fixes import setting


@dataclass
class SFTDataConfig:
    train_files: list[str] = opt(factory=list, help="parquet/jsonl chat data")
    val_files: list[str] = opt(factory=list)
    messages_key: str = opt("messages", help="column of role/content messages (multi-turn)")
    prompt_key: str = opt("prompt", help="used when there is no messages column")
    response_key: str = opt("response", help="used when there is no messages column")
    max_length: int = opt(1024, gt=0, help="tokens per example, prompt and response together")
    truncation: str = opt("error", choices=("error", "left", "right"))
    train_batch_size: int = opt(32, gt=0, help="examples per optimiser step")
    micro_batch_size_per_gpu: int = opt(8, gt=0, help="examples per forward/backward")
    shuffle: bool = opt(True)
    seed: int = opt(1, ge=0)


@dataclass
class SFTModelConfig(ModelOptions, LoraOptions):
    partial_pretrain: str = opt("", help="local Hugging Face model directory to fine-tune")


@dataclass
class SFTOptimConfig(OptimConfig):
    lr: float = opt(1e-5, gt=0)
    clip_grad: float = opt(1.0, gt=0)


@dataclass
class SFTTrainerConfig(RunOptions):
    experiment_name: str = opt("sft")
    test_freq: int = opt(-1, help="validation loss every N steps; -1: only at the end")
    max_ckpt_to_keep: int | None = opt(None, gt=0)


@dataclass
class SFTConfig(NamedRun):
    data: SFTDataConfig = opt(factory=SFTDataConfig)
    model: SFTModelConfig = opt(
        factory=SFTModelConfig, help="the model fine-tuned, and how it computes"
    )
    optim: SFTOptimConfig = opt(
        factory=SFTOptimConfig, help="AdamW and its schedule, stepped once per batch"
    )
    trainer: SFTTrainerConfig = opt(factory=SFTTrainerConfig)

    RESUME_MAY_CHANGE = OFFLINE_RESUME_MAY_CHANGE

    def validate(self) -> None:
        d = self.data
        if d.train_batch_size % d.micro_batch_size_per_gpu:
            divisor = largest_divisor_at_most(d.train_batch_size, d.micro_batch_size_per_gpu)
            raise KeelError(
                BATCH_ARITHMETIC,
                f"data.train_batch_size={d.train_batch_size} does not split into micro-batches of "
                f"data.micro_batch_size_per_gpu={d.micro_batch_size_per_gpu}",
                f"set {setting('data.micro_batch_size_per_gpu', divisor)} (the largest divisor of "
                f"{d.train_batch_size} up to {d.micro_batch_size_per_gpu})",
            )
        if not d.train_files:
            raise KeelError(
                INCOMPATIBLE_OPTIONS,
                "data.train_files is empty",
                "set data.train_files to parquet/jsonl files",
            )
        check_betas("optim", self.optim.betas)
        if not self.model.partial_pretrain:
            raise KeelError(
                INCOMPATIBLE_OPTIONS,
                "model.partial_pretrain is empty",
                "set model.partial_pretrain to a local Hugging Face model directory",
            )
