"""`keel check`: everything that can be known to fail before a GPU-hour is spent.

Loads the tokenizer, the model configs (not the weights) and the datasets, runs the scorer on a few
rows, and estimates memory. Each check yields findings (pass / warn / fail); a failure carries the
catalogue code that `keel train` exits with.
"""

from __future__ import annotations

import tempfile
import textwrap
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from keel import checkpoint as ckpt
from keel.check.engine import check_rollout_engine
from keel.check.findings import FAIL, PASS, SKIP, WARN, Finding, Skipped, need
from keel.check.model import check_model, check_tokenizer
from keel.check.multi_turn import check_multi_turn
from keel.check.resources import check_memory, check_sharding, check_workers
from keel.check.reward import check_reward, sandbox_finding  # noqa: F401 (sandbox_finding: tests)
from keel.check.teacher import check_teacher, dtype_words
from keel.config.plan import Plan, make_plan, plan_of
from keel.config.schema import KeelConfig
from keel.errors import (
    RUN_DIR_NOT_WRITABLE,
    KeelError,
)
from keel.errors.fixes import writable_run_dir

if TYPE_CHECKING:
    from keel.trainer.setup import Inputs


@dataclass
class Report:
    findings: list[Finding]
    plan: dict
    plan_text: str
    audit: dict[str, str]
    memory_gb: dict[str, float]
    # keel's decisions for the config, with the sharding chosen here: what the trainer takes on
    run_plan: Plan | None = field(default=None, repr=False)
    # for `keel train` to reuse, not load again
    inputs: Inputs | None = field(default=None, repr=False)

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.level == FAIL]

    def as_dict(self) -> dict:
        return {
            "findings": [asdict(f) for f in self.findings],
            "plan": self.plan,
            "audit": self.audit,
            "memory_gb": self.memory_gb,
            "ok": not self.failures,
        }

    def first_error(self) -> KeelError:
        return self.failures[0].error()


def run_checks(cfg: KeelConfig, plan: Plan | None = None) -> Report:
    """Every check on `cfg` under `plan` (`load_run`'s; None: the config's own, as written)."""
    from keel.models.load import quiet_transformers

    quiet_transformers()
    findings: list[Finding] = []
    context: dict = {"plan": plan or plan_of(cfg)}
    for name, check in CHECKS:
        try:
            findings += check(cfg, context)
        except KeelError as e:
            findings.append(Finding.failed(name, e))
        except Skipped as missing:
            findings.append(
                Finding(SKIP, name, f"skipped: needs the {missing} an earlier check could not load")
            )
    memory = context.get("memory_gb", {})
    plan = context["plan"]
    batch_plan = make_plan(cfg, plan)
    from keel.trainer.setup import Inputs

    inputs = None
    if all(key in context for key in ("tokenizer", "train_records", "reward")):
        inputs = Inputs(
            context["tokenizer"],
            context["train_records"],
            context.get("val_records", []),
            context["reward"],
        )
    return Report(
        findings,
        batch_plan.as_dict(),
        batch_plan.render(),
        audit(cfg, context),
        memory,
        plan,
        inputs,
    )


# --- the checks, in the order a user would fix them ---------------------------------------------


def check_data(cfg: KeelConfig, context: dict) -> list[Finding]:
    from keel.trainer.setup import read_prompts, require_enough_prompts

    found = []
    for name, files in (("train", cfg.data.train_files), ("val", cfg.data.val_files)):
        records, stats = read_prompts(files, need(context, "tokenizer"), cfg, name)
        # no such split: no files, and no environment that brings it
        if not files and not records:
            continue
        context[f"{name}_records"] = records
        found.append(
            Finding(WARN if stats.truncated or stats.dropped else PASS, "data", stats.summary())
        )
    # none: an environment without a train split
    require_enough_prompts(len(context.get("train_records", [])), cfg)
    return found


