from keel.rollout.native.engine import NativeRolloutEngine, unsupported_reason

__all__ = ["NativeRolloutEngine", "unsupported_reason"]
