"""`reward_model.enable_resource_pool`: the reward model on devices of its own.

By default the reward model runs in the driver, on the device the policy's first rank also uses.
With a pool it runs as `reward_model.n_gpus_per_node x reward_model.nnodes` Ray actors, one
replica per GPU (a CPU process with trainer.device=cpu), each scoring a contiguous share of the
batch. The policy's workers are placed first and the pool takes other devices, so a large reward
model does not compete with the actor's memory. `score` is RewardModel's, so the reward function
does not know the difference.
"""

from __future__ import annotations

import logging

from keel.errors import WORKER_RAISED, KeelError
from keel.distributed.group import connect_ray, require_devices, wants_gpus
from keel.training.batching import contiguous_shares
from keel.rewards.model import RewardTemplate

log = logging.getLogger("keel")


class _Replica:
    """One copy of the reward model in its own process (Ray shows it only its own GPU)."""

    def __init__(self, path: str, use_gpu: bool, micro_batch_size: int, max_length: int | None,
                 trust_remote_code: bool):
        import torch

        from keel.rewards.model import RewardModel

        device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.model = RewardModel(path, device, micro_batch_size, max_length, trust_remote_code)

    def score(self, raw_prompts: list, responses: list[str]) -> list[float | str]:
        return self.model.score(raw_prompts, responses)


class RewardModelPool(RewardTemplate):
    def __init__(self, cfg):
        rm = cfg.reward_model
        super().__init__(rm.model.path, rm.max_length, rm.model.trust_remote_code)  # for `keel check`
        self.ray = ray = connect_ray(cfg)
        require_devices(ray, cfg)
        count, use_gpu = cfg.pools["reward model"], wants_gpus(cfg)
        replica = ray.remote(_Replica).options(num_gpus=1 if use_gpu else 0, num_cpus=1)
        self.replicas = [replica.remote(rm.model.path, use_gpu, rm.micro_batch_size_per_gpu, rm.max_length,
                                        rm.model.trust_remote_code) for _ in range(count)]
        log.info("reward model: %d replicas on %ss of their own", count, "GPU" if use_gpu else "CPU")

    def score(self, raw_prompts: list, responses: list[str]) -> list[float | str]:
        """Every replica scores a contiguous share; the scores come back in order."""
        shares = contiguous_shares(len(responses), len(self.replicas))
        refs = [replica.score.remote(raw_prompts[start:end], responses[start:end])
                for replica, (start, end) in zip(self.replicas, shares) if end > start]
        try:
            parts = self.ray.get(refs)
        except self.ray.exceptions.RayError as error:
            raise KeelError(WORKER_RAISED, f"a reward model replica failed while scoring: {error}") from None
        return [score for part in parts for score in part]

    def shutdown(self) -> None:
        for replica in self.replicas:
            self.ray.kill(replica)
        self.replicas = []
