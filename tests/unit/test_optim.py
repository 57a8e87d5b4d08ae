"""fsdp_config.optimizer_offload's AdamW: the moments in CPU memory between steps, stepped a bucket
of parameters at a time, with AdamW's arithmetic exactly and a state that saves and resumes."""

import copy

import torch

from keel.training.optim import OffloadedAdamW


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(shape, generator=generator))
        for shape in [(64, 32), (32,), (128, 16), (7,)]
    ]


def take_steps(optimizer, weights, steps: int, seed: int = 1) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in weights:
            p.grad = torch.randn(p.shape, generator=generator)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def test_bucketed_steps_are_adamws_steps_exactly():
    plain, offloaded = params(), params()
    reference = torch.optim.AdamW(plain, lr=1e-2, weight_decay=0.1)
    optimizer = OffloadedAdamW(offloaded, bucket_bytes=2 * 64 * 32 * 4, lr=1e-2, weight_decay=0.1)
    # several buckets, one parameter or so each
    assert len(list(optimizer._buckets([offloaded]))) >= 3
    take_steps(reference, plain, 3)
    take_steps(optimizer, offloaded, 3)
    for mine, theirs in zip(offloaded, plain):
        assert torch.equal(mine, theirs)
    # every parameter is back
    assert [group["params"] for group in optimizer.param_groups] == [offloaded]
    assert all(state["exp_avg"].device.type == "cpu" for state in optimizer.state.values())


def test_its_state_resumes_as_if_never_interrupted():
    straight, resumed = params(), params()
    optimizer = OffloadedAdamW(straight, bucket_bytes=4096, lr=1e-2)
    take_steps(optimizer, straight, 2)
    # as a checkpoint holds it: not the live tensors
    saved = copy.deepcopy(optimizer.state_dict())
    for p, q in zip(resumed, straight):
        p.data.copy_(q.data)
    again = OffloadedAdamW(resumed, bucket_bytes=4096, lr=1e-2)
    again.load_state_dict(saved)
    take_steps(optimizer, straight, 2, seed=5)
    take_steps(again, resumed, 2, seed=5)
    for p, q in zip(resumed, straight):
        assert torch.equal(p, q)
