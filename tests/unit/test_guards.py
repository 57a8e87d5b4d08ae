"""Errors raised while setting up or running a step, each with its code."""

import logging

import pytest
import torch

from keel.config.load import load_config
from keel.errors import (
    DATA_EMPTY,
    DEVICE_UNAVAILABLE,
    MODEL_PATH,
    NO_EOS,
    NO_GRADIENT,
    NONFINITE_LOSS,
    KeelError,
)
from keel.models.load import load_tokenizer
from keel.models.tiny import build_tokenizer
from keel.trainer.rl import RLTrainer
from keel.training.step import apply_gradients


def code_of(fn) -> str:
    with pytest.raises(KeelError) as info:
        fn()
    return info.value.code


def test_missing_model_path(tmp_path):
    assert code_of(lambda: load_tokenizer(tmp_path / "no_model")) == MODEL_PATH


def test_tokenizer_without_pad_gets_eos_with_a_warning(tmp_path, caplog):
    build_tokenizer(with_pad=False).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="keel"):
        tokenizer = load_tokenizer(tmp_path)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id
    assert "no pad token" in caplog.text


def test_tokenizer_without_eos_is_an_error(tmp_path):
    tokenizer = build_tokenizer()
    tokenizer.eos_token = None
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert code_of(lambda: load_tokenizer(tmp_path)) == NO_EOS


def test_dataset_smaller_than_a_batch(tiny_config, tmp_path):
    cfg = load_config(
        tiny_config,
        {
            "data.train_batch_size": 64,
            "actor_rollout_ref.actor.ppo_mini_batch_size": 64,
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": 64,
        },
    )
    assert code_of(lambda: RLTrainer(cfg)) == DATA_EMPTY
    assert not (tmp_path / "run").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_a_gpu(tiny_config):
    cfg = load_config(tiny_config, {"trainer.device": "cuda"})
    assert code_of(lambda: RLTrainer(cfg)) == DEVICE_UNAVAILABLE


# fused: the step skips itself on the device (found_inf)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradient_is_refused_and_weights_unchanged(fused, bad):
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    (model(torch.tensor([[1.0, 1.0]])).sum()).backward()
    # one good step first: Adam's state exists
    apply_gradients(model, optimizer, 1.0, "actor")
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in optimizer.state[model.weight].items()}
    (model(torch.tensor([[bad, 1.0]])).sum()).backward()
    assert code_of(lambda: apply_gradients(model, optimizer, 1.0, "actor")) == NONFINITE_LOSS
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    # step count too
    assert all(torch.equal(v, optimizer.state[model.weight][k]) for k, v in state_before.items())
    # the refused gradient does not leak into the next step
    assert all(p.grad is None for p in model.parameters())


