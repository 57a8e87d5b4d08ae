"""trainer.logger's experiment trackers, each read back with its own library: what keel wrote is
what the run's metrics.jsonl holds, under verl's names; a tracker that breaks mid-run costs no step
and no record."""

import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from keel.api import train

pytest.importorskip("wandb")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboard")


def metrics_jsonl(run_dir: Path) -> dict[int, dict]:
    return {
        r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    }


def wandb_records(run_dir: Path) -> list[dict]:
    """The offline run's transaction log, read by wandb's own reader."""
    [log_file] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    out = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log_file)],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    ).stdout
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


@pytest.fixture
def tracked_run(tiny_config, monkeypatch):
    for variable in ("WANDB_API_KEY", "WANDB_MODE", "MLFLOW_TRACKING_URI", "TENSORBOARD_DIR"):
        monkeypatch.delenv(variable, raising=False)
    tiny_config["trainer"].update(
        {
            "logger": ["console", "wandb", "tensorboard", "mlflow"],
            "project_name": "keel_t",
            "experiment_name": "trackers",
            "log_val_generations": 2,
        }
    )
    result = train(tiny_config)
    return result.run_dir, metrics_jsonl(result.run_dir)


def test_each_tracker_holds_the_runs_metrics_config_and_validation(tracked_run):
    run_dir, records = tracked_run
    score = {step: records[step]["critic/score/mean"] for step in (1, 2)}
    # verl's name
    val_key = next(k for k in records[2] if k.startswith("val-core/") and k.endswith("/mean@1"))

    # TensorBoard: the event files, read with tensorboard's own accumulator.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    assert {e.step: e.value for e in events.Scalars("critic/score/mean")} == pytest.approx(score)
    assert events.Scalars(val_key)[-1].value == pytest.approx(records[2][val_key])

    # MLflow: the file store, read with its client.
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    [run] = client.search_runs([client.get_experiment_by_name("keel_t").experiment_id])
    assert run.info.run_name == "trackers" and run.data.params["data.train_batch_size"] == "4"
    history = client.get_metric_history(run.info.run_id, "critic/score/mean")
    assert {m.step: m.value for m in history} == pytest.approx(score)
    assert run.data.metrics[val_key.replace("@", "_at_")] == pytest.approx(records[2][val_key])
    # the validation table
    assert client.list_artifacts(run.info.run_id, "val/generations")

    # W&B: offline, no API key; its transaction log, read with its own reader.
    logged = wandb_records(run_dir)
    [header] = [r["run"] for r in logged if r["type"] == "run"]
    assert header["project"] == "keel_t" and header["display_name"] == "trackers"
    assert header["config"]["update"]["data"]["train_batch_size"] == 4
    history = {
        r["history"]["step"]["num"]: r["history"]["item"] for r in logged if r["type"] == "history"
    }
    assert {s: history[s]["critic/score/mean"] for s in (1, 2)} == pytest.approx(score)
    # the table
    assert any(key.startswith("val/generations") for item in history.values() for key in item)
    assert records[2]["tracking/failed_writes"] == 0


def test_a_tracker_failing_mid_run_costs_no_step_and_no_record(tiny_config, monkeypatch, caplog):
    from keel.observe import sinks

    calls = []

    # the disk fills after the first write
    def flaky(self, step, metrics):
        calls.append(step)
        if len(calls) > 1:
            raise OSError("No space left on device")

    monkeypatch.setattr(sinks.TensorBoardSink, "log", flaky)
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    tiny_config["trainer"].update(
        {
            "logger": ["tensorboard"],
            "total_training_steps": 3,
            "test_freq": -1,
            "val_before_train": False,
        }
    )
    with caplog.at_level(logging.WARNING, logger="keel"):
        result = train(tiny_config)
    records = metrics_jsonl(result.run_dir)
    assert result.last_step == 3 and sorted(records) == [1, 2, 3]
    assert all(math.isfinite(records[s]["actor/pg_loss"]) for s in (1, 2, 3))
    # step 2's write; step 3's comes after its record
    assert records[3]["tracking/failed_writes"] == 1
    warnings = [r.message for r in caplog.records if "tracker tensorboard failed" in r.getMessage()]
    # said once, not every step
    assert len(warnings) == 1


def test_a_tracker_that_is_not_installed_is_refused_before_training(tiny_config, monkeypatch):
    from keel.errors import TRACKER_UNAVAILABLE, KeelError
    from keel.observe import sinks

    monkeypatch.setitem(sinks.PACKAGES, "mlflow", "keel_no_such_package")
    tiny_config["trainer"]["logger"] = ["mlflow"]
    with pytest.raises(KeelError) as error:
        train(tiny_config)
    assert error.value.code == TRACKER_UNAVAILABLE and ".[tracking]" in error.value.fix
    assert not Path(tiny_config["trainer"]["default_local_dir"], "metrics.jsonl").exists()
