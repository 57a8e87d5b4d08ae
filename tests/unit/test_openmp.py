"""torch's OpenMP threads sleep while they wait, as keel sets before torch loads (keel/openmp.py).

libgomp prints the spin count it runs with (OMP_DISPLAY_ENV=verbose) when torch loads it: 0 is a
thread that sleeps at once, 300000 its own default of spinning first.
"""

import os
import re
import subprocess
import sys

import pytest


def spin_count(code: str, **env: str) -> tuple[str, str]:
    environ = {
        k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
    }
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environ, "OMP_DISPLAY_ENV": "verbose", **env},
    )
    assert run.returncode == 0, run.stderr
    return re.search(r"GOMP_SPINCOUNT = '(\d+)'", run.stderr).group(1), run.stdout


def test_importing_keel_first_makes_torchs_threads_sleep_while_they_wait():
    count, said = spin_count(
        "import keel, torch\nfrom keel.openmp import how_threads_wait\nprint(how_threads_wait())"
    )
    assert count == "0"
    assert said.startswith("(True, 'sleeping")


def test_a_users_own_choice_is_kept():
    count, said = spin_count(
        "import keel, torch\nfrom keel.openmp import how_threads_wait\nprint(how_threads_wait())",
        OMP_WAIT_POLICY="ACTIVE",
    )
    # libgomp's spin for an active policy
    assert int(count) > 300000
    assert "as set: OMP_WAIT_POLICY=ACTIVE" in said


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="keel check warns for a run on the CPU"
)
def test_torch_imported_first_spins_and_keel_check_says_so_on_the_cpu(tiny_config, tmp_path):
    import yaml

    config = tmp_path / "cfg.yaml"
    config.write_text(yaml.safe_dump(tiny_config))
    count, said = spin_count(
        f"import torch\nfrom keel.cli import main\nmain(['check', {str(config)!r}])"
    )
    assert count == "300000"
    assert "[warn] workers" in said and "export OMP_WAIT_POLICY=PASSIVE" in said


@pytest.mark.parametrize("as_meant, level", [(True, "pass"), (False, "warn")])
def test_keel_doctor_reports_how_threads_wait(as_meant, level):
    from keel.check.doctor import check_cpu_threads

    assert check_cpu_threads(as_meant, "how").level == level
