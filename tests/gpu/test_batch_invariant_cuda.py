"""rollout.batch_invariant on one GPU (bf16): the sampler's log-probs and the old-log-prob pass
are equal bit for bit, and a `keel train` run's log_prob_gap is exactly 0 every step."""

import json

import pytest
import torch

from keel.data.prompts import build_prompt_dataset, collate_prompts
from keel.models.load import load_causal_lm, load_tokenizer
from keel.rollout.native import NativeRolloutEngine
from keel.rollout.native.scoring import score
from keel.types import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

PROMPTS = [{"prompt": "Digits please: 1"}, {"prompt": "a longer prompt here, padded out"}]


@pytest.mark.parametrize(
    "arch, temperature, top_k",
    [("qwen2", 1.0, -1), ("qwen3", 1.0, -1), ("qwen3", 0.7, -1), ("qwen3", 1.0, 5)],
)
def test_the_sampler_and_the_old_log_prob_pass_are_equal_bit_for_bit_on_the_gpu(
    tmp_path, arch, temperature, top_k
):
    """Plain sampling, a temperature (its division is where compiled and eager could differ) and
    top-k (the other picker)."""
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(tmp_path, arch=arch, hidden_size=128, num_layers=2, seed=1)
    device = torch.device("cuda")
    tokenizer, model = load_tokenizer(model_dir), load_causal_lm(model_dir, device)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn_like(p) * 0.1)
    records, _ = build_prompt_dataset(PROMPTS, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(4)
    params = SamplingParams(
        n=4, temperature=temperature, top_k=top_k, max_new_tokens=16, ignore_eos=True
    )
    gaps = {}
    for on in (True, False):
        engine = NativeRolloutEngine(
            model, tokenizer, 256, torch.bfloat16, batch_invariant=on, max_num_batched_tokens=16
        )
        torch.manual_seed(0)
        batch = engine.generate(prompts, params)
        gap = (score(engine, batch, temperature) - batch.sampling_log_probs).abs()
        gap = gap * batch.response_mask
        gaps[on] = float(gap.sum())
    assert gaps[True] == 0.0 and gaps[False] > 0, gaps


def test_a_run_on_the_gpu_has_a_log_prob_gap_of_exactly_zero(tiny_config):
    from keel.api import train

    tiny_config["actor_rollout_ref"]["rollout"]["batch_invariant"] = True
    tiny_config["trainer"] |= {"device": "cuda", "test_freq": -1}
    run_dir = train(tiny_config).run_dir
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    gaps = [m["rollout/log_prob_gap"] for m in steps if m.get("step", 0) > 0]
    assert gaps == [0.0, 0.0]
