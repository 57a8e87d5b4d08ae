"""The actor's update cuts each mini-batch's micro-batches while the GPU still runs the mini-batch
before it (before the host sync that ends that one, where the GPU would otherwise idle while the
host sorts, selects and trims), and that changes nothing the update computes."""

import dataclasses

import pytest
import torch

from keel.config.schema import ActorConfig, OptimConfig
from keel.models.load import load_causal_lm
from keel.models.tiny import make_tiny_model
from keel.training import actor as actor_module
from keel.training.actor import ActorTrainer
from keel.training.batching import MicroBatching, plan_minibatches
from keel.training.step import DeviceTotals

from tests_helpers import padded_batch


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("lookahead"), hidden_size=32, num_layers=2)


def update(path, monkeypatch=None):
    """One update of three mini-batches of two samples, one micro-batch each -> (its metrics, the
    weights after it, which mini-batches had been cut at each host sync)."""
    torch.manual_seed(0)
    model = load_causal_lm(path, torch.device("cpu"))
    config = ActorConfig(
        ppo_micro_batch_size_per_gpu=1, use_torch_compile=False, optim=OptimConfig(lr=1e-2)
    )
    actor = ActorTrainer(model, config, 1.0, 10, MicroBatching(8), 5)
    batch = padded_batch(model.config.vocab_size, [4, 2, 3, 4, 1, 2], [5, 3, 1, 4, 2, 3])
    advantages = torch.randn(batch.advantages.shape, generator=torch.Generator().manual_seed(1))
    batch = dataclasses.replace(batch, advantages=advantages * batch.response_mask)
    minis = plan_minibatches(batch, 2, 1, False, 0, 5)[0]
    cut_at_sync = []
    floats = DeviceTotals.floats

    def recording(totals):
        cut_at_sync.append([bool(mini._cut) for mini in minis])
        return floats(totals)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(DeviceTotals, "floats", recording)
        if monkeypatch is not None:
            monkeypatch(patch)
        metrics = actor.update(minis)
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    return metrics, weights, cut_at_sync


def test_the_next_mini_batch_is_cut_before_the_sync_that_ends_this_one(tiny_model):
    _, _, cut_at_sync = update(tiny_model)
    # at the first sync the second mini-batch is cut, the third not yet; at the second, all three
    assert cut_at_sync == [[True, True, False], [True, True, True], [True, True, True]]


def test_cutting_ahead_changes_neither_the_metrics_nor_the_weights(tiny_model):
    metrics, weights, _ = update(tiny_model)
    # each mini-batch cut at its own turn, after the previous one's sync
    plain_metrics, plain_weights, plain_cuts = update(
        tiny_model, lambda patch: patch.setattr(actor_module, "cut_ahead", lambda *_: None)
    )
    assert plain_cuts == [[True, False, False], [True, True, False], [True, True, True]]
    assert metrics == plain_metrics
    assert all(torch.equal(weights[name], plain_weights[name]) for name in weights)
    # the update moved the weights: the comparison is of something
    assert metrics["actor/grad_norm"] > 0
