"""`keel check` on the rollout engine: which one will generate, and what a fallback to hf costs."""

from __future__ import annotations

from keel.check.findings import PASS, WARN, Finding, need
from keel.config.schema import KeelConfig
from keel.rollout.select import HF_COST, engine_for


def check_rollout_engine(cfg: KeelConfig, context: dict) -> list[Finding]:
    model_cfg = need(context, "model_config")
    rollout = cfg.actor_rollout_ref.rollout
    engine, reason = engine_for(rollout.name, model_cfg, rollout.batch_invariant)
    if engine == "native":
        runs = f"native: keel's engine runs {model_cfg.model_type!r}"
        if rollout.batch_invariant:
            runs += (
                "; batch-invariant (rollout.batch_invariant): the sampler's log-probs and the "
                "old-log-prob pass equal bit for bit, each token's sums in an order of its own "
                "(slower generation)"
            )
            if not cfg.algorithm.rollout_correction.bypass_mode:
                runs += (
                    "; its pass only recomputes the sampler's bits: "
                    "algorithm.rollout_correction.bypass_mode=true skips it"
                )
        return [Finding(PASS, "rollout engine", runs)]
    if reason is None:
        return [Finding(PASS, "rollout engine", "hf (rollout.name=hf)")]
    return [
        Finding(WARN, "rollout engine", f"hf: the native engine does not run {reason}; {HF_COST}")
    ]
