"""`keel check`'s distillation teacher, from its files (no weights loaded): a Hugging Face model
directory; the student's tokenizer (the same token -> id map, EOS and pad), since the teacher scores
the student's token ids; an embedding row for every id the student gives; the token budget within
its positions; its weight files; and its size, for the memory estimate."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from keel.check.findings import PASS, WARN, Finding, need
from keel.check.model import check_positions, compute_dtype, run_device
from keel.config.schema import KeelConfig
from keel.errors import (
    INCOMPATIBLE_OPTIONS,
    MODEL_PATH,
    TEACHER_VOCAB,
    VOCAB_MISMATCH,
    KeelError,
)
from keel.errors.fixes import setting

KEY = "distillation.teacher.path"
# differing tokens named in a message
SHOWN = 3


@dataclass(frozen=True)
class TeacherModel:
    """What the memory estimate takes of the teacher."""

    path: Path
    config: Any
    parameters: int
    dtype: torch.dtype


def check_teacher(cfg: KeelConfig, context: dict) -> list[Finding]:
    if not cfg.teacher_enabled:
        return []
    from transformers import AutoConfig

    from keel.models.load import check_model_dir

    t = cfg.distillation.teacher
    student = need(context, "tokenizer")
    student_rows = need(context, "model_config").vocab_size
    path = check_model_dir(t.path, key=KEY)
    teacher_tokenizer = _teacher_tokenizer(path, t.trust_remote_code)
    student_pad = None if context.get("pad_from_eos") else student.pad_token_id
    differences = tokenizer_differences(student, teacher_tokenizer, student_pad)
    if differences:
        raise KeelError(
            TEACHER_VOCAB,
            f"the teacher's tokenizer ({path}) is not the student's: " + "; ".join(differences),
            "use a teacher whose tokenizer is the student's: a model of the student's family "
            f"(a larger one of its series), saved with the same tokenizer files, as {KEY}",
        )
    try:
        model_cfg = AutoConfig.from_pretrained(path, trust_remote_code=t.trust_remote_code)
    except ValueError as e:
        refused = _remote_code_refused(e, path)
        if refused is None:
            raise
        raise refused from e
    _check_causal_lm(model_cfg, path)
    found = _check_rows(student, model_cfg.vocab_size, student_rows, path)
    # it reads whole samples
    check_positions(cfg, model_cfg, "teacher", "use a teacher with a longer context")
    parameters, weights, unmatched = _weights(path, model_cfg, t.trust_remote_code)
    dtype = teacher_dtype(cfg, compute_dtype(cfg))
    _check_float8(cfg)
    context["teacher"] = TeacherModel(path, model_cfg, parameters, dtype)
    if unmatched:
        from keel.errors import WEIGHTS_BROKEN

        found.append(Finding(WARN, "teacher", unmatched, WEIGHTS_BROKEN))
    where = (
        f"on a pool of its own ({cfg.pools['teacher']} workers)"
        if "teacher" in cfg.pools
        else "beside the policy"
    )
    summary = (
        f"{path}: {model_cfg.model_type}, {count(parameters)} parameters, {dtype_words(t, dtype)}, "
        f"{where}; the student's tokenizer ({len(student)} tokens, EOS {student.eos_token!r}); "
        f"weights: {weights}"
    )
    return [Finding(PASS, "teacher", summary)] + found


def dtype_words(t, dtype: torch.dtype) -> str:
    """The teacher's dtype as keel loads it, and why (distillation.teacher `t`)."""
    if t.dtype == "float8":
        return "float8 (its decoder layers' matmuls; the rest bfloat16)"
    why = " (auto: the student's compute dtype)" if t.dtype == "auto" else ""
    return str(dtype).removeprefix("torch.") + why


def _check_float8(cfg: KeelConfig) -> None:
    """A float8 teacher where float8 tensor cores are, or KEEL-M011."""
    from keel.models.float8 import require_float8

    if cfg.distillation.teacher.dtype == "float8":
        require_float8(run_device(cfg))


def count(parameters: int) -> str:
    """A parameter count as model cards write it: 91.2K, 7.62B."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale:
            return f"{parameters / scale:.3g}{unit}"
    return str(parameters)


def _teacher_tokenizer(path: Path, trust_remote_code: bool):
    """The teacher's tokenizer as saved (no pad filled in): a teacher without one cannot be shown
    to share the student's."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError, TypeError) as e:
        raise _remote_code_refused(e, path) or KeelError(
            TEACHER_VOCAB,
            f"the teacher's tokenizer in {path} cannot be loaded ({e}), so it cannot be compared "
            "with the student's",
            "save the tokenizer the teacher was trained with beside its weights "
            f"(tokenizer.save_pretrained('{path}')): it must be the student's",
        ) from e


def _remote_code_refused(error: Exception, path: Path) -> KeelError | None:
    """transformers' refusal of a model that brings its own code, as keel's error with the key
    that allows it; None for any other error."""
    if "trust_remote_code" not in str(error):
        return None
    return KeelError(
        INCOMPATIBLE_OPTIONS,
        f"the teacher in {path} brings its own model code (config.json's auto_map), which "
        "distillation.teacher.trust_remote_code=false does not run",
        f"set {setting(KEY.replace('.path', '.trust_remote_code'), True)} (having read the code "
        f"in {path}), or use a teacher of an architecture transformers has",
    )


