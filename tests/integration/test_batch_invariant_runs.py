"""rollout.batch_invariant in `keel train` (bf16 compute on CPU): every step's sampler/trainer
log-prob gap is exactly 0 (the old-log-prob pass is the engine's prefill in the sampler's
arithmetic, over every sample, the first mini-batch's too), where without it the gap is
rounding's; keel check says what it does;
settings it cannot run with are refused with KEEL-C030 and the fix."""

import copy
import json

import pytest

from keel.api import train
from keel.check.preflight import run_checks
from keel.config.load import load_run
from keel.errors import BATCH_INVARIANT_UNSUPPORTED, KeelError

KEY = "actor_rollout_ref.rollout.batch_invariant"


def metrics_of(run_dir) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [m for m in map(json.loads, lines) if m.get("step", 0) > 0]


@pytest.fixture
def peaked_model(tmp_path_factory):
    """A tiny model with weights wide enough for peaked distributions: the default small init
    gives near-uniform ones, whose log-probs round alike whatever the arithmetic."""
    from keel.models.tiny import make_tiny_model

    root = tmp_path_factory.mktemp("peaked")
    return make_tiny_model(root, hidden_size=64, num_layers=2, initializer_range=0.2)


def invariant_config(tiny_config, on: bool, model=None) -> dict:
    cfg = copy.deepcopy(tiny_config)
    cfg["actor_rollout_ref"]["rollout"]["batch_invariant"] = on
    if model is not None:
        cfg["actor_rollout_ref"]["model"]["path"] = str(model)
    # bf16 compute, as on a GPU: in float32 this tiny model's gap is already about 0
    cfg["actor_rollout_ref"]["model"]["dtype"] = "bfloat16"
    run_dir = f"{cfg['trainer']['default_local_dir']}_{'on' if on else 'off'}"
    cfg["trainer"] |= {"test_freq": -1, "default_local_dir": run_dir}
    return cfg


def test_the_log_prob_gap_is_exactly_zero_every_step(tiny_config, peaked_model):
    steps = metrics_of(train(invariant_config(tiny_config, True, peaked_model)).run_dir)
    assert [m["rollout/log_prob_gap"] for m in steps] == [0.0, 0.0]
    # every sample's old log-probs are the pass's (4 prompts x 4 samples)
    assert all(m["perf/old_log_prob_samples"] == 16 for m in steps)
    # and the training still learns from them
    assert all(m["actor/pg_clipfrac"] >= 0 and m["timing_s/update_actor"] > 0 for m in steps)
    plain = metrics_of(train(invariant_config(tiny_config, False, peaked_model)).run_dir)
    assert plain[0]["rollout/log_prob_gap"] > 0


def test_keel_check_says_what_it_does(tiny_config):
    report = run_checks(*load_run(invariant_config(tiny_config, True)))
    line = next(f for f in report.findings if f.check == "rollout engine")
    assert "batch-invariant" in line.message and "bit for bit" in line.message
    assert "bypass_mode=true skips it" in line.message
    cfg = invariant_config(tiny_config, True)
    cfg["algorithm"] = {**cfg.get("algorithm", {}), "rollout_correction": {"bypass_mode": True}}
    line = next(f for f in run_checks(*load_run(cfg)).findings if f.check == "rollout engine")
    assert "skips it" not in line.message


def test_in_bypass_mode_the_sampler_s_bits_are_the_old_log_probs_and_no_pass_runs(
    tiny_config, peaked_model
):
    """The fast way to run it: the pass would recompute the sampler's log-probs bit for bit, so
    bypass mode takes them and skips it; the gap is then the sampler's against the update's own
    forward, which is not batch-invariant."""
    cfg = invariant_config(tiny_config, True, peaked_model)
    cfg["algorithm"] = {**cfg.get("algorithm", {}), "rollout_correction": {"bypass_mode": True}}
    steps = metrics_of(train(cfg).run_dir)
    assert all("perf/old_log_prob_samples" not in m for m in steps)
    assert all("timing_s/old_log_prob" not in m for m in steps)
    assert all(m["rollout/log_prob_gap"] > 0 for m in steps)


@pytest.mark.parametrize(
    "setting, why",
    [
        ({"rollout": {"name": "hf"}}, "rollout.name=hf"),
        ({"hybrid_engine": False}, "hybrid_engine=false"),
    ],
)
def test_settings_it_cannot_run_with_are_refused_with_the_fix(tiny_config, setting, why):
    cfg = invariant_config(tiny_config, True)
    for key, value in setting.items():
        if isinstance(value, dict):
            cfg["actor_rollout_ref"][key] |= value
        else:
            cfg["actor_rollout_ref"][key] = value
    with pytest.raises(KeelError) as raised:
        train(cfg)
    assert raised.value.code == BATCH_INVARIANT_UNSUPPORTED
    assert why in raised.value.message and f"{KEY}=false" in raised.value.fix


def test_a_model_it_does_not_cover_is_refused_naming_why(tiny_config, tmp_path):
    from keel.models.tiny import make_tiny_model

    cfg = invariant_config(tiny_config, True)
    cfg["actor_rollout_ref"]["model"]["path"] = str(
        make_tiny_model(tmp_path / "gemma", arch="gemma3_text", hidden_size=64, num_layers=2)
    )
    report = run_checks(*load_run(cfg))
    (failed,) = report.failures
    assert failed.code == BATCH_INVARIANT_UNSUPPORTED and "sliding-window" in failed.message
    assert f"{KEY}=false" in failed.fix