def check_run_dir(cfg: KeelConfig, context: dict) -> list[Finding]:
    run_dir = Path(cfg.run_dir)
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists())
    try:
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as e:
        raise KeelError(
            RUN_DIR_NOT_WRITABLE, f"cannot write under {existing}: {e}", writable_run_dir(run_dir)
        ) from e
    resume = ckpt.resume_point(run_dir, cfg, context["plan"].applied(cfg))
    action = f"resume from {resume}" if resume is not None else "start a new run"
    return [Finding(PASS, "run directory", f"{run_dir}: writable; will {action}")]


def check_trackers(cfg: KeelConfig, context: dict) -> list[Finding]:
    """Every tracker in trainer.logger can be started: its package is installed."""
    from keel.observe.sinks import SINKS, describe_tracker, require_tracker

    trackers = [name for name in cfg.trainer.logger if name in SINKS]
    for name in trackers:
        require_tracker(name, cfg.trainer.logger)
    return [
        Finding(PASS, "trackers", describe_tracker(name, Path(cfg.run_dir))) for name in trackers
    ]


CHECKS = [
    ("tokenizer", check_tokenizer),
    ("model", check_model),
    ("teacher", check_teacher),
    ("rollout engine", check_rollout_engine),
    ("data", check_data),
    ("reward", check_reward),
    ("multi-turn", check_multi_turn),
    ("run directory", check_run_dir),
    ("trackers", check_trackers),
    ("sharding", check_sharding),
    ("workers", check_workers),
    ("memory", check_memory),
]


# --- what keel decided for you ----------------------------------------------------------------

# The decisions that are not a verl key's (those follow them in `audit`), in the order printed.
_GENERAL_DECISIONS = (
    "trainer.default_local_dir",
    "device",
    "compute dtype",
    "critic",
    "reference model",
    "teacher",
    "clip range",
    "critic batching",
    "total training steps",
    "pad token",
    "loss_agg_mode",
)


def audit(cfg: KeelConfig, context: dict) -> dict[str, str]:
    """Every value keel derived or overrode, so no change is silent."""
    from keel.models.load import resolve_device, resolve_dtype

    actor = cfg.actor_rollout_ref.actor
    device = resolve_device(cfg.trainer.device)
    mini, micro, epochs = cfg.critic_batching
    decided = {
        "trainer.default_local_dir": cfg.run_dir,
        "device": f"{device} (trainer.device={cfg.trainer.device})",
        "compute dtype": f"{resolve_dtype(cfg.actor_rollout_ref.model.dtype, device)}; weights "
        "and optimiser state float32",
        "critic": "on" if cfg.critic_enabled else "off",
        "reference model": "on" if cfg.ref_enabled else "off",
        "clip range": f"[1 - {actor.clip_ratio_low or actor.clip_ratio}, "
        f"1 + {actor.clip_ratio_high or actor.clip_ratio}]",
    }
    if cfg.critic_enabled:
        decided["critic batching"] = f"mini {mini} prompts, micro {micro} samples, {epochs} epochs"
    if "train_records" in context:
        from keel.trainer.setup import total_steps

        # the sampler drops the rest
        per_epoch = len(context["train_records"]) // cfg.data.train_batch_size
        decided["total training steps"] = f"{total_steps(cfg, per_epoch)} ({per_epoch} per epoch)"
    if context.get("pad_from_eos"):
        decided["pad token"] = "EOS (the tokenizer has none)"
    if actor.policy_loss.loss_mode == "gspo" and actor.loss_agg_mode != "seq-mean-token-mean":
        decided["loss_agg_mode"] = (
            f"{actor.loss_agg_mode} for GSPO, as verl 0.9.1 takes it (the paper's objective "
            "is seq-mean-token-mean, which verl's GSPO examples set)"
        )
    if actor.loss_agg_mode == "seq-mean-token-sum-norm":
        decided["loss_agg_mode"] = (
            "seq-mean-token-sum-norm as Dr. GRPO writes it (a mean over sequences); verl's "
            "loss is this times ppo_micro_batch_size_per_gpu (docs/config.md)"
        )
    if "teacher" in context:
        decided["teacher"] = _teacher_decision(cfg, context["teacher"].dtype)
    decided.update(_verl_decisions(context["plan"].decided))
    return decided