def tokenizer_differences(student, teacher, student_pad: int | None) -> list[str]:
    """What differs between the student's tokenizer and the teacher's: EOS, pad (where both have
    one of their own), tokens with another id or in one vocabulary only; the first few named."""

    def named(tokenizer, token_id) -> str:
        return (
            "none"
            if token_id is None
            else f"{token_id} ({tokenizer.convert_ids_to_tokens(token_id)!r})"
        )

    found = []
    specials = [("EOS", student.eos_token_id, teacher.eos_token_id)]
    if student_pad is not None and teacher.pad_token_id is not None:
        specials.append(("pad", student_pad, teacher.pad_token_id))
    for name, ours, theirs in specials:
        if ours != theirs:
            found.append(
                f"its {name} is {named(teacher, theirs)}, the student's {named(student, ours)}"
            )
    student_vocab, teacher_vocab = student.get_vocab(), teacher.get_vocab()
    moved = sorted(
        (token_id, token)
        for token, token_id in student_vocab.items()
        if teacher_vocab.get(token) != token_id
    )
    extra = sorted(
        (token_id, token) for token, token_id in teacher_vocab.items() if token not in student_vocab
    )
    if moved:
        first = ", ".join(
            f"{token!r} is {token_id} in the student's, "
            + (
                f"{teacher_vocab[token]} in the teacher's"
                if token in teacher_vocab
                else "not in the teacher's"
            )
            for token_id, token in moved[:SHOWN]
        )
        found.append(
            f"{len(moved)} of the student's {len(student_vocab)} tokens have another id in the "
            f"teacher's or none (first: {first})"
        )
    if extra:
        first = ", ".join(f"{token!r} ({token_id})" for token_id, token in extra[:SHOWN])
        tokens = "a token" if len(extra) == 1 else f"{len(extra)} tokens"
        found.append(f"the teacher has {tokens} the student lacks (first: {first})")
    return found


def _check_rows(student, teacher_rows: int, student_rows: int, path: Path) -> list[Finding]:
    """Every id the student can give has a row in the teacher's embedding (an error for its
    tokens, a warning for its padding rows). Rows past the student's are no matter: gkd's top k
    are drawn among the student's ids (keel.training.teacher)."""
    from keel.models.tokenizer_match import vocab_fix

    if len(student) > teacher_rows:
        raise KeelError(
            VOCAB_MISMATCH,
            f"the student's tokenizer has {len(student)} tokens but the teacher's embedding has "
            f"{teacher_rows} rows: the teacher cannot score ids >= {teacher_rows}",
            vocab_fix(path, len(student), key=KEY),
        )
    found = []
    if teacher_rows < student_rows:
        found.append(
            Finding(
                WARN,
                "teacher",
                f"the teacher's embedding has {teacher_rows} rows, the student's {student_rows}: "
                "a sample of one of the student's untrained padding rows (ids past its "
                f"{len(student)} tokens) would be past the teacher's",
            )
        )
    return found


def _check_causal_lm(model_cfg, path: Path) -> None:
    """The teacher loads as AutoModelForCausalLM (RoleBuilder.teacher): a config transformers maps
    to no causal LM would otherwise fail only once training began."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    own_code = "AutoModelForCausalLM" in (getattr(model_cfg, "auto_map", None) or {})
    if own_code or type(model_cfg) in MODEL_FOR_CAUSAL_LM_MAPPING:
        return
    raise KeelError(
        MODEL_PATH,
        f"{KEY}='{path}' is a {model_cfg.model_type} model, which transformers loads as no causal "
        "LM: the teacher scores each next token, as the student predicts it",
        f"set {KEY} to a causal LM's directory (a decoder, e.g. a larger model of the student's "
        "family) saved with the student's tokenizer",
    )


def _weights(path: Path, model_cfg, trust_remote_code: bool) -> tuple[int, str, str | None]:
    """(parameters, the weight files' summary, a warning or None): the files' shapes against the
    architecture on the meta device (a truncated or wrong-sized file is KEEL-M005)."""
    from keel.models.load import meta_model, stored_parameters
    from keel.models.weight_check import check_weights_match

    try:
        model = meta_model(model_cfg, trust_remote_code)
    # an architecture that will not build on the meta device: the files' own count
    except Exception:
        model = None
    weights, unmatched = check_weights_match(path, model_cfg, model)
    parameters = (
        sum(p.numel() for p in model.parameters()) if model is not None else stored_parameters(path)
    )
    return parameters, weights, unmatched


def teacher_dtype(cfg: KeelConfig, compute_dtype: torch.dtype) -> torch.dtype:
    """The teacher's weights' dtype: distillation.teacher.dtype, auto being the student's compute
    dtype (as RoleBuilder.teacher loads it)."""
    from keel.models.load import resolve_dtype

    name = cfg.distillation.teacher.dtype
    if name == "float8":
        # its decoder layers' weights, which are nearly all of it
        return torch.float8_e4m3fn
    return compute_dtype if name == "auto" else resolve_dtype(name, torch.device("cpu"))
