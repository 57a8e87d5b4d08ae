"""Preference training on fixed pairs: DPO (`objective: dpo`) or a Bradley-Terry reward model
(`objective: reward_model`), with keel's optimiser, metrics, checkpoints and exact resume. The
finished run directory is itself a Hugging Face model: a causal LM after DPO, a sequence
classifier after reward-model training (which keel's `reward_model` section loads as it is)."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.config.load import to_yaml
from keel.config.preference import PreferenceConfig
from keel.data.preference import PairColumns, PreferencePair, build_pairs
from keel.data.prompts import load_rows
from keel.distributed.parallelize import compile_blocks
from keel.models.load import (
    autocast,
    can_compile,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
    resolve_dtype,
)
from keel.observe.metrics import MetricsLogger, Timer
from keel.trainer.offline import (
    OfflineState,
    finished_model,
    fixed_data_schedule,
    load_trained_model,
)
from keel.trainer.pair_objective import BatchShare, DPOObjective, RewardObjective
from keel.trainer.reference_logps import (
    CACHE_FILE,
    CachedReference,
    ModelReference,
    NoReference,
    model_identity,
)
from keel.trainer.setup import seed_everything
from keel.training.optim import build_optimizer, build_scheduler
from keel.training.preference import collate_pairs
from keel.training.shared_prompt import can_share_prompt
from keel.training.step import DeviceTotals, apply_gradients, backward

log = logging.getLogger("keel")


@dataclass
class PreferenceResult:
    # a Hugging Face model directory once the run finishes
    run_dir: Path
    last_step: int
    last_metrics: dict[str, float]


class PreferenceTrainer:
    def __init__(self, cfg: PreferenceConfig):
        quiet_transformers()
        self.cfg = cfg
        self.run_dir = Path(cfg.run_dir)
        self.resume_from = ckpt.resume_point(self.run_dir, cfg)
        seed_everything(cfg.trainer.seed)
        self.device = resolve_device(cfg.trainer.device)
        m, d = cfg.model, cfg.data
        self.tokenizer = load_tokenizer(m.path, m.trust_remote_code)
        self.splits = {"train": self._load(d.train_files, "train")}
        self.splits["val"] = self._load(d.val_files, "val") if d.val_files else []
        self.train_pairs = self.splits["train"]
        self.sampler, self.total_steps = fixed_data_schedule(
            cfg, len(self.train_pairs), "preference pairs"
        )
        self.reward_model = cfg.objective == "reward_model"
        checkpoint = self.resume_from / "actor" if self.resume_from else None
        self.model = load_trained_model(m, m.path, self.device, checkpoint, self.reward_model)
        if self.reward_model:
            # transformers' head finds each sequence's last token by it when the model scores
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.share_prompt = d.share_prompt and can_share_prompt(self.model.config, d.max_length)
        self.compiled = m.use_torch_compile and can_compile(self.device)
        if self.compiled:
            compile_blocks(self.model)
        self.autocast = partial(autocast, self.device, resolve_dtype(m.dtype, self.device))
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.scheduler = build_scheduler(self.optimizer, cfg.optim, self.total_steps)
        self.objective = (
            RewardObjective(cfg.reward_model.center_coefficient)
            if self.reward_model
            else DPOObjective(cfg.dpo, fused_vocab=self.compiled)
        )
        self.reference = NoReference() if self.reward_model else self._reference()
        self.step = 0
        self.state = OfflineState(self)

    def _load(self, files: list[str], name: str) -> list[PreferencePair]:
        d = self.cfg.data
        pairs, stats = build_pairs(
            load_rows(files, f"data.{name}_files"),
            self.tokenizer,
            PairColumns.of(d),
            max_length=d.max_length,
            truncation=d.truncation,
            for_reward_model=self.cfg.objective == "reward_model",
            name=name,
            files=files,
        )
        log.info(stats.summary())
        return pairs

    def collate(self, pairs: list[PreferencePair]):
        d = self.cfg.data
        return collate_pairs(
            pairs, self.tokenizer.pad_token_id, d.padding_free, 2 * d.max_length, self.share_prompt
        )

    def _reference(self):
        kind, m = self.cfg.reference, self.cfg.model
        if kind == "none":
            return NoReference()
        if kind == "adapter":
            return ModelReference(self.model, adapters_off=True)
        if kind == "model":
            return ModelReference(self._starting_model())
        # a fresh run's model is the starting model; a resumed one's has trained
        return CachedReference(
            self.run_dir / CACHE_FILE,
            model_identity(m, resolve_dtype(m.dtype, self.device)),
            self._starting_model if self.resume_from else lambda: self.model,
            self.collate,
            self.cfg.data.micro_batch_size_per_gpu,
            self.autocast,
        )

    def _starting_model(self):
        """The model training starts from, frozen: the reference. Its weights and kernels are the
        policy's at step 0 (float32 under autocast, compiled where the policy is), so its log-probs
        are those a fresh run's cache holds."""
        m = self.cfg.model
        model = load_trained_model(m, m.path, self.device, None).eval().requires_grad_(False)
        if self.compiled:
            compile_blocks(model)
        return model

    def fit(self) -> PreferenceResult:
        if self.resume_from is not None:
            self.state.load(self.resume_from)
        ckpt.init_run_dir(self.run_dir, to_yaml(self.cfg), self.step if self.resume_from else None)
        self.reference.prepare(self.splits)
        logger = MetricsLogger.for_run(
            self.cfg, self.run_dir, self.total_steps, self.step, desc=f"keel {self.cfg.objective}"
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
                    self.state.save()
        finally:
            logger.close()
        # the run directory is the model
        ckpt.write_policy(self.run_dir, finished_model(self.model, self.run_dir), self.tokenizer)
        return PreferenceResult(self.run_dir, self.step, metrics)

    def train_step(self) -> dict[str, float]:
        timer = Timer()
        with timer("step"), self.autocast():
            rows = self.sampler.next_batch()
            self.model.train()
            totals = DeviceTotals()
            tokens = self._pass("train", rows, totals, train=True)
            lr = self.scheduler.get_last_lr()[0]
            stepped = apply_gradients(
                self.model, self.optimizer, self.cfg.optim.clip_grad, "model", totals=totals
            )
            self.scheduler.step()
        return {
            **{name: value for name, value in stepped.items() if name != "model/grad_norm"},
            "train/lr": lr,
            "train/grad_norm": stepped["model/grad_norm"],
            "train/epoch": float(self.sampler.epoch),
            **timer.metrics(),
            "perf/throughput": tokens / timer.times["step"],
        }

    def _pass(self, split: str, rows: list[int], totals: DeviceTotals, train: bool) -> int:
        """The loss over `rows` of a split, micro-batch by micro-batch (backward when `train`);
        the tokens it read."""
        pairs = self.splits[split]
        share = BatchShare(len(rows), sum(pairs[i].chosen_targets for i in rows))
        size, tokens = self.cfg.data.micro_batch_size_per_gpu, 0
        for start in range(0, len(rows), size):
            micro = list(rows[start : start + size])
            batch = self.collate([pairs[i] for i in micro])
            reference = self.reference.log_probs(split, micro, batch)
            with nullcontext() if train else torch.no_grad():
                loss = self.objective.loss(self.model, batch, reference, share, totals)
            if train:
                backward(loss, self.cfg.objective)
            tokens += batch.tokens
        return tokens

    def evaluate(self) -> dict[str, float]:
        val = self.splits["val"]
        if not val:
            return {}
        self.model.eval()
        totals = DeviceTotals()
        with self.autocast():
            self._pass("val", list(range(len(val))), totals, train=False)
        return {f"val/{name.removeprefix('train/')}": v for name, v in totals.floats().items()}

    def _due(self, freq: int) -> bool:
        return freq > 0 and self.step % freq == 0
