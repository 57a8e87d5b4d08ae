"""Load policy, reference and critic models and their tokenizer from local directories."""

from __future__ import annotations

import json
import logging
import os
import re
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn

from keel.errors import (
    DEVICE_UNAVAILABLE,
    EOS_ADDED_ON_LOAD,
    MODEL_PATH,
    NO_EOS,
    WEIGHTS_BROKEN,
    KeelError,
)
from keel.errors.fixes import maker_of, nearby_model, setting

log = logging.getLogger("keel")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def quiet_transformers() -> None:
    """keel draws its own progress; transformers' per-load bars would interleave with it."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")
# A model directory holding this file (and config.json, no weights) is built with random weights on
# the device: `keel bench` writes it for shapes too large to save (Qwen2.5-32B is 61 GiB in bf16).
RANDOM_WEIGHTS = "keel_random_weights.json"


def check_model_dir(path: str | Path, key: str = "actor_rollout_ref.model.path") -> Path:
    """The local model directory `path` names: a directory, or a Hugging Face Hub id
    (`Qwen/Qwen2-7B`) found in this machine's Hub cache. keel never downloads."""
    if not Path(path).exists() and HUB_ID.fullmatch(str(path)):
        return cached_model(str(path), key)
    path = Path(path)
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise KeelError(MODEL_PATH, f"{key}={str(path)!r} {what}", _model_path_fix(str(path), key))
    return path


def _model_path_fix(missing: str, key: str) -> str:
    found, maker = nearby_model(missing), maker_of(missing)
    options = (
        [f"set {setting(key, found)} (the model directory there named like it)"] if found else []
    )
    made = [f"run `{maker}`, which writes it"] if maker else []
    # the script's own folder missing, running it is the fix; else the directory there is the one
    # meant
    options = made + options if maker and not Path(missing).parent.is_dir() else options + made
    return (
        ", or ".join(options)
        or f"set {key} to a local directory saved with save_pretrained (one holding config.json)"
    )


def cached_model(repo_id: str, key: str) -> Path:
    """A Hub id's snapshot in the local cache (HF_HUB_CACHE, or HF_HOME/hub), offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    cache = os.environ.get("HF_HUB_CACHE") or (
        os.environ["HF_HOME"] + "/hub" if os.environ.get("HF_HOME") else None
    )
    try:
        snapshot = Path(snapshot_download(repo_id, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, OSError, ValueError):
        snapshot = None
    if snapshot is None or not (snapshot / "config.json").is_file():
        where = cache or "the default Hugging Face cache (~/.cache/huggingface/hub)"
        raise KeelError(
            MODEL_PATH,
            f"{key}={repo_id!r} is a Hugging Face Hub id that is not in {where}; keel "
            "downloads nothing",
            f"download it where there is network (`huggingface-cli download "
            f"{repo_id}`) into this machine's cache, or set {key} to a local directory",
        )
    return snapshot


# safetensors' own limit
MAX_HEADER_BYTES = 100 << 20


def weight_file_shapes(path: str | Path) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape from the safetensors headers (8 bytes of length, then JSON), each file
    checked to be as long as its header says: a truncated download fails here with its name, not
    later as a SafetensorError inside from_pretrained. Reads headers only, never the weights."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            listed = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise KeelError(
                WEIGHTS_BROKEN, f"{index} is not a safetensors index ({type(e).__name__})"
            ) from None
        absent = [name for name in listed if not (path / name).is_file()]
        if absent:
            raise KeelError(
                WEIGHTS_BROKEN,
                f"{index.name} in {path} lists {absent[:3]}, which are missing ({len(absent)} "
                f"of {len(listed)} files)",
            )
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(path.glob("*.safetensors")):
        shapes.update(_header_shapes(file))
    return shapes


def _header_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    size = file.stat().st_size
    with open(file, "rb") as handle:
        length = int.from_bytes(handle.read(8), "little") if size >= 8 else -1
        if not 0 < length <= min(size - 8, MAX_HEADER_BYTES):
            raise KeelError(
                WEIGHTS_BROKEN,
                f"{file} ({size} bytes) has no safetensors header: truncated or not a "
                "safetensors file",
            )
        try:
            header = json.loads(handle.read(length))
            tensors = {name: entry for name, entry in header.items() if name != "__metadata__"}
            end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
            shapes = {name: tuple(entry["shape"]) for name, entry in tensors.items()}
        except (ValueError, KeyError, TypeError, IndexError, AttributeError) as e:
            raise KeelError(
                WEIGHTS_BROKEN, f"{file} has a broken safetensors header ({type(e).__name__})"
            ) from None
    if 8 + length + end > size:
        raise KeelError(
            WEIGHTS_BROKEN,
            f"{file} is {size} bytes but its header describes {8 + length + end}: "
            "the file is truncated (an interrupted download or copy)",
        )
    return shapes


def meta_model(model_cfg, trust_remote_code: bool = False) -> nn.Module:
    """The architecture a config describes, on the meta device: shapes and names, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_cfg, trust_remote_code=trust_remote_code)


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    path = check_model_dir(path)
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.eos_token_id is None:
        raise KeelError(
            NO_EOS, f"the tokenizer in {path} has no eos_token", _eos_fix(tokenizer, path)
        )
    if not _in_tokenizer_files(path, tokenizer.eos_token):
        raise KeelError(
            EOS_ADDED_ON_LOAD,
            f"the eos_token {tokenizer.eos_token!r} of the tokenizer in {path} is in none of its "
            f"files: transformers added it on load as a new id ({tokenizer.eos_token_id}), which "
            "the model never trained on and never samples",
            _eos_fix(tokenizer, path),
        )
    if tokenizer.pad_token_id is None:
        log.warning(
            "tokenizer in %s has no pad token; using its EOS token %r as pad",
            path,
            tokenizer.eos_token,
        )
        tokenizer.pad_token = tokenizer.eos_token
    # Generation appends on the right, so prompts are padded on the left.
    tokenizer.padding_side = "left"
    return tokenizer


