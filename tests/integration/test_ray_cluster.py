"""The multi-node recipe on one machine: `ray start --head`, then `keel train` runs its workers on
that cluster, through RAY_ADDRESS as the README says, or found without it (the cluster Ray joins
unasked, which would otherwise refuse keel's start with a confusing error)."""

import json
import os
import secrets
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

from test_distributed import keel_train, write_config  # noqa: E402


def _ray(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ray.scripts.scripts", *args],
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture
def head_node():
    """A cluster started as a user starts one, with Ray's token authentication (a driver joining
    by address must present the token); stopped afterwards (no test of this process holds Ray at
    the time: `ray stop` ends every Ray process of the machine). -> (address, auth environment)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    auth = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    started = _ray(
        "start",
        "--head",
        f"--port={port}",
        "--num-cpus=3",
        "--include-dashboard=false",
        "--disable-usage-stats",
        env=auth,
    )
    assert started.returncode == 0, started.stderr[-2000:]
    try:
        yield f"127.0.0.1:{port}", auth
    finally:
        _ray("stop", "--force")


@pytest.mark.parametrize("with_address", [True, False], ids=["RAY_ADDRESS", "found"])
def test_keel_train_runs_its_workers_on_a_cluster_started_with_ray_start(
    tiny_config, tmp_path, head_node, with_address, monkeypatch
):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    address, auth = head_node
    config = write_config(tiny_config, tmp_path / "cfg.yaml")
    proc = keel_train(
        config,
        "trainer.n_gpus_per_node=2",
        "trainer.total_training_steps=1",
        env={**auth, "RAY_ADDRESS": address} if with_address else auth,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    # not a Ray instance of its own
    assert "Connecting to existing Ray cluster" in proc.stderr
    assert (
        with_address
        or "joining the Ray cluster that `ray start` runs on this machine" in proc.stderr
    )
    lines = (
        (Path(tiny_config["trainer"]["default_local_dir"]) / "metrics.jsonl")
        .read_text()
        .splitlines()
    )
    assert json.loads(lines[-1])["step"] == 1
