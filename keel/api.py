"""keel's Python API: `train(config)` loads the config, runs `keel check` on it, then trains.

It sits above both the trainer and the check, so neither imports the other: the check judges the
inputs the trainer builds (`keel.trainer.setup.Inputs`) and hands them on.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from keel.check.preference import check_preference
from keel.check.preflight import Report, render, render_brief, run_checks
from keel.config.load import load_config, load_run, objective_of
from keel.config.plan import Plan
from keel.config.preference import PreferenceConfig
from keel.config.schema import KeelConfig
from keel.observe.log import ensure_console_logging
from keel.trainer.preference import PreferenceResult, PreferenceTrainer
from keel.trainer.rl import RLTrainer, RunResult

log = logging.getLogger("keel")


def train(
    config: str | Path | dict | KeelConfig | None = None,
    overrides: list[str] | dict | None = None,
    check: bool = True,
) -> RunResult | PreferenceResult:
    """Load and validate a config (path, dict or object, plus overrides), run `keel check` on it
    (unless `check=False`, which is logged), then train."""
    ensure_console_logging()
    if objective_of(config, overrides) is not None:
        return train_preference(config, overrides, check)
    cfg, plan = load_run(config, overrides)
    report = None
    if check:
        report = preflight(cfg, plan)
        # with the sharding keel check chose
        plan = report.run_plan
    else:
        log.warning("keel check skipped: problems it would have caught will surface during the run")
        for line in [line for line in plan.decided if "vLLM" in line] or plan.decided[:1]:
            log.info("decided for you: %s (`keel check` lists all %d)", line, len(plan.decided))
    return RLTrainer(
        cfg, report.inputs if report else None, render(report) if report else None, plan
    ).fit()


def train_preference(
    config: str | Path | dict | PreferenceConfig | None = None,
    overrides: list[str] | dict | None = None,
    check: bool = True,
) -> PreferenceResult:
    """DPO or reward-model training (the config's `objective`), after its `keel check`."""
    ensure_console_logging()
    cfg = load_config(config, overrides, schema=PreferenceConfig)
    if check:
        report = check_preference(cfg)
        if report.failures:
            print(render(report), file=sys.stderr)
            raise report.first_error()
        if "console" in cfg.trainer.logger:
            print(render(report), file=sys.stderr)
    else:
        log.warning("keel check skipped: problems it would have caught will surface during the run")
    return PreferenceTrainer(cfg).fit()


def preflight(cfg: KeelConfig, plan: Plan | None = None) -> Report:
    """Stop before any model weight is loaded if `keel check` finds a failure; returns its report,
    whose inputs (what the checks loaded) the trainer does not load again. Prints the report in
    brief: the whole of it goes to the run directory (check.txt)."""
    report = run_checks(cfg, plan)
    if report.failures:
        print(render(report), file=sys.stderr)
        raise report.first_error()
    if "console" in cfg.trainer.logger:
        print(render_brief(report), file=sys.stderr)
    return report
