"""How the worker placed a model: what its trainer needs to know to run it and reduce its gradients.

keel.distributed.parallelize makes one for each model it prepares. The default is a whole model on
one process, computing where its parameters are, with nothing to reduce.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Placement:
    # where it computes, when not its parameters' (FSDP param_offload)
    device: torch.device | None = None
    # the vocabulary arithmetic through torch.compile (GPU)
    fused_vocab: bool = False
    # decoder_token_stats registered with FSDP, which then gathers
    token_stats: Callable | None = None
    # the root's parameters (embeddings, lm_head) around it
    # ranks whose gradients are averaged
    data_parallel_size: int = 1
    # Averages gradients over ranks that each hold the whole model (DDP, fsdp_size=1); FSDP
    # reduces its own, and one rank has nothing to average.
    reduce_gradients: Callable[[list[torch.Tensor]], None] | None = None
    # Adam's moments in CPU memory, on the device a bucket at a time
    optimizer_offload: bool = False


SINGLE = Placement()
