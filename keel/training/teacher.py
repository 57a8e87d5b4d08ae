"""The distillation teacher: a frozen causal LM that scores the student's samples in one forward
pass per micro-batch, as the reference does, at the sampling temperature."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from keel.training.batching import MicroBatching
from keel.training.forward import TopK, per_token_parts, response_vocab_stats
from keel.training.placement import SINGLE, Placement
from keel.types import TrainBatch


@dataclass(frozen=True)
class TeacherScores:
    """The teacher's view of a batch of samples, on the host."""

    # [N, R] the log-prob of each sampled token (0 past the response)
    log_probs: Tensor
    # [N, R, k] its k most likely tokens at each response position, and their log-probs (over
    # the whole vocabulary); None: only the sampled tokens were asked for
    top_ids: Tensor | None = None
    top_log_probs: Tensor | None = None

    def batch_fields(self) -> dict[str, Tensor | None]:
        """TrainBatch's fields of these scores."""
        return {
            "teacher_log_probs": self.log_probs,
            "teacher_top_ids": self.top_ids,
            "teacher_top_log_probs": self.top_log_probs,
        }

    def parts(self) -> tuple[Tensor, ...]:
        return tuple(t for t in (self.log_probs, self.top_ids, self.top_log_probs) if t is not None)


class Teacher:
    def __init__(
        self,
        model,
        batching: MicroBatching,
        temperature: float,
        top_k: int | None,
        placement: Placement = SINGLE,
        student_vocab: int | None = None,
    ):
        """`student_vocab`: the student's embedding rows; the top k are drawn from those ids
        (a teacher may have more rows, all padding, that the student could not score)."""
        self.model = model.eval().requires_grad_(False)
        self.batching, self.placement = batching, placement
        # the student's sampling temperature: both sides compare the same distributions
        self.temperature = temperature
        # gkd: the teacher's top-k at each position (the vocabulary at most); reverse_kl: None
        vocab = min(model.get_output_embeddings().weight.shape[0], student_vocab or 1 << 62)
        self.top_k = TopK(min(top_k, vocab), vocab) if top_k else None

    @torch.no_grad()
    def score(self, batch: TrainBatch) -> TeacherScores:
        """Micro-batch by micro-batch, as every log-prob pass (per_token_parts); zeros past each
        response, whatever the micro-batches' widths were."""

        def micro_scores(micro: TrainBatch) -> tuple[Tensor, ...]:
            log_probs, _, top = response_vocab_stats(
                self.model, micro, self.temperature, plan=self.placement, vocab_extra=self.top_k
            )
            # top: the k log-probs, then their ids
            return (log_probs, *top)

        log_probs, *top = per_token_parts(batch, self.batching, micro_scores)
        if not top:
            return TeacherScores(log_probs)
        return TeacherScores(log_probs, top_ids=top[1], top_log_probs=top[0])
