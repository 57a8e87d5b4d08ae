"""Whether a tokenizer fits its model: the special tokens both name (EOS, pad, BOS), ids past the
embedding, and how long a context the pair reads. Each mismatch comes with the fix that makes the
tokenizer the model's (`keel check` reports them; the model was trained with its own ids)."""

from __future__ import annotations

from pathlib import Path

from keel.errors.fixes import free_directory, setting


def special_token_mismatches(
    tokenizer, model_cfg, generation_eos, compare_pad: bool = True, path: str | Path = ""
) -> list[tuple[str, str]]:
    """(what differs, the fix) for the tokenizer's EOS, pad and BOS ids against the model's
    config.json and generation_config.json (in `path`). keel stops rollouts at both EOS sets and
    masks padding, so one difference is a warning; several mean the tokenizer is another model's.
    The fix sets the tokenizer's token to the model's: the model was trained with its ids."""

    def retoken(name: str, token_id: int) -> str:
        return (
            f'set `"{name}_token": "{tokenizer.convert_ids_to_tokens(token_id)}"` in '
            f"`{Path(path, 'tokenizer_config.json')}`"
        )

    def ids(value) -> set[int]:
        return (
            set(value)
            if isinstance(value, (list, tuple))
            else ({value} if value is not None else set())
        )

    def named(token_id) -> str:
        return (
            f"{token_id} ({tokenizer.convert_ids_to_tokens(token_id)!r})"
            if token_id < len(tokenizer)
            else str(token_id)
        )

    found = []
    model_eos = ids(getattr(model_cfg, "eos_token_id", None)) | ids(generation_eos)
    if model_eos and tokenizer.eos_token_id not in model_eos:
        wanted = min(model_eos)
        found.append(
            (
                f"the tokenizer's EOS is {named(tokenizer.eos_token_id)} but the model's config "
                f"ends with {sorted(named(i) for i in model_eos)}",
                f"{retoken('eos', wanted)} (the end config.json names), or use the tokenizer "
                "saved with this model"
                if wanted < len(tokenizer)
                else "use the tokenizer saved with this model",
            )
        )
    for name in ("pad", "bos") if compare_pad else ("bos",):
        model_id, tokenizer_id = (
            getattr(model_cfg, f"{name}_token_id", None),
            getattr(tokenizer, f"{name}_token_id"),
        )
        if model_id is not None and tokenizer_id is not None and model_id != tokenizer_id:
            found.append(
                (
                    f"the tokenizer's {name.upper()} is {named(tokenizer_id)} but config.json "
                    f"says {named(model_id)}",
                    f"{retoken(name, model_id)}, or use the tokenizer saved with this model"
                    if model_id < len(tokenizer)
                    else "use the tokenizer saved with this model",
                )
            )
    return found


# transformers' model_max_length when a tokenizer does not say (int(1e30)): no limit known.
_UNSET_MAX_LENGTH = 10**12


def context_limit(model_cfg, tokenizer) -> tuple[int | None, str]:
    """(tokens a model reads, what sets that): the smaller of config.json's max_position_embeddings
    and the tokenizer's model_max_length, which a fine-tuned model often lowers to what it was
    trained on while its config keeps the base model's positions."""
    limits = []
    positions = getattr(model_cfg, "max_position_embeddings", None)
    if positions:
        limits.append((positions, f"max_position_embeddings={positions} in config.json"))
    if tokenizer.model_max_length < _UNSET_MAX_LENGTH:
        limits.append(
            (
                tokenizer.model_max_length,
                f"model_max_length={tokenizer.model_max_length} in its tokenizer_config.json",
            )
        )
    if not limits:
        return None, "no limit in config.json or the tokenizer"
    limit, why = min(limits)
    if max(limits)[0] != limit:
        why += f" (while {max(limits)[1]})"
    return limit, why


def agree_fix(mismatches: list[tuple[str, str]]) -> str:
    """One fix for several special tokens that differ: every file change at once."""
    changes = [
        fix.split(", or ")[0].removeprefix("set ")
        for _, fix in mismatches
        if fix.startswith("set ")
    ]
    return (
        f"set {' and '.join(changes)}, or " if changes else ""
    ) + "use the tokenizer saved with this model"


def vocab_fix(path: str | Path, size: int, key: str = "actor_rollout_ref.model.path") -> str:
    """The fix for a tokenizer with ids past the embedding: the model with `size` embedding rows
    (the new rows random, trained from there), saved beside it, then used."""
    out = free_directory(Path(f"{path}_resized"))
    code = (
        "from transformers import AutoModelForCausalLM as M, AutoTokenizer as T; m = "
        f"M.from_pretrained('{path}'); m.resize_token_embeddings({size}); "
        f"m.save_pretrained('{out}'); T.from_pretrained('{path}').save_pretrained('{out}')"
    )
    return (
        f'run `python -c "{code}"`, then set {setting(key, str(out))} (the model with an embedding '
        "row for every token), or use the tokenizer saved with this model"
    )
