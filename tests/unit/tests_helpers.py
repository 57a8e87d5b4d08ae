"""Small batches for unit tests."""

import torch

from keel.types import TrainBatch


def make_batch(response_lengths: list[int], width: int = 6) -> TrainBatch:
    n = len(response_lengths)
    mask = torch.tensor([[1] * k + [0] * (width - k) for k in response_lengths])
    return TrainBatch(
        prompt_ids=torch.ones(n, 3, dtype=torch.long),
        prompt_mask=torch.ones(n, 3, dtype=torch.long),
        response_ids=torch.arange(n * width).view(n, width),
        response_mask=mask,
        sampling_log_probs=torch.zeros(n, width),
        group_index=torch.arange(n),
        records=list(range(n)),
        response_texts=[str(i) for i in range(n)],
        truncated=torch.zeros(n, dtype=torch.bool),
        scores=torch.zeros(n),
        token_level_rewards=torch.zeros(n, width),
        advantages=torch.zeros(n, width),
        returns=torch.zeros(n, width),
    )
