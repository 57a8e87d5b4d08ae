"""Run-time guards: stop (or skip, when asked) the moment numbers go bad, and warn when a run stops
learning in ways that look fine on a loss curve."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
from contextlib import contextmanager

import torch

from keel.errors import ENGINE_OUT_OF_SYNC, NONFINITE_VALUES, PHASE_TIMEOUT, KeelError, SkipStep

log = logging.getLogger("keel")


def check_finite(stage: str, values: torch.Tensor, mask: torch.Tensor | None, policy: str) -> None:
    """Non-finite rewards, log-probs, values or advantages stop the step before they reach a
    weight."""
    valid = values if mask is None else values[mask.bool()]
    bad = ~torch.isfinite(valid)
    if not bad.any():
        return
    finite = valid[~bad]
    stats = (
        f"{int(bad.sum())} of {valid.numel()} values non-finite "
        f"({int(torch.isnan(valid).sum())} NaN); finite ones in "
        f"[{finite.min().item():.4g}, {finite.max().item():.4g}]"
        if finite.numel()
        else "all non-finite"
    )
    if policy == "skip":
        log.warning("skipping the step: %s in %s", stats, stage)
        raise SkipStep(stage)
    raise KeelError(NONFINITE_VALUES, f"{stage}: {stats}")


def frac_reward_zero_std(scores: torch.Tensor, group_index: torch.Tensor) -> float:
    """Share of prompts whose samples all scored the same: group-relative estimators learn nothing
    there."""
    groups = group_index.unique()
    flat = sum(
        bool((scores[group_index == g].max() - scores[group_index == g].min()) == 0) for g in groups
    )
    return flat / len(groups)


class GuardWarning(str):
    """A warning's text, and the kind it is counted as (`guards/warned_steps/<kind>`)."""

    kind: str

    def __new__(cls, kind: str, text: str) -> GuardWarning:
        warning = super().__new__(cls, text)
        warning.kind = kind
        return warning


class LearningSignalGuard:
    """Warns when a run is burning compute without a signal to learn from."""

    def __init__(
        self,
        guards_cfg,
        group_based: bool,
        fixed_length: bool = False,
        rewards_teach: bool = True,
    ):
        self.cfg = guards_cfg
        # False: the rewards are logged but teach nothing (distillation's teacher does), so
        # rewards that are all 0 or all alike are no missing signal
        self.rewards_teach = rewards_teach
        self.group_based = group_based
        # rollout.ignore_eos: every response is cut off by design
        self.fixed_length = fixed_length
        self.flat_steps = 0
        self.saw_all_zero = False

    def __call__(self, step: int, metrics: dict[str, float]) -> list[GuardWarning]:
        signal = self._signal_warnings(metrics) if self.rewards_teach else []
        return signal + self._health_warnings(metrics)

    def _signal_warnings(self, metrics: dict[str, float]) -> list[GuardWarning]:
        """Rewards that teach nothing: all 0 with real answers, or the same for several steps."""
        c, warnings = self.cfg, []

        def warn(kind: str, text: str) -> None:
            warnings.append(GuardWarning(kind, text))

        if self._first_all_zero(metrics):
            warn(
                "all_scores_zero",
                "every score of this batch is 0 although the model wrote answers (mean "
                f"{metrics['response_length/mean']:.1f} tokens): a task too hard for the model "
                "yet, or a reward function that never sees a right answer; compare samples.jsonl "
                "with the scorer (verl's contract: compute_score(data_source=, solution_str=, "
                "ground_truth=, extra_info=))",
            )
        flat = metrics.get("critic/score/max", 1.0) == metrics.get("critic/score/min", 0.0)
        if self.group_based:
            flat = flat or metrics.get("guards/frac_reward_zero_std", 0.0) == 1.0
        self.flat_steps = self.flat_steps + 1 if flat else 0
        if self.flat_steps >= c.zero_signal_steps:
            warn(
                "no_signal",
                f"no learning signal for {self.flat_steps} steps: every reward "
                f"{'in each group ' if self.group_based else ''}is the same (score "
                f"{metrics.get('critic/score/mean', 0):.3g}); check the scorer on samples.jsonl",
            )
        return warnings

    def _health_warnings(self, metrics: dict[str, float]) -> list[GuardWarning]:
        """Responses cut off or collapsed, low entropy, rejected tokens, a policy that moved far."""
        c, warnings = self.cfg, []

        def warn(kind: str, text: str) -> None:
            warnings.append(GuardWarning(kind, text))

        if (
            not self.fixed_length
            and metrics.get("response_length/clip_ratio", 0.0) > c.max_clip_ratio
        ):
            warn(
                "responses_cut_off",
                f"{100 * metrics['response_length/clip_ratio']:.0f}% of responses hit "
                "data.max_response_length: their rewards score cut-off answers",
            )
        if metrics.get("response_length/mean", c.min_response_length) < c.min_response_length:
            warn(
                "short_responses",
                f"responses average {metrics['response_length/mean']:.2f} tokens: the policy "
                "may have collapsed to emitting EOS",
            )
        if metrics.get("actor/entropy", c.min_entropy) < c.min_entropy:
            warn(
                "entropy_collapse",
                f"entropy {metrics['actor/entropy']:.3g} < {c.min_entropy}: the policy has "
                "collapsed; samples of a prompt are nearly identical",
            )
        rejected = metrics.get("rollout_corr/rollout_rs_masked_fraction", 0.0)
        if rejected > 0.5:
            warn(
                "rollout_rejection",
                f"rollout correction's rejection dropped {100 * rejected:.0f}% of the tokens "
                "from the losses: the sampler and the trainer disagree (rollout_corr/kl), or "
                "algorithm.rollout_correction.rollout_rs_threshold is too tight",
            )
        for key in ("actor/ppo_kl", "actor/ref_kl"):
            if abs(metrics.get(key, 0.0)) > c.max_kl:
                warn(
                    key.split("/")[1],
                    f"{key}={metrics[key]:.3g} > {c.max_kl}: the policy moved far in one "
                    "step; lower the learning rate or the clip range",
                )
        return warnings

    def _first_all_zero(self, metrics: dict[str, float]) -> bool:
        """The first batch whose every score is 0 while responses are not empty (said once a
        run)."""
        all_zero = (
            metrics.get("critic/score/max", 1.0) == 0.0 == metrics.get("critic/score/min", 1.0)
        )
        if self.saw_all_zero or not all_zero or metrics.get("response_length/mean", 0.0) <= 1.0:
            return False
        self.saw_all_zero = True
        return True