def _teacher_decision(cfg: KeelConfig, dtype) -> str:
    """The teacher's dtype and place, as keel loads it."""
    where = (
        f"on a pool of its own, {cfg.pools['teacher']} workers"
        if "teacher" in cfg.pools
        else "beside the policy"
    )
    dtype_text = dtype_words(cfg.distillation.teacher, dtype)
    return f"{dtype_text}, {where}; frozen, {cfg.distillation.mode}"


def _verl_decisions(lines: list[str]) -> dict[str, str]:
    """What keel took of verl's keys, one entry per reason (forty profiler keys are one line)."""
    by_reason: dict[str, list[str]] = {}
    # "key: reason"
    for line in lines:
        key, _, reason = line.partition(": ")
        by_reason.setdefault(reason, []).append(key)
    return {
        (keys[0] if len(keys) == 1 else f"{keys[0]} and {len(keys) - 1} more"): reason
        for reason, keys in by_reason.items()
    }


def render_brief(report: Report) -> str:
    """What `keel train` prints before step 1: the verdict, every finding that is not ok, and what
    keel decided in a few lines; `render` (saved as check.txt in the run directory) has the rest."""
    counts = {level: sum(f.level == level for f in report.findings) for level in (PASS, WARN, FAIL)}
    lines = [f"keel check: {counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed"]
    for f in report.findings:
        lines += _finding_lines(f) if f.level != PASS else []
    general = {key: value for key, value in report.audit.items() if key in _GENERAL_DECISIONS}
    verl = [key for key in report.audit if key not in _GENERAL_DECISIONS]
    shown = [
        general[key].split(" (")[0] if key == "device" else f"{key} {general[key].split(';')[0]}"
        for key in _GENERAL_DECISIONS
        if key in general and key != "trainer.default_local_dir"
    ]
    lines.append("decided for you: " + "; ".join(shown))
    if verl:
        lines += textwrap.wrap(
            f"{len(verl)} of verl's defaults or keys taken otherwise (check.txt says how and "
            f"why): {', '.join(verl)}",
            110,
            initial_indent="  ",
            subsequent_indent="    ",
        )
    return "\n".join(lines)


def _finding_lines(f: Finding) -> list[str]:
    """A failure as `keel train` prints the same problem (the error, then the fix); a warning with
    its fix when it has one."""
    mark = {PASS: "ok  ", WARN: "warn", FAIL: "FAIL", SKIP: "skip"}[f.level]
    if f.level == FAIL:
        return [f"  [{mark}] {f.check}"] + [
            f"         {line}" for line in f.error().render().splitlines()
        ]
    return [f"  [{mark}] {f.check:<14} {f.message}" + (f"  ({f.code})" if f.code else "")] + (
        [f"         fix: {f.fix}"] if f.fix and f.level == WARN else []
    )


def render(report: Report) -> str:
    lines = ["keel check"]
    for f in report.findings:
        lines += _finding_lines(f)
    lines.append(report.plan_text)
    lines.append("decided for you")
    lines += [f"  {key:<26} {value}" for key, value in report.audit.items()]
    if report.memory_gb:
        lines.append(
            "memory estimate per device (GB): "
            + ", ".join(f"{k} {v}" for k, v in report.memory_gb.items())
        )
    counts = {level: sum(f.level == level for f in report.findings) for level in (PASS, WARN, FAIL)}
    verdict = "ready to train" if not counts[FAIL] else "fix the failures above before training"
    lines.append(
        f"{counts[PASS]} passed, {counts[WARN]} warnings, {counts[FAIL]} failed: {verdict}"
    )
    return "\n".join(lines)
