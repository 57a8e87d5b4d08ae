"""Tiny models and the critic: what tests, examples and the demo are built on."""

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from keel.models.load import load_critic
from keel.models.tiny import make_tiny_model


@pytest.mark.parametrize(
    "arch, expected_class",
    [
        ("qwen2", "Qwen2ForCausalLM"),
        ("llama", "LlamaForCausalLM"),
        ("qwen3", "Qwen3ForCausalLM"),
        ("qwen3_moe", "Qwen3MoeForCausalLM"),
        ("gemma3_text", "Gemma3ForCausalLM"),
        ("phi3", "Phi3ForCausalLM"),
    ],
)
def test_tiny_model_loads_like_any_hugging_face_checkpoint(arch, expected_class, tmp_path):
    path = make_tiny_model(tmp_path / arch, arch=arch, hidden_size=32)
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == expected_class
    assert model.get_input_embeddings().num_embeddings >= len(tokenizer)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "12+5"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    # lossless round trip
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token_id is not None


def test_critic_gives_one_value_per_token(tiny_assets):
    critic = load_critic(tiny_assets["model"], torch.device("cpu"))
    ids = torch.tensor([[5, 6, 7], [8, 9, 10]])
    mask = torch.ones_like(ids)
    values = critic(ids, mask, torch.arange(3).expand(2, 3))
    assert values.shape == (2, 3)
    values.sum().backward()
    assert critic.value_head.weight.grad is not None
    assert any(p.grad is not None for p in critic.backbone.parameters())


def test_weight_headers_catch_every_broken_file(tmp_path, tiny_assets):
    """A truncated file, a header of garbage, an index naming a file that is not there: each a
    coded error before anything loads, never a SafetensorError."""
    import json
    import shutil

    from keel.errors import WEIGHTS_BROKEN, KeelError
    from keel.models.load import weight_file_shapes

    # the intact model: every tensor's shape
    assert weight_file_shapes(tiny_assets["model"])
    cases = {
        "truncated": lambda d: (d / "model.safetensors").write_bytes(
            (d / "model.safetensors").read_bytes()[:-100]
        ),
        "no header": lambda d: (d / "model.safetensors").write_bytes(b"\xff" * 64),
        "empty": lambda d: (d / "model.safetensors").write_bytes(b""),
        "missing shard": lambda d: (d / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"a": "model-00002-of-00002.safetensors"}})
        ),
        "broken index": lambda d: (d / "model.safetensors.index.json").write_text("{"),
    }
    for name, damage in cases.items():
        model = tmp_path / name.replace(" ", "_")
        shutil.copytree(tiny_assets["model"], model)
        damage(model)
        with pytest.raises(KeelError) as info:
            weight_file_shapes(model)
        assert info.value.code == WEIGHTS_BROKEN, name


def test_a_random_weights_directory_builds_the_same_model_every_time(tmp_path):
    """keel bench's directories for shapes too large to save: config.json and a seed, weights drawn
    on the device at load, identical on every load (the reference equals the policy)."""
    import json

    from transformers import Qwen2Config

    from keel.models.load import RANDOM_WEIGHTS, load_causal_lm

    Qwen2Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=300,
    ).save_pretrained(tmp_path)
    (tmp_path / RANDOM_WEIGHTS).write_text(json.dumps({"seed": 3}))
    first, second = (load_causal_lm(tmp_path, torch.device("cpu")) for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(first.parameters(), second.parameters()))
    assert (
        first.model.layers[1].mlp.up_proj.weight.std() > 0
        and next(first.parameters()).dtype == torch.float32
    )


def test_lora_on_a_mixture_of_experts_names_what_stays_frozen_and_refuses_experts_as_targets():
    """On a mixture keel adapts the attention: all-linear says the experts, router and dense MLPs
    stay frozen; naming them is refused with the fix, not 'not found'."""
    from keel.errors import LORA_TARGETS, KeelError
    from keel.models.load import meta_model
    from keel.models.lora import plan_lora
    from keel.models.tiny import build_model_config

    model = meta_model(build_model_config("qwen3_moe"))
    plan = plan_lora(model, 8, ["all-linear"], [], [], "actor_rollout_ref.model")
    assert plan.targets == ("k_proj", "o_proj", "q_proj", "v_proj")
    assert {"experts", "gate", "gate_proj"} <= set(
        plan.frozen_other
    ) and "experts" in plan.summary()
    # the router and experts are not linear layers; peft would put gate_proj's adapters on the
    # experts
    for named, why in (
        (["experts"], "not linear layers"),
        (["q_proj", "gate"], "not linear layers"),
        (["q_proj", "gate_proj"], "stacked experts"),
    ):
        with pytest.raises(KeelError) as refused:
            plan_lora(model, 8, named, [], [], "actor_rollout_ref.model")
        assert refused.value.code == LORA_TARGETS and why in refused.value.message
        assert "target_modules=all-linear" in refused.value.fix


def test_every_family_record_builds_a_tiny_model_of_each_of_its_tiny_types():
    """A family's facts record (models/families.py) is where its tiny config lives: each tiny type
    builds a config of that type, and a record speaks only of its own model types."""
    from keel.models.families import RECORDS, tiny_model_types
    from keel.models.tiny import build_model_config

    for facts in RECORDS:
        assert set(facts.tiny_fields) <= facts.model_types
        assert facts.plain_lm_head <= facts.model_types
    assert set(tiny_model_types()) >= {"qwen2", "llama", "qwen3_moe", "gemma3_text", "gpt_oss"}
    for model_type in tiny_model_types():
        assert build_model_config(model_type, num_layers=4).model_type == model_type
    with pytest.raises(ValueError, match="unknown tiny architecture"):
        build_model_config("mistral")


def test_active_parameters_leave_out_the_unrouted_experts():
    """Qwen3-30B-A3B passes a token through 3.35B of its 30.5B parameters; GPT-OSS-20B through 4.19B
    of 20.9B (its 3.6B active, plus the 0.58B output head OpenAI's count leaves out); a dense model
    through all of them."""
    from keel.bench.workloads import shape_config
    from keel.models.families import active_parameters
    from keel.models.load import meta_model

    for shape, total, active in (
        ("qwen3-30b-a3b", 30.53, 3.35),
        ("gpt-oss-20b", 20.91, 4.19),
        ("qwen3-0.6b", 0.60, 0.60),
    ):
        config = shape_config(shape)
        parameters = sum(p.numel() for p in meta_model(config).parameters())
        assert round(parameters / 1e9, 2) == total
        assert round(active_parameters(config, parameters) / 1e9, 2) == active


def test_a_mixture_no_family_knows_is_counted_by_its_experts():
    """Qwen2-MoE has no native family: its unrouted experts are still left out of the count the
    benchmark's MFU reads (2 of 8 experts routed, in each of 2 layers)."""
    from transformers import Qwen2MoeConfig

    from keel.models.families import active_parameters

    config = Qwen2MoeConfig(
        hidden_size=64,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        decoder_sparse_step=1,
    )
    # 6 unrouted experts a layer, each gate, up and down projections of 64 x 32
    assert active_parameters(config, 10**6) == 10**6 - 2 * 6 * 3 * 64 * 32
