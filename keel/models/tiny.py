"""Tiny models and a tokenizer built by keel itself, for tests, examples and the demo.

Nothing is downloaded: the tokenizer is byte-level (one token per byte, plus chat special tokens)
and the model is one of the families' architectures (models/families.py) with random weights,
saved with `save_pretrained` so it loads like any Hugging Face checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from keel.models.families import tiny_fields, tiny_model_types

PAD, EOS, IM_START, IM_END = "<|pad|>", "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [PAD, EOS, IM_START, IM_END]

# ChatML, as Qwen uses; `add_generation_prompt` opens the assistant turn. The assistant turn ends
# with <|im_end|>, which is the tokenizer's EOS so generation stops there.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


# Qwen2's pre-tokenizer split: contractions, words, single digits, punctuation runs, newlines.
_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def build_tokenizer(with_pad: bool = True):
    """A byte-level fast tokenizer with one token per byte (no merges) and a ChatML template.

    It is built the way Qwen2's tokenizer is (regex split, byte-level alphabet, BPE), so it
    tokenizes identically whichever class `AutoTokenizer` picks for the model type: transformers 5
    loads a `qwen2` checkpoint's tokenizer.json through `Qwen2Tokenizer`, which keeps the vocabulary
    but replaces the pipeline. Any UTF-8 text round-trips; EOS is <|im_end|>.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    # 256 printable stand-ins for the bytes
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD if with_pad else None,
        additional_special_tokens=[EOS, IM_START],
        model_max_length=2048,
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def build_model_config(
    arch: str = "qwen2",
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int | None = None,
    max_position_embeddings: int = 1024,
    eos_token_id: int | None = None,
    pad_token_id: int | None = None,
    tie_word_embeddings: bool = True,
    initializer_range: float = 0.02,
):
    """A test-sized config of a model type: these common sizes, plus the fields its family's record
    (models/families.py) gives it."""
    from transformers import AutoConfig

    extra_fields = tiny_fields(arch)
    if extra_fields is None:
        raise ValueError(f"unknown tiny architecture {arch!r}; choose one of {tiny_model_types()}")
    return AutoConfig.for_model(
        arch,
        **extra_fields(hidden_size, num_heads, num_layers),
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=initializer_range,
    )


def make_tiny_reward_model(out_dir: str | Path, seed: int = 0, **config_overrides) -> Path:
    """A random-weight Qwen2 sequence classifier (one score) with keel's tokenizer."""
    import torch
    from transformers import AutoModelForSequenceClassification

    out_dir = Path(out_dir)
    tokenizer = build_tokenizer()
    config = build_model_config(
        "qwen2",
        vocab_size=(len(tokenizer) + 7) // 8 * 8,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    config.num_labels = 1
    torch.manual_seed(seed)
    AutoModelForSequenceClassification.from_config(config).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_tiny_model(
    out_dir: str | Path,
    arch: str = "qwen2",
    seed: int = 0,
    with_pad: bool = True,
    **config_overrides,
) -> Path:
    """Write a random-weight model and keel's tokenizer to `out_dir`; returns the path."""
    import torch
    from transformers import AutoModelForCausalLM

    from keel.models.load import quiet_transformers

    quiet_transformers()
    out_dir = Path(out_dir)
    tokenizer = build_tokenizer(with_pad=with_pad)
    # Round the vocabulary up to a multiple of 8, as real checkpoints do (embedding rows > tokens).
    vocab_size = (len(tokenizer) + 7) // 8 * 8
    config = build_model_config(
        arch,
        vocab_size=vocab_size,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **config_overrides,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
