"""Load policy, reference and critic models and their tokenizer from local directories."""

from __future__ import annotations

import logging
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from keel.diagnostics.codes import DEVICE_UNAVAILABLE, MODEL_PATH, NO_EOS, KeelError

log = logging.getLogger("keel")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers() -> None:
    """keel draws its own progress; transformers' per-load bars would interleave with it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def check_model_dir(path: str | Path, key: str = "actor_rollout_ref.model.path") -> Path:
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise KeelError(MODEL_PATH, f"{key}={str(path)!r} {what}",
                        f"set {key} to a local directory saved with save_pretrained")
    return path


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise KeelError(NO_EOS, f"the tokenizer in {path} has no eos_token")
    if tokenizer.pad_token_id is None:
        log.warning("tokenizer in %s has no pad token; using its EOS token %r as pad",
                    path, tokenizer.eos_token)
        tokenizer.pad_token = tokenizer.eos_token
    # Generation appends on the right, so prompts are padded on the left.
    tokenizer.padding_side = "left"
    return tokenizer


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise KeelError(DEVICE_UNAVAILABLE, "trainer.device=cuda but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype: `auto` is bfloat16 on GPU, float32 on CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def can_compile(device: torch.device) -> bool:
    """Whether torch.compile can fuse kernels here: on CUDA, where its kernels are Triton's (on
    CPU it would compile C++ for little gain, and slowly)."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def autocast(device: torch.device, dtype: torch.dtype):
    """Mixed precision: compute in `dtype` over float32 weights, so the optimiser's small updates
    are not rounded away (bf16 weights lose most updates at RL learning rates such as 1e-6)."""
    if dtype == torch.float32:
        return nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def load_causal_lm(path: str | Path, device: torch.device, trust_remote_code: bool = False,
                   gradient_checkpointing: bool = False):
    """Weights in float32 (master weights); `autocast` chooses the compute dtype."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(check_model_dir(path), dtype=torch.float32,
                                                 trust_remote_code=trust_remote_code)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(device)


class CriticModel(nn.Module):
    """A causal LM's backbone with a scalar value head: one value per token."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Small init: early values near 0 keep the first GAE advantages close to the rewards.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):     # [B, L] -> [B, L]
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        # A copy, not a view: FSDP2 hooks the root's backward onto its output, and drops that hook
        # for a view of a tensor made inside the module (it warns so).
        return self.value_head(hidden).squeeze(-1).clone()


def load_critic(path: str | Path, device: torch.device, trust_remote_code: bool = False) -> CriticModel:
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(check_model_dir(path, "critic.model.path"), dtype=torch.float32,
                                         trust_remote_code=trust_remote_code)
    return CriticModel(backbone, backbone.config.hidden_size).to(device)


def stored_parameters(model_dir: str | Path) -> int:
    """Parameters stored in a model directory's safetensors files (tied weights count once)."""
    import math

    from safetensors import safe_open

    total = 0
    for file in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            total += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    return total
