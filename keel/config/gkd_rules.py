"""GKD's on-policy fraction (distillation.gkd.lmbda, TRL's GKDConfig.lmbda): where a share of the
steps training on the data's own responses cannot work. Each raises KEEL-C029 with the fix."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.errors import GKD_OFF_POLICY, KeelError
from keel.errors.fixes import setting

LMBDA = "distillation.gkd.lmbda"


def check_gkd_lmbda(cfg: KeelConfig) -> None:
    """lmbda < 1 needs gkd's loss, sync steps and no bypass-mode rollout correction."""
    d = cfg.distillation
    lmbda = d.gkd.lmbda
    if not d.enable or lmbda >= 1:
        return
    on_samples = setting(LMBDA, 1.0)
    if d.mode != "gkd":
        raise KeelError(
            GKD_OFF_POLICY,
            f"{LMBDA}={lmbda} with distillation.mode={d.mode}: only gkd trains on the data's "
            "responses; reverse_kl's advantage is the teacher's judgement of the student's own "
            "samples, which a response the student did not sample cannot give",
            f"set {setting('distillation.mode', 'gkd')}, or {on_samples}",
        )
    off = cfg.trainer.off_policy
    if off.ahead or off.partial:
        raise KeelError(
            GKD_OFF_POLICY,
            f"{LMBDA}={lmbda} with trainer.mode={off.name}"
            f"{' and partial rollouts' if off.partial else ''}: async mode generates a step's "
            "batch steps before the step draws whether it trains on samples or on the data, and "
            "corrects it against the sampler's log-probs (the data's responses have no sampler); "
            "partial rollouts keep samples under way across steps",
            f"set {setting('trainer.mode', 'sync')}"
            f"{' ' + setting('trainer.partial_rollout', False) if off.partial else ''}, "
            f"or {on_samples}",
        )
    if cfg.algorithm.rollout_correction.bypass_mode:
        raise KeelError(
            GKD_OFF_POLICY,
            f"{LMBDA}={lmbda} with algorithm.rollout_correction.bypass_mode=true: bypass mode "
            "takes the sampler's log-probs as the old policy's, and the data's responses have no "
            "sampler",
            f"set {setting('algorithm.rollout_correction.bypass_mode', False)} (decoupled "
            f"correction leaves the data's steps alone), or {on_samples}",
        )
