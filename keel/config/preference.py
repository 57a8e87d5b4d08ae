"""The preference-training configuration tree: DPO and reward models on pairs of completions.

`objective: dpo` or `objective: reward_model` at the top of a `keel train` config picks it (an RL
config has no `objective`). Data and model keys read as keel's SFT and RL ones; DPO's settings are
TRL's names under `dpo.*`, the reward model's under `reward_model.*`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from keel.config.fields import opt
from keel.config.rules import check_betas, largest_divisor_at_most
from keel.config.schema import LoraOptions, ModelOptions, OptimConfig
from keel.config.trainer import OFFLINE_RESUME_MAY_CHANGE, NamedRun, RunOptions
from keel.errors import (
    BATCH_ARITHMETIC,
    INCOMPATIBLE_OPTIONS,
    PREFERENCE_OPTION,
    KeelError,
)
from keel.errors.fixes import setting

OBJECTIVES = ("dpo", "reward_model")
# keel.algorithms.preference's losses (config may not import algorithms; a test keeps them in step)
LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
# with no reference model
REFERENCE_FREE = frozenset({"simpo"})
# the losses that read dpo.label_smoothing (TRL 1.16's sigmoid does not)
SMOOTHED = frozenset({"robust", "simpo"})
# dpo.reference: where the reference log-probs come from
REFERENCES = ("auto", "cached", "model", "adapter", "none")


@dataclass
class PreferenceDataConfig:
    train_files: list[str] = opt(
        factory=list, help="parquet/jsonl rows of prompt, chosen, rejected"
    )
    val_files: list[str] = opt(factory=list)
    prompt_key: str = opt("prompt", help="a string, or chat messages")
    chosen_key: str = opt("chosen", help="the preferred completion: a string, or chat messages")
    rejected_key: str = opt("rejected", help="the other completion, in the same form")
    margin_key: str = opt(
        "margin", help="reward_model: a column of how much better chosen is (optional)"
    )
    max_length: int = opt(1024, gt=0, help="tokens of prompt plus completion, for each completion")
    truncation: str = opt(
        "left",
        choices=("left", "error"),
        help="left: cut a long pair's prompt from its start (the count is logged); error: stop",
    )
    train_batch_size: int = opt(32, gt=0, help="pairs per optimiser step")
    micro_batch_size_per_gpu: int = opt(8, gt=0, help="pairs per forward/backward")
    padding_free: bool = opt(
        True,
        help="pack a micro-batch's sequences into rows without padding (attention kept within "
        "each sequence)",
    )
    share_prompt: bool = opt(
        True,
        help="a pair's prompt computed once, chosen and rejected both attending to it (off "
        "where the model has a sliding window shorter than data.max_length)",
    )
    shuffle: bool = opt(True)
    seed: int = opt(1, ge=0)


@dataclass
class PreferenceModelConfig(ModelOptions, LoraOptions):
    path: str = opt("", help="local Hugging Face model directory to train")
    use_torch_compile: bool = opt(
        True,
        help="GPU: torch.compile each decoder layer and the log-prob arithmetic over the "
        "vocabulary",
    )


@dataclass
class DPOConfig:
    loss_type: str = opt(
        "sigmoid", choices=LOSS_TYPES, help="TRL's loss names; simpo: no reference"
    )
    beta: float = opt(0.1, gt=0, help="how far from the reference the policy may move")
    label_smoothing: float = opt(
        0.0, ge=0, help="robust and simpo: the share of pairs assumed mislabelled (< 0.5)"
    )
    simpo_gamma: float = opt(0.5, ge=0, help="simpo: the target reward margin")
    sft_weight: float = opt(
        0.0, ge=0, help="weight of an SFT (NLL) term on chosen completions (TRL's sft loss)"
    )
    reference: str = opt(
        "auto",
        choices=REFERENCES,
        help="cached: log-probs computed once before training, kept in the run directory; "
        "model: a frozen copy; adapter: LoRA's base with adapters off; none: reference-free. "
        "auto: none for simpo, else cached",
    )


@dataclass
class RewardModelTrainConfig:
    center_coefficient: float = opt(
        0.0, ge=0, help="weight of (r_chosen + r_rejected)^2, which keeps rewards near 0"
    )


@dataclass
class PreferenceOptimConfig(OptimConfig):
    lr: float = opt(1e-6, gt=0)
    clip_grad: float = opt(1.0, gt=0)


@dataclass
class PreferenceTrainerConfig(RunOptions):
    experiment_name: str = opt("preference")
    test_freq: int = opt(-1, help="validation every N steps; -1: only at the end")
    max_ckpt_to_keep: int | None = opt(None, gt=0)


@dataclass
class PreferenceConfig(NamedRun):
    objective: str = opt("dpo", choices=OBJECTIVES, help="dpo, or reward_model (Bradley-Terry)")
    data: PreferenceDataConfig = opt(factory=PreferenceDataConfig)
    model: PreferenceModelConfig = opt(factory=PreferenceModelConfig)
    dpo: DPOConfig = opt(factory=DPOConfig)
    reward_model: RewardModelTrainConfig = opt(factory=RewardModelTrainConfig)
    optim: PreferenceOptimConfig = opt(factory=PreferenceOptimConfig)
    trainer: PreferenceTrainerConfig = opt(factory=PreferenceTrainerConfig)

    RESUME_MAY_CHANGE = (*OFFLINE_RESUME_MAY_CHANGE, "data.padding_free", "data.share_prompt")

    @property
    def reference(self) -> str:
        """Where DPO's reference log-probs come from, `auto` resolved."""
        chosen = self.dpo.reference
        if chosen != "auto":
            return chosen
        return "none" if self.dpo.loss_type in REFERENCE_FREE else "cached"

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
        for key, value in (("data.train_files", d.train_files), ("model.path", self.model.path)):
            if not value:
                raise KeelError(
                    INCOMPATIBLE_OPTIONS,
                    f"{key} is empty",
                    f"set {key} ("
                    + ("parquet/jsonl files)" if key.startswith("data") else "a model directory)"),
                )
        check_betas("optim", self.optim.betas)
        self._refuse_the_other_objectives_settings()
        if self.objective == "dpo":
            self._validate_dpo()

    def _refuse_the_other_objectives_settings(self) -> None:
        """dpo.* set for a reward model, or reward_model.* for DPO, would be silently unread."""
        section = "reward_model" if self.objective == "dpo" else "dpo"
        value = getattr(self, section)
        unread = [
            f"{section}.{f.name}"
            for f in fields(value)
            if getattr(value, f.name) != getattr(type(value)(), f.name)
        ]
        if unread:
            other = "reward_model" if section == "reward_model" else "dpo"
            _refuse(
                f"{', '.join(unread)} set, but objective={self.objective} reads none of "
                f"{section}.*",
                f"set {setting('objective', other)}, or remove the {section}.* settings",
            )

    def _validate_dpo(self) -> None:
        dpo, reference = self.dpo, self.reference
        if dpo.label_smoothing and dpo.loss_type not in SMOOTHED:
            _refuse(
                f"dpo.label_smoothing={dpo.label_smoothing} is read only by the robust and simpo "
                f"losses; dpo.loss_type={dpo.loss_type} would ignore it",
                f"set {setting('dpo.loss_type', 'robust')} (DPO robust to mislabelled pairs), or "
                f"{setting('dpo.label_smoothing', 0.0)}",
            )
        if dpo.label_smoothing >= 0.5:
            _refuse(
                f"dpo.label_smoothing={dpo.label_smoothing}: at 0.5 or more the labels say "
                "nothing, and robust's loss divides by 1 - 2 * label_smoothing",
                f"set {setting('dpo.label_smoothing', 0.1)} (below 0.5)",
            )
        if dpo.loss_type in REFERENCE_FREE and reference != "none":
            _refuse(
                f"dpo.loss_type={dpo.loss_type} has no reference model, but "
                f"dpo.reference={reference}",
                f"set {setting('dpo.reference', 'auto')}",
            )
        if dpo.loss_type not in REFERENCE_FREE and reference == "none":
            _refuse(
                f"dpo.loss_type={dpo.loss_type} compares the policy with a reference, but "
                "dpo.reference=none",
                f"set {setting('dpo.reference', 'auto')}, or "
                f"{setting('dpo.loss_type', 'simpo')} (reference-free)",
            )
        if reference == "adapter" and not self.model.lora_rank:
            _refuse(
                "dpo.reference=adapter is LoRA's base with the adapters off, but model.lora_rank=0 "
                "trains every weight",
                f"set {setting('dpo.reference', 'cached')} (log-probs computed once before "
                "training), or model.lora_rank to train adapters",
            )
        if reference == "adapter" and self.model.lora_adapter_path:
            _refuse(
                "dpo.reference=adapter is the base without adapters, but the run starts from "
                f"model.lora_adapter_path={self.model.lora_adapter_path}: the reference would not "
                "be the model training starts from",
                f"set {setting('dpo.reference', 'cached')} (the starting model's log-probs, "
                "computed once)",
            )


def _refuse(message: str, fix: str) -> None:
    raise KeelError(PREFERENCE_OPTION, message, fix)
