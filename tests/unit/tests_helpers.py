"""Small batches for unit tests, and a spy on the engine service."""

import dataclasses

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


def padded_batch(
    vocab: int, prompt_lengths: list[int], response_lengths: list[int], seed: int = 0, low: int = 0
) -> TrainBatch:
    """Left-padded prompts and right-padded responses of the given lengths, random tokens in
    [low, vocab)."""
    generator = torch.Generator().manual_seed(seed)
    n, prompt_width, width = len(prompt_lengths), max(prompt_lengths), max(response_lengths)
    prompt_mask = torch.tensor([[0] * (prompt_width - p) + [1] * p for p in prompt_lengths])
    batch = make_batch(response_lengths, width)
    return dataclasses.replace(
        batch,
        prompt_ids=torch.randint(low, vocab, (n, prompt_width), generator=generator) * prompt_mask,
        prompt_mask=prompt_mask,
        response_ids=torch.randint(low, vocab, (n, width), generator=generator)
        * batch.response_mask,
    )


class Spy:
    """The engine service, recording every completion it hands out."""

    def __init__(self, service):
        self.service, self.sampled, self.extended = service, {}, {}

    def __getattr__(self, name):
        return getattr(self.service, name)

    def submit(self, key, context, limit):
        future = self.service.submit(key, context, limit)

        def keep(done):
            if done.exception() is None:
                self.sampled.setdefault(key, []).append(done.result().ids)
                self.extended.setdefault(key, []).append(done.result().extended)

        future.add_done_callback(keep)
        return future
