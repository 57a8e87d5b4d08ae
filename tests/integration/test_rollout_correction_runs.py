"""verl's rollout correction through a whole run on CPU: bypass mode saves the old-log-prob pass,
IS weights reach the policy loss, rejected tokens leave it, and a run that rejects most tokens
says so. On CPU in float32 the native engine samples with the trainer's own log-probs (gap about
1e-8), so bypass mode must train exactly like the recomputed pass."""

import copy
import dataclasses
import logging
import math
from pathlib import Path

import pytest
import torch

from test_train_cli import read_metrics, weights


def run(tiny_config, name: str, **correction):
    from keel.api import train

    cfg = copy.deepcopy(tiny_config)
    cfg["algorithm"]["rollout_correction"] = correction
    cfg["trainer"]["default_local_dir"] += f"_{name}"
    result = train(cfg)
    return result, [m for m in read_metrics(result.run_dir) if m["step"] > 0]


def final_weights(result) -> dict[str, torch.Tensor]:
    return weights(sorted(Path(result.run_dir).glob("global_step_*"))[-1] / "actor")


@pytest.fixture
def baseline(tiny_config):
    return run(tiny_config, "plain")


def test_bypass_mode_skips_the_pass_and_trains_as_it_would(tiny_config, baseline):
    plain, plain_metrics = baseline
    bypass, ours = run(tiny_config, "bypass", bypass_mode=True)
    assert all("timing_s/old_log_prob" not in m for m in ours)
    assert all("timing_s/old_log_prob" in m for m in plain_metrics)
    for a, b in zip(ours, plain_metrics):
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "critic/score/mean"):
            assert a[key] == pytest.approx(b[key], rel=1e-4, abs=1e-6), key
        # measured on the first mini-batch's forward; on CPU the engine can agree with it exactly
        # (0.0)
        assert 0 <= a["rollout/log_prob_gap"] < 1e-5
        assert "rollout_corr/kl" in a
    for name, tensor in final_weights(bypass).items():
        torch.testing.assert_close(tensor, final_weights(plain)[name], rtol=1e-5, atol=1e-6)


