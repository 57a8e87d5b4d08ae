"""optimizer_offload on a GPU: the moments wait in pinned CPU memory and the device holds one
bucket of them during the step; the weights are fused AdamW's exactly. Run on the GPU machine."""

import pytest
import torch

from keel.training.optim import OffloadedAdamW

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_the_device_holds_one_bucket_of_moments_and_the_steps_are_fused_adamws():
    generator = torch.Generator(device="cuda").manual_seed(0)
    # 4 MiB each, 64 MiB in all
    shapes = [(1024, 1024)] * 16
    plain = [torch.nn.Parameter(torch.randn(s, device="cuda", generator=generator)) for s in shapes]
    offloaded = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    reference = torch.optim.AdamW(plain, lr=1e-2, fused=True)
    # two parameters' moments
    bucket = 2 * 4 * 1024 * 1024 * 2
    optimizer = OffloadedAdamW(offloaded, bucket_bytes=bucket, lr=1e-2, fused=True)
    for step in range(3):
        for p, q in zip(plain, offloaded):
            p.grad = torch.randn(p.shape, device="cuda", generator=generator)
            q.grad = p.grad.clone()
        reference.step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        optimizer.step()
        peak = torch.cuda.max_memory_allocated() - before
        assert peak <= 2 * bucket, (
            f"step {step}: {peak / 2**20:.0f} MiB on the device beyond weights and grads"
        )
    for p, q in zip(plain, offloaded):
        assert torch.equal(p, q)
    moments = [state["exp_avg"] for state in optimizer.state.values()]
    assert all(m.device.type == "cpu" and m.is_pinned() for m in moments)