def _in_tokenizer_files(path: Path, token: str) -> bool:
    """Whether tokenizer.json holds `token` (in its vocabulary or its added tokens); True where
    there is no tokenizer.json to tell (a slow tokenizer's files)."""
    file = path / "tokenizer.json"
    if not file.is_file():
        return True
    try:
        saved = json.loads(file.read_text())
        vocab = saved["model"].get("vocab") or {}
        # BPE, or Unigram's list
        tokens = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}
        return token in tokens | {added["content"] for added in saved.get("added_tokens", [])}
    # a format not known here: no verdict
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return True


END_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|endoftext|>", "</s>", "<eos>", "<|end|>")


def _eos_fix(tokenizer, path: Path) -> str | None:
    """The token config.json's eos_token_id names, else the one end-of-text token the vocabulary
    has."""
    config = json.loads((path / "config.json").read_text())
    ids = config.get("eos_token_id")
    ids = [
        i
        for i in (ids if isinstance(ids, list) else [ids])
        if isinstance(i, int) and i < len(tokenizer)
    ]
    vocab = tokenizer.get_vocab()
    known = [t for t in END_TOKENS if t in vocab]
    token, why = (
        (tokenizer.convert_ids_to_tokens(ids[0]), f"config.json's eos_token_id={ids[0]}")
        if ids
        else (known[0], "the end-of-text token its vocabulary has")
        if len(known) == 1
        else (None, "")
    )
    if token is None:
        return None
    return f'set `"eos_token": "{token}"` in `{path / "tokenizer_config.json"}` ({why})'


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise KeelError(
            DEVICE_UNAVAILABLE,
            "trainer.device=cuda but torch sees no CUDA device",
            f"set {setting('trainer.device', 'cpu')} to run on the CPU (slow for real models), or "
            "run where torch sees a GPU (a CUDA build of torch: torch.version.cuda is "
            f"{torch.version.cuda})",
        )
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
    if device.type == "cuda":
        avoid_cudnn_attention()
    return torch.autocast(device_type=device.type, dtype=dtype)


def avoid_cudnn_attention() -> None:
    """Attention through flash or memory-efficient kernels, never cuDNN's, in every pass that may
    train in half precision.

    Since torch 2.11 cuDNN is the default SDPA backend on H100 and H200, and its backward returns
    NaN in dQ when a mask is passed, the length is 64 more than a multiple of 128 and a row's
    logsumexp is below -88.7 (pytorch#196678; trl#7181 met it in DPO). keel always passes a padding
    mask, and the quick-start's GRPO stopped at step 2 with KEEL-T001 on its 64-token batch. The
    other kernels are exact there, and were torch's choice before 2.11."""
    torch.backends.cuda.enable_cudnn_sdp(False)


def load_causal_lm(
    path: str | Path,
    device: torch.device,
    trust_remote_code: bool = False,
    gradient_checkpointing: bool = False,
    dtype: torch.dtype = torch.float32,
    key: str = "actor_rollout_ref.model.path",
):
    """Weights in float32 (master weights; a frozen LoRA base in the compute dtype); `autocast`
    chooses the compute dtype. `key`: the setting that names `path`, for the error."""
    from transformers import AutoModelForCausalLM

    path = check_model_dir(path, key)
    if (path / RANDOM_WEIGHTS).is_file():
        model = _random_causal_lm(path, device, dtype)
    else:
        # a truncated file is a coded error, not a SafetensorError
        weight_file_shapes(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        )
    if gradient_checkpointing:
        # Non-reentrant: with a frozen embedding (LoRA) the reentrant kind sees inputs that need no
        # gradient and silently drops every adapter's gradient inside the checkpointed layers.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model.to(device)


def _random_causal_lm(path: Path, device: torch.device, dtype: torch.dtype):
    """The config's architecture with random weights drawn on the device, the same on every call
    (the seed is in RANDOM_WEIGHTS): no host copy of a model too large to save."""
    from transformers import AutoConfig, AutoModelForCausalLM

    seed = json.loads((path / RANDOM_WEIGHTS).read_text()).get("seed", 0)
    torch.manual_seed(seed)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)


class CriticModel(nn.Module):
    """A causal LM's backbone with a scalar value head: one value per token."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(hidden_size, 1)
        # Small init: early values near 0 keep the first GAE advantages close to the rewards.
        nn.init.normal_(self.value_head.weight, std=1.0 / (hidden_size + 1))
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):  # [B, L] -> [B, L]
        hidden = self.backbone(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state
        # A copy, not a view: FSDP2 hooks the root's backward onto its output, and drops that hook
        # for a view of a tensor made inside the module (it warns so).
        return self.value_head(hidden).squeeze(-1).clone()


def load_critic(
    path: str | Path,
    device: torch.device,
    trust_remote_code: bool = False,
    dtype: torch.dtype = torch.float32,
) -> CriticModel:
    """The critic; its value head is float32 whatever `dtype` the backbone is loaded in (a LoRA
    critic's frozen backbone is in the compute dtype)."""
    from transformers import AutoModel

    backbone = AutoModel.from_pretrained(
        check_model_dir(path, "critic.model.path"), dtype=dtype, trust_remote_code=trust_remote_code
    )
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
