"""rollout.batch_invariant: the settings it cannot run with (the model's own limits are the
engine's to say: rollout/select.engine_for). Each raises KEEL-C030 with the fix."""

from __future__ import annotations

from keel.config.schema import KeelConfig
from keel.errors import BATCH_INVARIANT_UNSUPPORTED, KeelError
from keel.errors.fixes import setting

KEY = "actor_rollout_ref.rollout.batch_invariant"


def check_batch_invariant(cfg: KeelConfig) -> None:
    """The native engine, on the actor's workers."""
    ref = cfg.actor_rollout_ref
    if not ref.rollout.batch_invariant:
        return
    off = setting(KEY, False)
    if ref.rollout.name == "hf":
        raise KeelError(
            BATCH_INVARIANT_UNSUPPORTED,
            f"{KEY}=true with actor_rollout_ref.rollout.name=hf: the bitwise-equal log-probs are "
            "the native engine's arithmetic",
            f"set {off}, or {setting('actor_rollout_ref.rollout.name', 'native')}",
        )
    if not ref.hybrid_engine:
        raise KeelError(
            BATCH_INVARIANT_UNSUPPORTED,
            f"{KEY}=true with actor_rollout_ref.hybrid_engine=false: the old-log-prob pass runs on "
            "the engine that holds the policy's current weights, which a rollout on workers of "
            "its own does not share with the actor",
            f"set {off}, or {setting('actor_rollout_ref.hybrid_engine', True)}",
        )