def test_is_weights_reach_the_policy_loss(tiny_config, baseline):
    """Ratios of 1 truncated at 0.001: every weight is 0.001, so the first mini-batch's loss and
    gradient are the uncorrected ones times 0.001 (Adam's step barely notices the scale)."""
    _, plain_metrics = baseline
    _, ours = run(tiny_config, "tis", rollout_is="token", rollout_is_threshold=0.001)
    first, plain_first = ours[0], plain_metrics[0]
    # before truncation
    assert first["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=1e-4)
    assert first["rollout_corr/rollout_is_ratio_fraction_high"] == 1.0
    assert first["actor/grad_norm"] == pytest.approx(
        0.001 * plain_first["actor/grad_norm"], rel=0.05
    )
    assert first["actor/pg_loss"] == pytest.approx(
        0.001 * plain_first["actor/pg_loss"], rel=0.05, abs=1e-7
    )


@pytest.mark.parametrize("mode", [{}, {"bypass_mode": True}])
def test_rejected_tokens_leave_the_losses_and_the_run_says_so(tiny_config, caplog, mode):
    """A band of ratios [1.5, 2] that ratios of 1 never reach: every token is rejected, the loss
    is 0, the weights never move, and each step warns (printed once, then counted); once per batch
    (decoupled) or per micro-batch against the current policy (bypass)."""
    caplog.set_level(logging.WARNING, logger="keel")
    result, ours = run(
        tiny_config, "reject", rollout_rs="token_k1", rollout_rs_threshold="1.5_2.0", **mode
    )
    assert all(
        m["rollout_corr/rollout_rs_masked_fraction"] == 1.0 and m["actor/pg_loss"] == 0.0
        for m in ours
    )
    start = weights(Path(tiny_config["actor_rollout_ref"]["model"]["path"]))
    for name, tensor in final_weights(result).items():
        torch.testing.assert_close(tensor, start[name])
    assert (
        sum("rejection dropped 100% of the tokens" in r.getMessage() for r in caplog.records) == 1
    )
    assert [m["guards/warned_steps/rollout_rejection"] for m in ours] == [
        float(i + 1) for i in range(len(ours))
    ]


def test_bypass_reinforce_weights_minus_a_log_pi(tiny_config):
    """bypass_pg_is: -A log pi with sequence weights pi / pi_rollout, truncated. Truncated at 0.001
    the first mini-batch's gradient is REINFORCE's (gpg's) times 0.001."""
    _, reinforce = run(tiny_config, "pg", bypass_mode=True, loss_type="reinforce")
    _, weighted = run(
        tiny_config,
        "pg_is",
        bypass_mode=True,
        loss_type="reinforce",
        rollout_is="sequence",
        rollout_is_threshold=0.001,
    )
    tiny_config["actor_rollout_ref"]["actor"]["policy_loss"] = {"loss_mode": "gpg"}
    _, gpg = run(tiny_config, "gpg")
    assert reinforce[0]["actor/grad_norm"] == pytest.approx(gpg[0]["actor/grad_norm"], rel=1e-4)
    assert weighted[0]["actor/grad_norm"] == pytest.approx(
        0.001 * gpg[0]["actor/grad_norm"], rel=0.05
    )
    assert weighted[0]["rollout_corr/rollout_is_ratio_fraction_high"] > 0.5


def sampler_changed(monkeypatch, change) -> None:
    """The engine's log-probs, changed by `change(batch)` -> the batch after each generation: a
    sampler that disagrees with the trainer on purpose."""
    from keel.trainer.generation import Generation

    generate = Generation.generate

    def changed(self, prompts, params, seed, on_finished=None):
        batch, timing = generate(self, prompts, params, seed, on_finished)
        return change(batch), timing

    monkeypatch.setattr(Generation, "generate", changed)


@pytest.mark.parametrize(
    "mode", [{"rollout_is": "token", "rollout_is_threshold": 10.0}, {"bypass_mode": True}]
)
def test_the_ratio_is_the_trainers_over_the_samplers(tiny_config, monkeypatch, mode):
    """A sampler 0.3 nats less sure of each token than the trainer: pi_train / pi_rollout = e^0.3,
    KL(rollout || train) per token -0.3, whichever mode computes it."""

    def less_sure(batch):
        return dataclasses.replace(batch, sampling_log_probs=batch.sampling_log_probs - 0.3)

    sampler_changed(monkeypatch, less_sure)
    # a gap of 0.3 is this test's own doing
    tiny_config["trainer"]["guards"] = {"max_log_prob_gap": 1.0}
    _, ours = run(tiny_config, "offset", **mode)
    for m in ours:
        assert m["rollout/log_prob_gap"] == pytest.approx(0.3, abs=1e-3)
        assert m["rollout_corr/kl"] == pytest.approx(
            -0.3, abs=0.02 if "bypass_mode" in mode else 1e-4
        )
    if "rollout_is" in mode:
        assert ours[0]["rollout_corr/rollout_is_mean"] == pytest.approx(math.exp(0.3), rel=1e-3)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_a_nan_from_the_sampler_stops_or_skips_the_step_by_name(tiny_config, monkeypatch, policy):
    """Bypass mode trains on the sampler's log-probs: a nan among them is caught where they enter,
    named, under trainer.guards.nonfinite."""
    from keel.errors import KeelError

    def one_nan(batch):
        batch.sampling_log_probs[0, 0] = float("nan")
        return batch

    sampler_changed(monkeypatch, one_nan)
    tiny_config["trainer"]["guards"] = {"nonfinite": policy}
    if policy == "stop":
        with pytest.raises(KeelError, match="sampler log-probs: 1 of"):
            run(tiny_config, "nan", bypass_mode=True)
    else:
        _, ours = run(tiny_config, "nan", bypass_mode=True)
        assert ours[-1]["guards/skipped_steps"] == 2
