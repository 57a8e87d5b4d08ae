"""The README, as a new user follows it: on a fresh copy of the repository, in a new virtual
environment, `make demo` (shortened by the `DEMO_FLAGS=--smoke` the README documents beside it),
then every bash and python block of its "## Your own run" section, in order, as written.

The blocks are read from README.md itself, so a command edited there is the command tested here.
The venv sees the machine's packages (torch and the rest are already installed), so `make install`
and the README's `pip install` only install keel, from the copy, editable.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[2]
README = ROOT / "README.md"

pytestmark = pytest.mark.slow


def section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(text: str) -> list[tuple[str, str]]:
    """(language, code) of each ```bash and ```python block of `text`, in order."""
    return re.findall(r"^```(bash|python)\n(.*?)^```", text, re.S | re.M)


def fresh_copy(dest: Path) -> Path:
    """What a clone of this working tree would hold: its tracked files and the new ones git does
    not ignore, as they are now (on CI, a clean clone of main: the same as `git clone`). No build
    outputs, run directories or data a local run left behind come along."""
    listed = (
        subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        )
        .stdout.decode()
        .split("\0")
    )
    for name in filter(None, listed):
        # a tracked file deleted in the working tree is not there
        if (ROOT / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def new_venv(path: Path) -> dict[str, str]:
    """A venv whose bin comes first on PATH, so `python3`, `pip` and `keel` are its own; the
    environment a shell in it would have, without anything pointing at this checkout's keel."""
    subprocess.run(
        [sys.executable, "-m", "venv", "--system-site-packages", str(path)], check=True, timeout=300
    )
    # An outer `make test PYTHON=...` passes its variables to every make below it (MAKEFLAGS): the
    # README's `make demo` must install into the venv, never into the environment running the tests.
    left_out = (
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTEST_ADDOPTS",
        "MAKEFLAGS",
        "MFLAGS",
        "MAKELEVEL",
        "PYTHON",
        "TORCH",
    )
    env = {k: v for k, v in os.environ.items() if k not in left_out}
    env.update(
        PATH=f"{path / 'bin'}{os.pathsep}{os.environ['PATH']}",
        VIRTUAL_ENV=str(path),
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        DEMO_FLAGS="--smoke",
    )
    return env


def run_block(language: str, code: str, cwd: Path, env: dict[str, str]) -> str:
    python = str(Path(env["VIRTUAL_ENV"]) / "bin" / "python")
    command = (
        ["bash", "-euo", "pipefail", "-c", code] if language == "bash" else [python, "-c", code]
    )
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=1200)
    output = done.stdout + done.stderr
    assert done.returncode == 0, (
        f"README block failed (exit {done.returncode}):\n{code}\n...\n{output[-4000:]}"
    )
    return done.stdout


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_new_user_runs_the_readme_in_order(tmp_path):
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: there is no clone to copy")
    readme = README.read_text()
    clone, env = fresh_copy(tmp_path / "keel"), new_venv(tmp_path / "venv")

    make_demo = [
        line
        for _, code in code_blocks(section(readme, "Two commands"))
        for line in code.splitlines()
        if line.startswith("make demo")
    ]
    assert make_demo and "DEMO_FLAGS=--smoke make demo" in section(readme, "Two commands")
    out = run_block("bash", make_demo[0], clone, env)
    assert "smoke run" in out and (clone / "keel_demo_smoke" / "grpo" / "report.png").is_file()
    # not beside a keel/
    where = run_block("python", "import keel; print(keel.__file__)", tmp_path / "venv", env)
    # the copy's keel, not this checkout's
    assert Path(where.strip()).is_relative_to(clone), where

    blocks = code_blocks(section(readme, "Your own run"))
    assert [language for language, _ in blocks].count("python") >= 1 and len(blocks) >= 3
    printed = [run_block(language, code, clone, env) for language, code in blocks]
    check_your_own_run(clone, printed[-1])


def check_your_own_run(clone: Path, snippet_output: str) -> None:
    """What the section tells a user to look for, each run in a directory of its own."""
    runs = clone / "checkpoints" / "quickstart"
    quickstart = metrics(runs / "grpo_digits")
    scores = [m["critic/score/mean"] for m in quickstart if "critic/score/mean" in m]
    # "lifts the mean score"
    assert quickstart[-1]["step"] == 30 and scores[-1] > scores[0] + 0.5, scores
    assert (runs / "grpo_digits" / "report.png").is_file() and (
        runs / "grpo_digits" / "report.html"
    ).is_file()
    # a run of its own, not a refused resume of the quickstart's
    lora = metrics(runs / "grpo_digits_lora")
    assert (
        lora[-1]["step"] == 30 and (runs / "grpo_digits_lora" / "global_step_30" / "actor").is_dir()
    )
    # the SFT run directory is a Hugging Face model
    assert (runs / "sft_digits" / "config.json").is_file()
    from_sft = yaml.safe_load((runs / "grpo_from_sft" / "config.yaml").read_text())
    assert Path(from_sft["actor_rollout_ref"]["model"]["path"]).name == "sft_digits"
    assert metrics(runs / "grpo_from_sft")[-1]["step"] >= 1
    check_distillation(runs)
    # print(result.run_dir, ...["critic/score/mean"])
    run_dir, score = snippet_output.split()[-2:]
    assert Path(run_dir).name != "grpo_digits" and (clone / run_dir / "metrics.jsonl").is_file(), (
        snippet_output
    )
    assert 0.0 <= float(score) <= 1.0


def check_distillation(runs: Path) -> None:
    """The section says distill/reverse_kl falls (and with gkd the JSD): first steps, last."""
    for name, key in (("distill_digits", "distill/reverse_kl"), ("gkd_digits", "distill/gkd_loss")):
        values = [m[key] for m in metrics(runs / name) if key in m]
        assert len(values) == 30 and sum(values[-5:]) < sum(values[:5]) * 0.8, (name, values)
