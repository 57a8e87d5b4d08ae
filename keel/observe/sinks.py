"""Experiment trackers, by verl's `trainer.logger` names: `wandb`, `tensorboard`, `mlflow` (console
and metrics.jsonl are keel's own, in keel.observe.metrics).

Each is the library itself (`pip install -e '.[tracking]'` in keel's checkout). A tracker that
fails, at start or in the middle of a run (network, disk, a revoked key), is logged once and counted
in `tracking/failed_writes`; training goes on, and metrics.jsonl, written first, keeps every record.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

from keel.config.load import flatten
from keel.errors import TRACKER_UNAVAILABLE, KeelError

log = logging.getLogger("keel")

TRACKERS = ("wandb", "tensorboard", "mlflow")


class WandbSink:
    """Weights & Biases: project and run name as verl passes them, the whole config. Offline
    (files under the run directory, `wandb sync` uploads them later) when no API key is set."""

    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import wandb

        offline = not (
            os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") or _wandb_logged_in()
        )
        if offline:
            log.info(
                "wandb: no WANDB_API_KEY, so offline; `wandb sync %s/wandb/offline-run-*` "
                "uploads it",
                run_dir,
            )
        self.run = wandb.init(
            project=project,
            name=name,
            config=config,
            dir=str(run_dir),
            mode="offline" if offline else None,
            reinit="finish_previous",
        )

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self.run.log(metrics, step=step)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        import wandb

        columns = sorted({key for row in rows for key in row})
        self.run.log(
            {
                name: wandb.Table(
                    columns=columns, data=[[str(row.get(c, "")) for c in columns] for row in rows]
                )
            },
            step=step,
        )

    def close(self) -> None:
        self.run.finish()


class TensorBoardSink:
    """Event files in TENSORBOARD_DIR (verl's variable) or the run directory's `tensorboard/`."""

    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(
            os.environ.get("TENSORBOARD_DIR") or str(run_dir / "tensorboard")
        )
        self.writer.add_text("config", "```\n" + _yaml(config) + "\n```", 0)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        text = "\n\n".join("\n".join(f"**{k}**: {v}" for k, v in row.items()) for row in rows)
        self.writer.add_text(name, text, step)

    def close(self) -> None:
        self.writer.close()


class MlflowSink:
    """MLflow: the experiment is the project and the run is named after the experiment, as in verl.
    MLFLOW_TRACKING_URI names the server; without it, a file store in the run directory."""

    # what MLflow allows in a metric key
    _INVALID = re.compile(r"[^/\w.\- :]")

    def __init__(self, project: str, name: str, config: dict, run_dir: Path):
        import mlflow

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        # maintained or not, a file store is the one that needs no server or database
        if not uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = (run_dir / "mlruns").resolve().as_uri()
        self.client = mlflow.tracking.MlflowClient(tracking_uri=uri)
        experiment = self.client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(project)
        )
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [
            mlflow.entities.Param(self.key(key)[:250], str(value)[:6000])
            for key, value in flatten(config).items()
        ]
        # MLflow takes at most 100 params a call
        for start in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, step: int, metrics: dict[str, float]) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        entries = [Metric(self.key(k), float(v), now, step) for k, v in metrics.items()]
        for start in range(0, len(entries), 1000):
            self.client.log_batch(self.run_id, metrics=entries[start : start + 1000])

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        self.client.log_dict(
            self.run_id, {"step": step, "rows": rows}, f"{self.key(name)}/step_{step}.json"
        )

    def close(self) -> None:
        self.client.set_terminated(self.run_id)

    @classmethod
    def key(cls, name: str) -> str:
        """verl's sanitising, so keys match a verl run's: `@` -> `_at_`, other characters -> `_`."""
        return cls._INVALID.sub("_", re.sub(r"/+", "/", name.replace("@", "_at_")))


SINKS = {"wandb": WandbSink, "tensorboard": TensorBoardSink, "mlflow": MlflowSink}
PACKAGES = {"wandb": "wandb", "tensorboard": "tensorboard", "mlflow": "mlflow"}


class Trackers:
    """The run's trackers, each failure contained."""

    def __init__(self, names: list[str], project: str, name: str, config: dict, run_dir: Path):
        self.sinks, self.failed_writes, self._warned = {}, 0, set()
        trackers = [n for n in names if n in SINKS]
        # all of them before any starts: a refusal leaves no run open
        for tracker in trackers:
            require_tracker(tracker, names)
        for tracker in trackers:
            try:
                self.sinks[tracker] = SINKS[tracker](project, name, config, run_dir)
            except Exception as error:  # noqa: BLE001 - a tracker is never worth a run
                self._failed(tracker, "start", error)

    def log(self, step: int, metrics: dict[str, float]) -> None:
        self._each("log", step, metrics)

    def log_table(self, step: int, name: str, rows: list[dict]) -> None:
        self._each("log_table", step, name, rows)

    def close(self) -> None:
        self._each("close")
        self.sinks = {}

    def _each(self, method: str, *args) -> None:
        for tracker, sink in list(self.sinks.items()):
            try:
                getattr(sink, method)(*args)
            except Exception as error:  # noqa: BLE001 - metrics.jsonl already holds the record
                self._failed(tracker, method, error)

    def _failed(self, tracker: str, what: str, error: Exception) -> None:
        self.failed_writes += 1
        # once per tracker: a dead network would flood the log
        if tracker not in self._warned:
            self._warned.add(tracker)
            log.warning(
                "tracker %s failed (%s: %s: %s); training goes on, metrics.jsonl has every record, "
                "and tracking/failed_writes counts the losses",
                tracker,
                what,
                type(error).__name__,
                error,
            )


def require_tracker(name: str, logger: list[str] | None = None) -> None:
    """The tracker's library must be installed: a run that was asked to log there and silently
    did not would be found out days later. `logger`: all of trainer.logger, for the fix without
    it."""
    import importlib.util

    from keel.errors.fixes import setting

    if importlib.util.find_spec(PACKAGES[name]) is None:
        rest = [entry for entry in (logger or [name]) if entry != name]
        raise KeelError(
            TRACKER_UNAVAILABLE,
            f"trainer.logger names {name}, whose package is not installed",
            f"set {setting('trainer.logger', rest)} to train without it, or run `pip install "
            f"{PACKAGES[name]}` (all of keel's trackers: pip install -e '.[tracking]' in keel's "
            "checkout)",
        )


def _wandb_logged_in() -> bool:
    """`wandb login` (its netrc entry) counts as a key, as it does for wandb itself."""
    import netrc

    try:
        return (
            netrc.netrc().authenticators(
                os.environ.get("WANDB_BASE_URL", "api.wandb.ai").removeprefix("https://")
            )
            is not None
        )
    # no ~/.netrc
    except (OSError, netrc.NetrcParseError):
        return False


def describe_tracker(name: str, run_dir: Path) -> str:
    """Where a tracker will write, for `keel check`."""
    if name == "wandb":
        online = (
            os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_MODE") or _wandb_logged_in()
        )
        offline = "offline (no WANDB_API_KEY), files under " + str(run_dir / "wandb")
        return f"wandb: {'online' if online else offline}"
    if name == "tensorboard":
        return f"tensorboard: {os.environ.get('TENSORBOARD_DIR') or run_dir / 'tensorboard'}"
    return f"mlflow: {os.environ.get('MLFLOW_TRACKING_URI') or (run_dir / 'mlruns')}"


def _yaml(config: dict) -> str:
    import yaml

    return yaml.safe_dump(config, sort_keys=False)