def report_warnings(
    step: int, warnings: list[str], warned_steps: dict[str, int]
) -> dict[str, float]:
    """Log a step's warnings (a repeat is printed once, keel.observe.log.warnings_said_once) and
    count them by kind in `warned_steps` -> the step's metrics of them."""
    for warning in warnings:
        # a GuardWarning's; a user hook's are told apart by their words
        kind = getattr(warning, "kind", None)
        warned_steps[kind or "hook"] = warned_steps.get(kind or "hook", 0) + 1
        log.warning("step %d: %s", step, warning, extra={"kind": kind})
    return {
        "guards/warnings": float(len(warnings)),
        **{f"guards/warned_steps/{kind}": float(n) for kind, n in warned_steps.items()},
    }


def check_log_prob_gap(gap: float, step: int, limit: float) -> None:
    """`gap`: the mean per-token gap between what the engine sampled with and what the trainer
    computes on the same tokens (rollout/log_prob_gap); past `limit`, the engine's weights are not
    the trainer's (KEEL-T006)."""
    if gap > limit:
        stage = (
            f"the weight sync after step {step - 1}'s update did not reach the engine"
            if step > 1
            else "before any update: the engine computes another distribution than the trainer"
        )
        raise KeelError(
            ENGINE_OUT_OF_SYNC,
            f"step {step}: the rollout's log-probs differ from the trainer's by "
            f"{gap:.3g} per token (trainer.guards.max_log_prob_gap={limit}): {stage}",
        )


@contextmanager
def phase_deadline(phase: str, seconds: float | None):
    """Past `seconds`, dump every thread's stack and exit with a code that names the phase: a hang
    in generation, a collective or a reward service becomes a message instead of a silent job."""
    if not seconds:
        yield
        return

    def expire() -> None:
        print(
            f"error[{PHASE_TIMEOUT}]: phase {phase!r} ran past "
            f"trainer.guards.phase_timeout_s={seconds}; stacks of every thread follow",
            file=sys.stderr,
            flush=True,
        )
        print(
            f"fix: if the stacks below show {phase!r} working, not waiting, it is slow, not "
            f"stuck: set `trainer.guards.phase_timeout_s={2 * seconds:g}`",
            file=sys.stderr,
            flush=True,
        )
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        # the main thread may be stuck in C code: a normal exit would wait forever
        os._exit(3)

    timer = threading.Timer(seconds, expire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
