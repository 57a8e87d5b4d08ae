"""Every seed of an RL run, in one place: each is a pure function of trainer.seed and the step (and
the rank, the generation batch or the role), so a resumed run draws exactly what an uninterrupted
one would, in sync mode and in async mode alike. The prompts' order is data.seed's
(keel.data.sampler); initial weights are trainer.seed itself (the workers seed torch with it before
building models)."""

from __future__ import annotations

from keel.config.schema import KeelConfig


def step_seed(cfg: KeelConfig, step: int) -> int:
    """The step's seed: its generation, and its mini-batch order. Validation samples with it too."""
    return cfg.trainer.seed * 100_003 + step


def batch_seed(seed: int, call: int) -> int:
    """A step's `call`-th generation batch (DAPO's dynamic sampling generates several): a seed of
    its own."""
    return seed + call * 7919


def rank_seed(seed: int, rank: int) -> int:
    """What rank `rank` samples with, for a generation batch's `seed`."""
    return seed * 1009 + rank


def actor_order_seed(seed: int) -> int:
    """The actor update's mini-batch order for a step's `seed` (first_mini_batch and update_actor
    agree)."""
    return seed * 1000


def critic_order_seed(seed: int) -> int:
    return seed * 1000 + 500


def on_policy_draw_seed(seed: int) -> int:
    """GKD's draw (distillation.gkd.lmbda) of whether a step with `seed` trains on the student's
    samples or on the data's responses."""
    return seed * 1000 + 250
