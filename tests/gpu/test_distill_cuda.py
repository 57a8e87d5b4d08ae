"""On-policy distillation on the GPU: a wider random teacher in bf16 scores a tiny student's
samples; the student learns towards it in both modes, and the teacher's pass gives a plain
forward's log-probs."""

import json
import math
from pathlib import Path

import pytest
import torch

from keel.models.tiny import make_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

# the student's sampling temperature, which the teacher scores at too
TEMPERATURE = 0.7


def make_teacher(out_dir: Path) -> Path:
    """A random teacher four times the student's width (the student: hidden 32, 2 layers) sharing
    its tokenizer, which puts most of its mass on the ten digits whatever the context: their
    (tied) embeddings along the direction its last hidden states share. A near-uniform student is
    far from it, and can close that distance in a few steps by writing digits."""
    from keel.models.load import load_causal_lm, load_tokenizer

    make_tiny_model(out_dir, seed=1, hidden_size=128, num_layers=2, num_heads=4)
    tokenizer = load_tokenizer(out_dir)
    model = load_causal_lm(out_dir, torch.device("cpu"))
    ids = tokenizer("Digits please: 1 2 3 4", return_tensors="pt").input_ids
    digits = tokenizer.convert_tokens_to_ids(list("0123456789"))
    with torch.no_grad():
        direction = model.model(ids).last_hidden_state[0].mean(0)
        model.get_output_embeddings().weight[digits] = 2.0 * direction / direction.norm()
    model.save_pretrained(out_dir)
    return out_dir


def distill_config(
    tiny_config: dict, teacher: Path, mode: str, steps: int, device: str, dtype: str = "bfloat16"
) -> dict:
    tiny_config["distillation"] = {
        "enable": True,
        "mode": mode,
        "teacher": {"path": str(teacher), "dtype": dtype},
    }
    tiny_config["actor_rollout_ref"]["rollout"]["temperature"] = TEMPERATURE
    # on CPU (a float32 student) distill/reverse_kl falls from about 9 to 0.2 within 15 steps
    tiny_config["actor_rollout_ref"]["actor"]["optim"]["lr"] = 1e-2
    tiny_config["trainer"].update(total_training_steps=steps, test_freq=-1, device=device)
    return tiny_config


def reverse_kl_of_each_step(config: dict) -> list[float]:
    from keel.api import train

    result = train(config)
    records = [
        json.loads(line) for line in (result.run_dir / "metrics.jsonl").read_text().splitlines()
    ]
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    return [r["distill/reverse_kl"] for r in records if "distill/reverse_kl" in r]


@pytest.mark.parametrize(
    "mode,dtype", [("reverse_kl", "bfloat16"), ("gkd", "bfloat16"), ("reverse_kl", "float8")]
)
def test_a_wider_teacher_distils_into_the_student(mode, dtype, tiny_config, tmp_path):
    """20 steps: the student's samples grow likelier under the teacher, so KL(student || teacher)
    on them falls (the first five steps' mean against the last five's)."""
    teacher = make_teacher(tmp_path / "teacher")
    kl = reverse_kl_of_each_step(distill_config(tiny_config, teacher, mode, 20, "cuda", dtype))
    assert len(kl) == 20
    first, last = sum(kl[:5]) / 5, sum(kl[-5:]) / 5
    assert first > 1 and last < 0.5 * first


def teacher_pass_and_plain_forward(
    tiny_config, tmp_path, monkeypatch, device: str, dtype: str = "bfloat16"
):
    """One distillation step on `device`: the teacher's log-probs of the sampled tokens as keel's
    pass gave them, and a plain float32 transformers forward's log_softmax at the same tokens, one
    unpadded sequence at a time; each [N, R], 0 past a response."""
    from transformers import AutoModelForCausalLM

    from keel.api import train
    from keel.trainer.train_batch import TrainBatchBuilder

    batches, build = [], TrainBatchBuilder.train_batch

    def kept(builder, scored, old, at):
        batches.append(build(builder, scored, old, at))
        return batches[-1]

    monkeypatch.setattr(TrainBatchBuilder, "train_batch", kept)
    teacher = make_teacher(tmp_path / "teacher")
    train(distill_config(tiny_config, teacher, "reverse_kl", 1, device, dtype))
    batch = batches[0]
    model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).to(device)
    plain = torch.zeros_like(batch.teacher_log_probs)
    with torch.no_grad():
        for i in range(len(batch)):
            prompt = batch.prompt_ids[i][batch.prompt_mask[i].bool()]
            length = int(batch.response_mask[i].sum())
            response = batch.response_ids[i][:length]
            ids = torch.cat([prompt, response])[None].to(device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / TEMPERATURE
            plain[i, :length] = (
                logits.log_softmax(-1).gather(-1, response[:, None].to(device))[:, 0].cpu()
            )
    return batch.teacher_log_probs * batch.response_mask, plain


def test_the_teachers_log_probs_are_a_plain_forwards_in_bf16(tiny_config, tmp_path, monkeypatch):
    keel_pass, plain = teacher_pass_and_plain_forward(tiny_config, tmp_path, monkeypatch, "cuda")
    # the teacher's bf16 weights and matmuls against float32 (on CPU: at most 0.07 per token, at
    # log-probs about -14)
    torch.testing.assert_close(keel_pass, plain, atol=0.1, rtol=0.02)
    # and no systematic shift
    assert abs(float((keel_pass - plain).mean())) < 0.05


def test_a_float8_teachers_log_probs_are_near_a_plain_forwards(tiny_config, tmp_path, monkeypatch):
    """keel's float8 decoder layers (3 mantissa bits, a scale per row) against float32: a
    coarser score than bf16's, unbiased."""
    keel_pass, plain = teacher_pass_and_plain_forward(
        tiny_config, tmp_path, monkeypatch, "cuda", "float8"
    )
    error = (keel_pass - plain).abs()
    shift = float((keel_pass - plain).mean())
    print(f"float8 teacher: max error {float(error.max()):.3f}, mean {float(error.mean()):.4f}")
    torch.testing.assert_close(keel_pass, plain, atol=0.5, rtol=0.05)
    assert abs(shift) < 0.1, shift
