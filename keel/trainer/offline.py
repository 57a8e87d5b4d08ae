"""What trainers on fixed data (SFT, DPO, reward models) share: the model they train, with or
without LoRA, their checkpoints and exact resume, and the model the finished run directory holds."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from keel import checkpoint as ckpt
from keel.config.load import to_yaml
from keel.data.sampler import ResumableSampler
from keel.errors import DATA_EMPTY, KeelError
from keel.errors.fixes import whole_batches
from keel.models.load import load_causal_lm, resolve_dtype
from keel.models.lora import apply_lora, plan_lora

log = logging.getLogger("keel")


def fixed_data_schedule(cfg, rows: int, what: str) -> tuple[ResumableSampler, int]:
    """The sampler over `rows` examples (`what`: their name) and the run's number of steps;
    fewer rows than one batch stop the run (KEEL-D004)."""
    d = cfg.data
    if rows < d.train_batch_size:
        raise KeelError(
            DATA_EMPTY,
            f"{rows} {what}, fewer than data.train_batch_size={d.train_batch_size}",
            whole_batches(rows, "data.micro_batch_size_per_gpu", d.micro_batch_size_per_gpu),
        )
    sampler = ResumableSampler(rows, d.train_batch_size, d.seed, d.shuffle)
    t = cfg.trainer
    return sampler, t.total_training_steps or t.total_epochs * sampler.batches_per_epoch


def load_trained_model(
    m, source: str, device: torch.device, checkpoint: Path | None, score_head: bool = False
):
    """The model to train: a checkpoint's when resuming; with LoRA (m.lora_rank) the base from
    `source`, frozen in the compute dtype, under peft adapters. `score_head`: a sequence
    classifier with one output (a reward model), its head trained in full beside any adapters."""
    load = _load_score_model if score_head else load_causal_lm
    if not m.lora_rank:
        return load(
            checkpoint or source, device, m.trust_remote_code, m.enable_gradient_checkpointing
        )
    dtype = resolve_dtype(m.dtype, device)
    base = load(source, device, m.trust_remote_code, m.enable_gradient_checkpointing, dtype)
    modules_to_save = list(m.modules_to_save) + (["score"] if score_head else [])
    plan = plan_lora(
        base, m.lora_rank, m.target_modules, m.exclude_modules, modules_to_save, "model"
    )
    log.info(plan.summary())
    return apply_lora(
        base,
        plan,
        m.lora_rank,
        m.lora_alpha,
        modules_to_save,
        dtype,
        str(checkpoint) if checkpoint else m.lora_adapter_path,
    )


def _load_score_model(
    path,
    device: torch.device,
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
):
    """A sequence classifier with one score, from a causal LM's directory (its head new) or a
    reward model's."""
    from transformers import AutoModelForSequenceClassification

    from keel.models.load import check_model_dir, weight_file_shapes

    path = check_model_dir(path, "model.path")
    weight_file_shapes(path)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=dtype, trust_remote_code=trust_remote_code
    )
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def finished_model(model, run_dir: Path):
    """The model the run directory holds: with LoRA the base with the adapters merged (so it loads
    as a plain Hugging Face model), the adapters themselves kept in `adapter/`."""
    if not hasattr(model, "peft_config"):
        return model
    model.save_pretrained(run_dir / "adapter")
    return model.merge_and_unload()


class OfflineState:
    """A fixed-data run's checkpoint: the model, its optimiser and schedule, the sampler, the step
    and the random state."""

    def __init__(self, trainer, model_dir: str = "actor"):
        self.trainer = trainer
        self.model_dir = model_dir

    def save(self) -> Path:
        t = self.trainer

        def write(tmp: Path) -> None:
            ckpt.write_policy(tmp / self.model_dir, t.model, t.tokenizer)
            torch.save(
                {"optimizer": t.optimizer.state_dict(), "scheduler": t.scheduler.state_dict()},
                tmp / f"{self.model_dir}_optim.pt",
            )
            torch.save(
                {"step": t.step, "sampler": t.sampler.state_dict(), "rng": ckpt.rng_state()},
                tmp / "trainer_state.pt",
            )

        return ckpt.save_checkpoint(
            t.run_dir, t.step, write, t.cfg.trainer.max_ckpt_to_keep, to_yaml(t.cfg)
        )

    def load(self, path: Path) -> None:
        """Everything but the weights, which the trainer loaded from `path`."""
        t = self.trainer
        optim = torch.load(path / f"{self.model_dir}_optim.pt", weights_only=False)
        t.optimizer.load_state_dict(optim["optimizer"])
        t.scheduler.load_state_dict(optim["scheduler"])
        state = torch.load(path / "trainer_state.pt", weights_only=False)
        t.step = state["step"]
        try:
            t.sampler.load_state_dict(state["sampler"])
        except ValueError as e:
            raise ckpt.mismatch_error(path, t.cfg, f"{path}: {e}") from e
        ckpt.set_rng_state(state["rng"])
        log.info("resumed from %s at step %d", path, t.step)
