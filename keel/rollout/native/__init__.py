from keel.rollout.native.engine import NativeRolloutEngine, unsupported_reason
from keel.rollout.native.models import not_by_default

__all__ = ["NativeRolloutEngine", "not_by_default", "unsupported_reason"]
