"""The README's quick-start on the GPU, as a user runs it there: its GRPO, SFT and distillation
commands, read from README.md, in a copy of examples/. Before keel kept attention off cuDNN's
kernels, GRPO stopped at step 2 with a NaN gradient on an H100 (pytorch#196678)."""

import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

ROOT = Path(__file__).parents[2]
# the quick-start's commands a distillation user goes through (GRPO only as first written)
WANTED = (
    r"python examples/quickstart/prepare\.py",
    r"keel train examples/quickstart/grpo\.yaml",
    r"keel sft examples/quickstart/sft\.yaml",
    r"keel train examples/quickstart/distill\.yaml.*",
)


def readme_commands() -> list[str]:
    """The "Your own run" section's prepare, GRPO (without overrides), SFT and distillation
    commands, continuation lines joined, comments dropped."""
    readme = (ROOT / "README.md").read_text()
    own_run = readme.split("\n## Your own run\n", 1)[1].split("\n## ", 1)[0]
    code = "\n".join(re.findall(r"^```bash\n(.*?)^```", own_run, re.S | re.M))
    lines = [line.split("#")[0].strip() for line in code.replace("\\\n", " ").splitlines()]
    return [line for line in lines if any(re.fullmatch(w, line) for w in WANTED)]


def metric(run_dir: Path, key: str) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    return [r[key] for r in records if key in r]


def test_attention_backward_is_finite_where_cudnn_gives_nan():
    """pytorch#196678's shapes (length 64 more than a multiple of 128, a mask, logsumexp below
    -88.7) under keel's autocast: dQ is finite."""
    from keel.models.load import autocast

    torch.manual_seed(0)
    length, dim = 704, 64
    q = torch.randn(1, 1, length, dim, device="cuda") * 0.1
    k = torch.randn(1, 1, length, dim, device="cuda") * 0.1
    v = torch.randn(1, 1, length, dim, device="cuda")
    q[..., 0], k[..., 0] = 1.0, -120 * math.sqrt(dim)
    q, k, v = (t.bfloat16().requires_grad_() for t in (q, k, v))
    mask = torch.ones(length, length, dtype=torch.bool, device="cuda").tril()[None, None]
    with autocast(torch.device("cuda"), torch.bfloat16):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.backward(torch.randn_like(out))
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


def test_the_readme_quickstart_trains_and_distils_on_the_gpu(tmp_path):
    commands = readme_commands()
    assert [sum(bool(re.fullmatch(w, c)) for c in commands) for w in WANTED] == [1, 1, 1, 2]
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for command in commands:
        program, *args = command.split()
        argv = (
            [sys.executable, *args]
            if program == "python"
            else [sys.executable, "-m", program, *args]
        )
        done = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True)
        output = done.stdout + done.stderr
        assert done.returncode == 0, f"{command}\n{output[-3000:]}"
        if args[0] == "train":
            assert "decided for you: cuda" in output, output[-2000:]
    runs = tmp_path / "checkpoints" / "quickstart"
    scores = metric(runs / "grpo_digits", "critic/score/mean")
    assert len(scores) == 30 and scores[-1] > scores[0] + 0.5, scores
    for name, key in (("distill_digits", "distill/reverse_kl"), ("gkd_digits", "distill/gkd_loss")):
        values = metric(runs / name, key)
        assert len(values) == 30 and sum(values[-5:]) < sum(values[:5]) * 0.8, (name, values)
