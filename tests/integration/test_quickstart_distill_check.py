"""`keel check` on the quick-start's distillation config, as the README's steps run it: before the
SFT run that makes the teacher, it names that run; with a teacher, it shows the teacher's line and
its weights in the memory estimate."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from keel.cli import main

EXAMPLES = Path(__file__).parents[2] / "examples"
CONFIG = "examples/quickstart/distill.yaml"


def test_keel_check_on_the_quickstart_distill_config(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copytree(EXAMPLES, tmp_path / "examples")
    subprocess.run(
        [sys.executable, "examples/quickstart/prepare.py"], check=True, timeout=600, cwd=tmp_path
    )
    # the teacher is the SFT run's output, not made yet
    assert main(["check", CONFIG]) != 0
    out = capsys.readouterr().out
    assert "error[KEEL-M001]: distillation.teacher.path='checkpoints/quickstart/sft_digits'" in out
    assert "fix: run `keel sft examples/quickstart/sft.yaml`, which writes it" in out

    # the SFT run's starting model: the student's tokenizer, as the SFT output has
    teacher = "distillation.teacher.path=examples/data/model"
    assert main(["check", CONFIG, teacher, "trainer.device=cpu"]) == 0
    out = capsys.readouterr().out
    teacher_line = next(line for line in out.splitlines() if "[ok  ] teacher" in line)
    assert "examples/data/model: qwen2" in teacher_line
    assert "float32 (auto: the student's compute dtype), beside the policy" in teacher_line
    assert "the student's tokenizer" in teacher_line
    assert "teacher: its weights" in out and "counted in the total above" in out
    estimate = next(line for line in out.splitlines() if line.startswith("memory estimate"))
    assert " teacher " in estimate

    assert main(["check", CONFIG, teacher, "trainer.device=cpu", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory_gb"]
    parts = sum(value for key, value in memory.items() if key != "total")
    # each part rounded to 4 digits
    assert memory["teacher"] > 0 and memory["total"] == pytest.approx(parts, rel=1e-3)
    # the config's own gkd command checks too
    assert main(["check", CONFIG, teacher, "trainer.device=cpu", "distillation.mode=gkd"]) == 0
