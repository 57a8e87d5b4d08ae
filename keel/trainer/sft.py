"""Supervised fine-tuning: next-token loss on assistant tokens, with keel's optimiser, metrics,
checkpoints and exact resume. The finished run directory is itself a Hugging Face model."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.config.load import load_config, to_yaml
from keel.config.sft import SFTConfig
from keel.data.prompts import load_rows
from keel.data.sft import SFTExample, build_sft_dataset, collate_sft
from keel.models.load import (
    autocast,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
)
from keel.observe.log import ensure_console_logging
from keel.observe.metrics import MetricsLogger, Timer
from keel.trainer.offline import (
    OfflineState,
    finished_model,
    fixed_data_schedule,
    load_trained_model,
)
from keel.trainer.setup import seed_everything
from keel.training.optim import build_optimizer, build_scheduler
from keel.training.step import DeviceTotals, apply_gradients, backward

log = logging.getLogger("keel")


@dataclass
class SFTResult:
    # a Hugging Face model directory once the run finishes
    run_dir: Path
    last_step: int
    last_metrics: dict[str, float]


def token_losses(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token loss over the loss mask, and the number of tokens it covers."""
    device = next(model.parameters()).device
    input_ids = batch["input_ids"].to(device)  # [B, L]
    logits = (
        model(
            input_ids=input_ids, attention_mask=batch["attention_mask"].to(device), use_cache=False
        )
        .logits[:, :-1]
        .float()
    )  # [B, L-1, V]
    targets = input_ids[:, 1:]  # [B, L-1]
    # a token is learnt where it is predicted
    mask = batch["loss_mask"][:, 1:].to(device).float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    return (nll * mask).sum(), mask.sum()


class SFTTrainer:
    def __init__(self, cfg: SFTConfig):
        quiet_transformers()
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.resume_from = ckpt.resume_point(self.run_dir, cfg)
        seed_everything(cfg.trainer.seed)
        device = resolve_device(cfg.trainer.device)
        m, d = cfg.model, cfg.data
        self.tokenizer = load_tokenizer(m.partial_pretrain, m.trust_remote_code)
        self.tokenizer.padding_side = "right"
        self.train_data = self._load(d.train_files, "train")
        self.val_data = self._load(d.val_files, "val") if d.val_files else []
        self.sampler, self.total_steps = fixed_data_schedule(
            cfg, len(self.train_data), "SFT examples"
        )
        self.model = self._load_model(device)
        self.autocast = partial(autocast, device, resolve_dtype(m.dtype, device))
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.step = 0
        self.state = OfflineState(self)

    def _load_model(self, device: torch.device):
        checkpoint = self.resume_from / "actor" if self.resume_from else None
        return load_trained_model(
            self.cfg.model, self.cfg.model.partial_pretrain, device, checkpoint
        )

    def _load(self, files: list[str], name: str) -> list[SFTExample]:
        d = self.cfg.data
        rows = load_rows(files, f"data.{name}_files")
        examples, stats = build_sft_dataset(
            rows,
            self.tokenizer,
            messages_key=d.messages_key,
            prompt_key=d.prompt_key,
            response_key=d.response_key,
            max_length=d.max_length,
            truncation=d.truncation,
            name=name,
        )
        log.info(stats.summary())
        return examples

    def fit(self) -> SFTResult:
        if self.resume_from is not None:
            self.load(self.resume_from)
        ckpt.init_run_dir(self.run_dir, to_yaml(self.cfg), self.step if self.resume_from else None)
        logger = MetricsLogger.for_run(
            self.cfg, self.run_dir, self.total_steps, self.step, desc="keel sft"
        )
        metrics: dict[str, float] = {}
        try:
            while self.step < self.total_steps:
                self.step += 1
                metrics = self.train_step()
                if self._due(self.cfg.trainer.test_freq) or self.step == self.total_steps:
                    metrics.update(self.evaluate())
                logger.log(self.step, metrics)
                if self._due(self.cfg.trainer.save_freq) or self.step == self.total_steps:
                    self.save()
        finally:
            logger.close()
        # the run directory is the model
        ckpt.write_policy(self.run_dir, self._finished_model(), self.tokenizer)
        return SFTResult(self.run_dir, self.step, metrics)

    def train_step(self) -> dict[str, float]:
        timer = Timer()
        with timer("step"), self.autocast():
            batch = [self.train_data[i] for i in self.sampler.next_batch()]
            # the mini-batch's loss denominator
            n_tokens = sum(sum(e.loss_mask[1:]) for e in batch)
            self.model.train()
            # read with the gradient norm: no host sync per micro-batch
            losses = DeviceTotals()
            for start in range(0, len(batch), self.cfg.data.micro_batch_size_per_gpu):
                micro = collate_sft(
                    batch[start : start + self.cfg.data.micro_batch_size_per_gpu],
                    self.tokenizer.pad_token_id,
                )
                nll, _ = token_losses(self.model, micro)
                # micro-batch sums over the whole batch's token count
                backward(nll / n_tokens, "SFT")
                losses.add("train/nll", nll)
            lr = self.scheduler.get_last_lr()[0]
            stepped = apply_gradients(
                self.model, self.optimizer, self.cfg.optim.clip_grad, "model", totals=losses
            )
            self.scheduler.step()
        tokens = sum(len(e.input_ids) for e in batch)
        return {
            "train/loss": stepped["train/nll"] / max(n_tokens, 1),
            "train/lr": lr,
            "train/grad_norm": stepped["model/grad_norm"],
            "train/epoch": float(self.sampler.epoch),
            **timer.metrics(),
            "perf/throughput": tokens / timer.times["step"],
        }

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        if not self.val_data:
            return {}
        self.model.eval()
        nll_sum, n_tokens = 0.0, 0.0
        size = self.cfg.data.micro_batch_size_per_gpu
        with self.autocast():
            for start in range(0, len(self.val_data), size):
                nll, count = token_losses(
                    self.model,
                    collate_sft(self.val_data[start : start + size], self.tokenizer.pad_token_id),
                )
                nll_sum, n_tokens = nll_sum + nll.item(), n_tokens + count.item()
        return {"val/loss": nll_sum / max(n_tokens, 1)}

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.step % freq == 0

    def _finished_model(self):
        return finished_model(self.model, self.run_dir)

    def save(self) -> Path:
        return self.state.save()

    def load(self, path: Path) -> None:
        self.state.load(path)


def sft(config=None, overrides=None) -> SFTResult:
    """Python API: load and validate an SFT config (path, dict or object, plus overrides), then
    train."""
    ensure_console_logging()
    return SFTTrainer(load_config(config, overrides, schema=SFTConfig)).fit()
