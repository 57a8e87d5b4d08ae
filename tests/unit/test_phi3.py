"""Phi-3 (model_type phi3): what keel check says of a checkpoint transformers wrote, which of its
configs the native engine refuses, and the trainer's chunked lm_head path on it. Its greedy tokens
against transformers' are a row of test_native_rollout.py's family lists."""

import pytest
import torch

from keel.check.findings import FAIL, WARN
from keel.check.preflight import run_checks
from keel.config.load import load_run
from keel.errors import INCOMPATIBLE_OPTIONS, WEIGHTS_BROKEN, KeelError


def phi3_model(path, **config_overrides):
    """A tiny Phi-3 written by transformers' save_pretrained, with keel's tokenizer; untied, as the
    released checkpoints are."""
    from keel.models.tiny import make_tiny_model

    return make_tiny_model(path, arch="phi3", tie_word_embeddings=False, **config_overrides)


# full fine-tuning, and LoRA on every linear layer (its fused projections among them)
@pytest.mark.parametrize("lora", [{}, {"actor_rollout_ref.model.lora_rank": 8}])
def test_a_transformers_written_phi3_passes_keel_check_on_the_native_engine(
    tiny_config, tmp_path, lora
):
    """Its fused qkv_proj and gate_up_proj are the architecture's own names: the weights check
    finds every tensor in its shape, LoRA's plan finds every linear layer, and native runs it."""
    model = phi3_model(tmp_path / "phi3")
    overrides = {
        "actor_rollout_ref.model.path": str(model),
        "actor_rollout_ref.rollout.name": "native",
        **lora,
    }
    report = run_checks(*load_run(tiny_config, overrides))
    assert [f for f in report.findings if f.level == FAIL] == []
    assert not [
        f
        for f in report.findings
        if f.level == WARN and (f.check == "model" or f.code == WEIGHTS_BROKEN)
    ]
    [weights] = [f for f in report.findings if f.check == "model" and "tensors" in f.message]
    assert "shapes match the config" in weights.message
    [engine] = [f for f in report.findings if f.check == "rollout engine"]
    assert engine.message.startswith("native")


def longrope(config):
    """Phi-3-mini-128k's rope: short and long factors, one per rotated pair of a head."""
    pairs = config.hidden_size // config.num_attention_heads // 2
    config.max_position_embeddings = 4 * config.original_max_position_embeddings
    config.rope_parameters = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * pairs,
        "long_factor": [2.0] * pairs,
        "original_max_position_embeddings": config.original_max_position_embeddings,
    }
    return config


def partial_rotary(config):
    config.rope_parameters = {**config.rope_parameters, "partial_rotary_factor": 0.5}
    return config


@pytest.mark.parametrize(
    "change, reason",
    [(longrope, "longrope rotary embeddings"), (partial_rotary, "partial_rotary_factor 0.5")],
)
def test_phi3_configs_native_cannot_run_fall_back_to_hf_with_the_reason(change, reason):
    """Longrope (its frequencies switch with each batch's longest sequence) and a partial rotary
    factor are refused: auto takes hf and says why, and native named for them is an error."""
    from keel.models.tiny import build_model_config
    from keel.rollout.select import engine_for

    plain = build_model_config("phi3")
    assert engine_for("auto", plain) == ("native", None)
    config = change(build_model_config("phi3"))
    engine, why = engine_for("auto", config)
    assert engine == "hf" and reason in why
    with pytest.raises(KeelError) as refused:
        engine_for("native", config)
    assert refused.value.code == INCOMPATIBLE_OPTIONS and reason in refused.value.message


def test_phi3s_chunked_lm_head_path_equals_transformers_own_head(tmp_path):
    """Phi-3 takes the trainer's chunked lm_head path (its logits are lm_head of the final hidden
    state, unscaled): log-probs, entropies and gradients equal those of transformers' own head
    through logits_to_keep."""
    import copy

    from keel.data.prompts import build_prompt_dataset, collate_prompts
    from keel.models.load import load_causal_lm, load_tokenizer
    from keel.rollout.hf import HFRolloutEngine
    from keel.training import forward
    from keel.types import SamplingParams

    model_dir = phi3_model(tmp_path / "phi3", hidden_size=64, num_layers=2)
    tokenizer = load_tokenizer(model_dir)
    model = load_causal_lm(model_dir, torch.device("cpu"))
    rows = [{"prompt": "Digits please: 1"}, {"prompt": "a longer prompt, past the window of 16"}]
    records, _ = build_prompt_dataset(rows, tokenizer, max_prompt_length=64)
    prompts = collate_prompts(records, tokenizer.pad_token_id).repeat_interleave(2)
    torch.manual_seed(0)
    batch = HFRolloutEngine(model, tokenizer, max_num_seqs=4).generate(
        prompts, SamplingParams(temperature=0.9, max_new_tokens=6)
    )
    assert "phi3" in forward.PLAIN_LM_HEAD
    results = []
    # chunked, then transformers' head
    for plain in (forward.PLAIN_LM_HEAD, set()):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(forward, "PLAIN_LM_HEAD", plain)
            trained = copy.deepcopy(model)
            log_probs, entropy = forward.response_log_probs(
                trained, batch, 0.9, with_entropy=True, entropy_grad=True
            )
            ((log_probs * batch.response_mask).sum() + entropy.sum() * 0.1).backward()
        grads = [p.grad.clone() for p in trained.parameters()]
        results.append((log_probs.detach(), entropy.detach(), grads))
    (lp_a, ent_a, grads_a), (lp_b, ent_b, grads_b) = results
    torch.testing.assert_close(lp_a, lp_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(ent_a, ent_b, atol=1e-5, rtol=0)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(grads_a, grads_b))
