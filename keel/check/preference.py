"""`keel check` for preference training (`objective: dpo | reward_model`): the model directory and
its tokenizer, the pairs as the trainer will read them (columns, empty and identical completions,
lengths), where the reference comes from, and the run directory. No weights are loaded."""

from __future__ import annotations

from pathlib import Path

from keel import checkpoint as ckpt
from keel.check.findings import PASS, WARN, Finding, need
from keel.check.preflight import Report
from keel.config.preference import PreferenceConfig
from keel.errors import IDENTICAL_PAIR, SEPARATE_REFERENCE, KeelError
from keel.errors.fixes import setting


def check_preference(cfg: PreferenceConfig) -> Report:
    from keel.models.load import quiet_transformers

    quiet_transformers()
    findings: list[Finding] = []
    context: dict = {}
    for name, check in (
        ("model", _check_model),
        ("data", _check_pairs),
        ("reference", _check_reference),
        ("run directory", _check_run_dir),
    ):
        try:
            findings += check(cfg, context)
        except KeelError as e:
            findings.append(Finding.failed(name, e))
        except KeyError as missing:
            findings.append(Finding("skip", name, f"skipped: needs the {missing} not loaded"))
    plan = _plan(cfg, context)
    text = "plan\n" + "\n".join(f"  {key:<26} {value}" for key, value in plan.items())
    return Report(findings, plan, text, _decisions(cfg), {})


def _decisions(cfg: PreferenceConfig) -> dict[str, str]:
    """What keel chose where the config left it to keel (`auto`)."""
    decided = {}
    if cfg.objective == "dpo" and cfg.dpo.reference == "auto":
        decided["dpo.reference"] = f"{cfg.reference} (auto: {_reference_text(cfg)})"
    if cfg.model.dtype == "auto":
        decided["model.dtype"] = "bfloat16 autocast on a GPU, float32 on CPU (auto)"
    return decided


def _check_model(cfg: PreferenceConfig, context: dict) -> list[Finding]:
    from transformers import AutoConfig

    from keel.models.load import check_model_dir, load_tokenizer

    m = cfg.model
    path = check_model_dir(m.path, "model.path")
    context["tokenizer"] = tokenizer = load_tokenizer(path, m.trust_remote_code)
    model_cfg = AutoConfig.from_pretrained(path, trust_remote_code=m.trust_remote_code)
    found = [
        Finding(
            PASS,
            "model",
            f"{path}: {model_cfg.model_type}, tokenizer with {len(tokenizer)} tokens",
        )
    ]
    limit = getattr(model_cfg, "max_position_embeddings", None)
    if limit and cfg.data.max_length > limit:
        found.append(
            Finding(
                WARN,
                "model",
                f"data.max_length={cfg.data.max_length} is over the model's "
                f"max_position_embeddings={limit}",
                fix=f"set {setting('data.max_length', limit)}",
            )
        )
    return found


def _check_pairs(cfg: PreferenceConfig, context: dict) -> list[Finding]:
    import logging

    from keel.data.preference import PairColumns, build_pairs
    from keel.data.prompts import load_rows

    d, found = cfg.data, []
    tokenizer = need(context, "tokenizer")
    for name, files in (("train", d.train_files), ("val", d.val_files)):
        if not files:
            continue
        # the trainer's own warnings are this check's findings
        logging.getLogger("keel").disabled = True
        try:
            pairs, stats = build_pairs(
                load_rows(files, f"data.{name}_files"),
                tokenizer,
                PairColumns.of(d),
                max_length=d.max_length,
                truncation=d.truncation,
                for_reward_model=cfg.objective == "reward_model",
                name=name,
                files=files,
            )
        finally:
            logging.getLogger("keel").disabled = False
        context[f"{name}_pairs"] = pairs
        level = WARN if stats.truncated or stats.identical else PASS
        code = IDENTICAL_PAIR if stats.identical else None
        fix = f"remove the {stats.identical} identical rows" if stats.identical else None
        if stats.truncated:
            fix = (fix + "; " if fix else "") + "raise data.max_length to keep prompts whole"
        found.append(Finding(level, "data", stats.summary(), code, fix))
    return found


def _check_reference(cfg: PreferenceConfig, context: dict) -> list[Finding]:
    if cfg.objective != "dpo":
        return [Finding(PASS, "reference", "a reward model has none")]
    kind = cfg.reference
    if kind == "model" and cfg.model.lora_rank:
        return [
            Finding(
                WARN,
                "reference",
                "dpo.reference=model loads a second copy of the model, while LoRA's base with "
                "its adapters off is the same reference and is already held",
                SEPARATE_REFERENCE,
                f"set {setting('dpo.reference', 'adapter')}, or "
                f"{setting('dpo.reference', 'cached')} (computed once before training)",
            )
        ]
    return [Finding(PASS, "reference", _reference_text(cfg))]


def _reference_text(cfg: PreferenceConfig) -> str:
    return {
        "cached": "log-probs computed once before training by the starting model, kept in the "
        "run directory",
        "model": "a frozen copy of the starting model, a pass each step",
        "adapter": "LoRA's base with the adapters off, a pass each step",
        "none": f"none: dpo.loss_type={cfg.dpo.loss_type} is reference-free",
    }[cfg.reference]


def _check_run_dir(cfg: PreferenceConfig, context: dict) -> list[Finding]:
    run_dir = Path(cfg.run_dir)
    resume = ckpt.resume_point(run_dir, cfg)
    action = f"resume from {resume}" if resume is not None else "start a new run"
    return [Finding(PASS, "run directory", f"{run_dir}: will {action}")]


def _plan(cfg: PreferenceConfig, context: dict) -> dict:
    d = cfg.data
    plan = {
        "objective": cfg.objective,
        "pairs per step": d.train_batch_size,
        "micro-batches per step": d.train_batch_size // d.micro_batch_size_per_gpu,
        "packing": ("a pair's prompt once, " if d.share_prompt else "")
        + ("rows without padding" if d.padding_free else "padded rows"),
    }
    if "train_pairs" in context:
        plan["train pairs"] = len(context["train_pairs"])
    if cfg.objective == "dpo":
        plan["loss"] = f"{cfg.dpo.loss_type}, beta {cfg.dpo.beta}"
        plan["reference"] = cfg.reference
    return plan
