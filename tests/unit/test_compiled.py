"""What torch.compile fuses on a GPU, compiled here on CPU (inductor's C++ backend) so that graph
breaks or compile errors surface in CI rather than on the GPU machine: the native engine's decode
step functions, and the training path's compiled decoder layers and vocabulary arithmetic."""

import pytest
import torch

from keel.distributed.parallelize import compile_blocks
from keel.models.load import load_causal_lm
from keel.rollout.native.layers import StepFunctions
from keel.training.forward import response_log_probs
from keel.training.placement import Placement
from keel.types import SamplingParams

from test_native_rollout import engines


# Each family's layer functions compile whole (Qwen3's per-head norms, Qwen3-MoE's routing and
# grouped matmuls, Gemma 3's windows and norms, OLMo 2's output norms, SmolLM3's NoPE layers,
# Phi-3's fused projections and window).
@pytest.mark.parametrize(
    "arch, init_std, layers",
    [
        ("qwen2", 0.2, 2),
        ("qwen3_moe", 0.5, 2),
        ("gemma3_text", 0.02, 2),
        ("olmo2", 0.1, 2),
        ("smollm3", 0.2, 4),
        ("phi3", 0.2, 2),
    ],
)
def test_compiled_decode_step_gives_the_eager_tokens(tmp_path, arch, init_std, layers):
    from keel.models.tiny import make_tiny_model

    model_dir = make_tiny_model(
        tmp_path / arch, arch=arch, hidden_size=64, num_layers=layers, seed=3
    )
    native, _, _, prompts = engines(model_dir, n=2, init_std=init_std)
    greedy = SamplingParams(do_sample=False, max_new_tokens=10, ignore_eos=True)
    eager = native.generate(prompts, greedy)
    # fullgraph=True: a graph break is an error
    native.kernels = StepFunctions(native.family, compiled=True)
    compiled = native.generate(prompts, greedy)
    assert compiled.response_ids.tolist() == eager.response_ids.tolist()
    torch.testing.assert_close(
        compiled.sampling_log_probs, eager.sampling_log_probs, atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("checkpointing", [False, True])
def test_compiled_layers_and_token_stats_match_eager_with_gradients(tiny_assets, checkpointing):
    """With and without activation checkpointing, which calls the compiled forward again in
    backward."""

    def loss_and_grads(compiled: bool):
        torch.manual_seed(0)
        model = load_causal_lm(
            tiny_assets["model"], torch.device("cpu"), gradient_checkpointing=checkpointing
        )
        if compiled:
            compile_blocks(model)
        native, _, _, prompts = engines(tiny_assets["model"], n=2)
        batch = native.generate(prompts, SamplingParams(max_new_tokens=6))
        log_probs, entropy = response_log_probs(
            model,
            batch,
            0.7,
            with_entropy=True,
            entropy_grad=True,
            plan=Placement(fused_vocab=compiled),
        )
        (log_probs.sum() + entropy.sum()).backward()
        return log_probs.detach(), {n: p.grad for n, p in model.named_parameters()}

    eager_lp, eager_grads = loss_and_grads(False)
    compiled_lp, compiled_grads = loss_and_grads(True)
    torch.testing.assert_close(compiled_lp, eager_lp, atol=1e-5, rtol=1e-5)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


def test_compiled_two_stage_sampling_matches_eager():
    from keel.rollout.native.sampling import pick_blocked

    torch.manual_seed(0)
    logits = torch.randn(8, 3000) * 3
    block_noise, inner_noise = torch.empty(8, 3).exponential_(), torch.empty(8, 1024).exponential_()
    eager = pick_blocked(logits, block_noise, inner_noise, 0.8)
    compiled = torch.compile(pick_blocked, fullgraph=True)(logits, block_noise, inner_noise, 0.8)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=0)


def test_a_mixtures_float32_experts_are_left_eager_and_its_dense_layers_compiled(tmp_path):
    """Compiled, transformers loops over float32 experts one by one (its grouped matmul takes
    bfloat16 only there): e1's update took 5.5 s. Those layers run eagerly, where it is grouped."""
    from keel.models.tiny import make_tiny_model

    model = load_causal_lm(
        make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=3), torch.device("cpu")
    )
    compile_blocks(model)
    # torch.compile replaced its forward
    compiled = ["forward" in vars(layer) for layer in model.model.layers]
    assert (
        compiled
        == [hasattr(layer.mlp, "gate_proj") for layer in model.model.layers]
        == [False, False, True]
    )
