"""What every config section is made of: fields with their constraints and help, and the shared
pieces sections inherit."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def opt(
    default: Any = None,
    *,
    choices: tuple | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    help: str = "",
    factory=None,
):
    """A config field with its constraints and a one-line help."""
    meta = {"choices": choices, "ge": ge, "gt": gt, "le": le, "help": help}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ResourcePool:
    """A role on devices of its own (Ray workers placed after the policy's) instead of beside the
    policy: the critic trains there, the reward model scores there (one replica per device)."""

    enable_resource_pool: bool = opt(
        False,
        help="run it on devices of its own (its own Ray workers) instead of beside the policy",
    )
    n_gpus_per_node: int = opt(1, gt=0, help="enable_resource_pool: its workers per node")
    nnodes: int = opt(1, gt=0, help="enable_resource_pool: nodes")


@dataclass
class LogProbBatching:
    """Micro-batches of a forward-only log-prob pass: the rollout's (old log-probs) or the
    reference's."""

    log_prob_micro_batch_size_per_gpu: int = opt(8, gt=0)
    log_prob_use_dynamic_bsz: bool = opt(False, help="log-prob micro-batches by token budget")
    log_prob_max_token_len_per_gpu: int = opt(
        32768, gt=0, help="log_prob_use_dynamic_bsz: padded tokens per forward"
    )
