"""Forward passes over `[prompt | response]` sequences: log-probs, entropy and values."""

from __future__ import annotations

import torch
from torch import Tensor

from keel.algorithms.utils import entropy_from_logits
from keel.types import RolloutBatch, position_ids_from_mask


def _model_inputs(batch: RolloutBatch, device: torch.device) -> dict[str, Tensor]:
    attention_mask = batch.attention_mask.to(device)                        # [B, P + R]
    return {"input_ids": batch.input_ids.to(device), "attention_mask": attention_mask,
            "position_ids": position_ids_from_mask(attention_mask)}


def response_log_probs(model, batch: RolloutBatch, temperature: float,
                       with_entropy: bool = False, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """Log-probs [B, R] of the response tokens, and their entropy [B, R] when asked.

    Only the last R + 1 positions go through `lm_head` (`logits_to_keep`): position t predicts
    token t + 1, so positions P-1 .. P+R-2 predict the R response tokens.
    """
    device = next(model.parameters()).device
    response_len = batch.response_ids.shape[1]
    out = model(**_model_inputs(batch, device), use_cache=False, logits_to_keep=response_len + 1)
    logits = out.logits[:, :-1].float() / temperature                       # [B, R, V]
    targets = batch.response_ids.to(device).unsqueeze(-1)                   # [B, R, 1]
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, targets).squeeze(-1)
    entropy = None
    if with_entropy:
        entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return log_probs, entropy


def response_values(critic, batch: RolloutBatch) -> Tensor:
    """Critic values [B, R]: the value of the state before each response token."""
    device = next(critic.parameters()).device
    response_len = batch.response_ids.shape[1]
    values = critic(**_model_inputs(batch, device))                         # [B, P + R]
    return values[:, -response_len - 1:-1].float()


def split_micro(batch: RolloutBatch, micro_size: int) -> list[RolloutBatch]:
    return [batch.select(range(i, min(i + micro_size, len(batch))))
            for i in range(0, len(batch), micro_size)]


@torch.no_grad()
def batched_log_probs(model, batch: RolloutBatch, micro_size: int, temperature: float) -> Tensor:
    """Log-probs for a whole batch without gradients, micro-batch by micro-batch: [N, R]."""
    was_training = model.training
    model.eval()
    try:
        parts = [response_log_probs(model, micro, temperature)[0].cpu()
                 for micro in split_micro(batch, micro_size)]
    finally:
        model.train(was_training)
    return torch.cat(parts) * batch.response_mask