def test_the_next_forward_under_the_same_autocast_sees_the_stepped_weights():
    """An update's mini-batches share one autocast context, whose cache of bf16 weight copies would
    otherwise serve the weights from before the step."""
    model = torch.nn.Linear(4, 4, bias=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    x = torch.randn(2, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).sum().backward()
        apply_gradients(model, optimizer, 10.0, "actor")
        after = model(x)
    with torch.no_grad():
        expected = x.bfloat16() @ model.weight.bfloat16().t()
    assert torch.equal(after.detach(), expected)


@pytest.mark.parametrize("fused", [False, True])
def test_a_refused_step_names_only_the_parameters_with_nonfinite_gradients(fused):
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    model(torch.ones(1, 2)).sum().backward()
    model[1].bias.grad.fill_(float("nan"))
    with pytest.raises(KeelError) as error:
        apply_gradients(model, optimizer, 1.0, "actor")
    assert "non-finite in 1 parameters, e.g. ['1.bias']" in error.value.message
    # nothing left behind for a later step
    assert not hasattr(optimizer, "found_inf")


@pytest.mark.parametrize("fused", [False, True])
def test_a_step_returns_its_metrics_and_the_clipped_norm(fused):
    from keel.training.step import DeviceTotals

    model = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    optimizer = (
        torch.optim.SGD(model.parameters(), lr=1.0, fused=fused)
        if fused
        else torch.optim.SGD(model.parameters(), lr=1.0)
    )
    # gradient (3, 4): norm 5
    (model(torch.tensor([[3.0, 4.0]])).sum()).backward()
    totals = DeviceTotals()
    totals.add("actor/pg_loss", torch.tensor(0.25))
    metrics = apply_gradients(model, optimizer, 1.0, "actor", totals=totals)
    assert metrics == {"actor/pg_loss": 0.25, "actor/grad_norm": 5.0}
    # clipped to norm 1, then stepped
    assert torch.allclose(model.weight, torch.tensor([[-0.6, -0.8]]))


def test_no_gradient_is_an_error():
    model = torch.nn.Linear(2, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    assert code_of(lambda: apply_gradients(model, optimizer, 1.0, "actor")) == NO_GRADIENT


# --- run-time guards ----------------------------------------------------------------------------


def test_nonfinite_values_stop_or_skip_with_the_stage_named():
    from keel.errors import NONFINITE_VALUES
    from keel.observe.guards import SkipStep, check_finite

    values = torch.tensor([[0.5, float("nan")], [1.0, float("inf")]])
    # the inf sits on padding and does not count
    mask = torch.tensor([[1, 1], [1, 0]])
    with pytest.raises(KeelError) as info:
        check_finite("advantages", values, mask, "stop")
    assert info.value.code == NONFINITE_VALUES
    assert "advantages: 1 of 3 values non-finite (1 NaN)" in info.value.message
    with pytest.raises(SkipStep):
        check_finite("advantages", values, mask, "skip")
    # all valid ones finite
    check_finite("advantages", values, torch.tensor([[1, 0], [1, 0]]), "stop")


def test_learning_signal_guard_warns_on_flat_rewards_collapse_and_blow_up():
    from keel.config.trainer import GuardsConfig
    from keel.observe.guards import LearningSignalGuard, frac_reward_zero_std

    # groups {0: [1, 1]} flat, {1: [0, 1]} not: half the prompts carry no signal
    assert (
        frac_reward_zero_std(torch.tensor([1.0, 1.0, 0.0, 1.0]), torch.tensor([0, 0, 1, 1])) == 0.5
    )
    guard = LearningSignalGuard(GuardsConfig(zero_signal_steps=2), group_based=True)
    flat = {"critic/score/mean": 0.0, "critic/score/max": 0.0, "critic/score/min": 0.0}
    assert guard(1, flat) == []
    assert any("no learning signal for 2 steps" in w for w in guard(2, flat))
    warnings = guard(
        3,
        {
            "actor/entropy": 0.001,
            "actor/ppo_kl": 5.0,
            "response_length/clip_ratio": 0.95,
            "critic/score/max": 1.0,
            "critic/score/min": 0.0,
        },
    )
    assert len(warnings) == 3 and guard.flat_steps == 0


def test_a_hung_phase_dumps_stacks_and_exits_with_its_code():
    import subprocess
    import sys

    script = (
        "import time\nfrom keel.observe.guards import phase_deadline\n"
        "with phase_deadline('gen', 0.5):\n    time.sleep(30)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 3
    assert "error[KEEL-T004]: phase 'gen'" in proc.stderr
    # the stack shows where it hung
    assert "time.sleep" in proc.stderr or "line 4" in proc.stderr


def test_a_slow_phase_gets_past_its_limit_with_the_limit_the_fix_names():
    """A phase that takes 3 s under a 2 s limit stops; the fix's limit (twice the old one) lets it
    finish."""
    import re
    import subprocess
    import sys

    def run(limit: float) -> subprocess.CompletedProcess:
        script = (
            "import time\nfrom keel.observe.guards import phase_deadline\n"
            f"with phase_deadline('reward', {limit}):\n    time.sleep(3.0)\nprint('done')\n"
        )
        return subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
        )

    stopped = run(2.0)
    assert stopped.returncode == 3 and "error[KEEL-T004]" in stopped.stderr
    limit = float(
        re.search(r"`trainer\.guards\.phase_timeout_s=([\d.]+)`", stopped.stderr).group(1)
    )
    assert limit == 4.0
    finished = run(limit)
    assert finished.returncode == 0 and "done" in finished.stdout


def test_hooks_load_by_name_and_report_bad_specs():
    from keel.errors import HOOK_LOAD
    from keel.trainer.hooks import load_hook, run_hooks

    # any importable function
    hook = load_hook("json:dumps")
    assert callable(hook)
    for spec in ("no_colon", "no_such_module_xyz:f", "json:no_such_function"):
        assert code_of(lambda spec=spec: load_hook(spec)) == HOOK_LOAD
    assert run_hooks([lambda step, metrics, batch: [f"step {step}"]], 3, {}, None) == ["step 3"]


def test_debug_shows_tracebacks_and_sets_the_debug_environment(tmp_path, monkeypatch):
    from keel.cli import main

    monkeypatch.delenv("CUDA_LAUNCH_BLOCKING", raising=False)
    monkeypatch.delenv("TORCH_DISTRIBUTED_DEBUG", raising=False)
    missing = str(tmp_path / "missing.yaml")
    # a coded error, no traceback
    assert main(["train", missing]) == 2
    with pytest.raises(KeelError):
        main(["--debug", "train", missing])
    import os

    assert (
        os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
        and os.environ["TORCH_DISTRIBUTED_DEBUG"] == "DETAIL"
    )


def test_a_repeated_warning_is_printed_once_counted_and_summed_up(caplog):
    import logging

    from keel.observe.log import warnings_said_once

    log = logging.getLogger("keel")
    with caplog.at_level(logging.INFO, logger="keel"), warnings_said_once(log) as said:
        for step in (1, 2, 3):
            log.warning("step %d: %d%% of responses hit max_response_length", step, 90 + step)
            log.warning(
                "step %d: %s",
                step,
                f"entropy {step / 100} is low",
                extra={"kind": "entropy_collapse"},
            )
        log.warning("%d of %d samples not scored", 1, 8)
        # not a warning: never held back
        log.info("resumed at step %d", 3)
    printed = [r.getMessage() for r in caplog.records]
    assert printed[:3] == [
        "step 1: 91% of responses hit max_response_length (said once; repeats are counted)",
        "step 1: entropy 0.01 is low (said once; repeats are counted)",
        "1 of 8 samples not scored (said once; repeats are counted)",
    ]
    assert printed[3] == "resumed at step 3"
    assert printed[4:] == [
        "this warning came 3 times, printed once: step 1: 91% of responses hit max_response_length",
        "this warning came 3 times, printed once: step 1: entropy 0.01 is low",
    ]
    assert said.counts == {
        "step #: #% of responses hit max_response_length": 3,
        "entropy_collapse": 3,
        "# of # samples not scored": 1,
    }


def test_warnings_are_counted_by_kind_and_a_hooks_by_their_words(caplog):
    import logging

    from keel.observe.guards import GuardWarning, report_warnings
    from keel.observe.log import warnings_said_once

    warned: dict[str, int] = {}
    with caplog.at_level(logging.INFO, logger="keel"), warnings_said_once():
        for step in (1, 2):
            metrics = report_warnings(
                step,
                [
                    GuardWarning("ppo_kl", f"actor/ppo_kl={step}.5 > 1.0"),
                    f"my hook: reward {step * 0.25} too low",
                    "my hook: slow tool",
                ],
                warned,
            )
    assert metrics == {
        "guards/warnings": 3.0,
        "guards/warned_steps/ppo_kl": 2.0,
        "guards/warned_steps/hook": 4.0,
    }
    shown = [r.getMessage() for r in caplog.records if "said once" in r.getMessage()]
    # the hook's two warnings differ in words: each is printed once
    assert len(shown) == 3


@pytest.mark.parametrize("grad_clip", [1.0, 10.0])
def test_the_fused_step_clips_as_it_reads_the_gradients(grad_clip):
    """Fused AdamW divides each gradient by the clip's divisor as it steps (grad_scale): the
    weights of a clipped step (norm 5 against 1) and of an unclipped one (against 10) are those of
    the plain clip-then-step, and the norm reported is the norm before clipping."""

    def stepped(fused: bool):
        model = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(torch.tensor([[0.5, -0.25]]))
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
        norms = []
        # gradients (3, 4) and (-1, 2): norms 5 and sqrt(5)
        for x in ([[3.0, 4.0]], [[-1.0, 2.0]]):
            model(torch.tensor(x)).sum().backward()
            norms.append(apply_gradients(model, optimizer, grad_clip, "actor")["actor/grad_norm"])
        return model.weight.detach(), norms, optimizer

    (fused, fused_norms, optimizer), (plain, _, _) = stepped(True), stepped(False)
    torch.testing.assert_close(fused, plain, rtol=0, atol=1e-6)
    assert fused_norms == pytest.approx([5.0, 5**0.5])
    assert not hasattr(optimizer, "grad_scale") and not hasattr(optimizer, "found_inf")
