"""A reward model: a Hugging Face sequence-classification model scoring (prompt, whole response).

It reads with its own tokenizer and chat template, never the policy's, and never truncates: a
sample longer than it reads is not scored (with that reason), since a cut-off response scored as if
whole is one of the quiet ways RL runs go wrong.
"""

from __future__ import annotations

import logging

import torch

from keel.errors import TOKEN_BUDGET, KeelError
from keel.errors.fixes import setting
from keel.models.chat import conversation_text
from keel.models.load import check_model_dir, weight_file_shapes
from keel.models.tokenizer_match import context_limit

log = logging.getLogger("keel")


class RewardTemplate:
    """How the reward model reads a sample: its tokenizer, its chat template and how many tokens it
    reads. No weights: `keel check` and a reward model pool's driver side need only this."""

    def __init__(self, path: str, max_length: int | None, trust_remote_code: bool = False):
        from transformers import AutoConfig, AutoTokenizer

        self.path = check_model_dir(path, "reward_model.model.path")
        self.tokenizer = AutoTokenizer.from_pretrained(
            self.path, trust_remote_code=trust_remote_code
        )
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        config = AutoConfig.from_pretrained(self.path, trust_remote_code=trust_remote_code)
        # what it reads, and what says so
        limit, self.limited_by = context_limit(config, self.tokenizer)
        self.max_length = max_length or limit
        # the user's word over the tokenizer's, never past the positions the model has
        if max_length:
            positions = getattr(config, "max_position_embeddings", None)
            if positions and max_length > positions:
                raise KeelError(
                    TOKEN_BUDGET,
                    f"reward_model.max_length={max_length} is more than the reward model's "
                    f"max_position_embeddings={positions}",
                    f"set {setting('reward_model.max_length', positions)} (its positions), or "
                    "leave it unset",
                )
            if limit and max_length > limit:
                log.warning(
                    "reward_model.max_length=%d is over what the reward model reads by default "
                    "(%s): scores of longer samples are only as good as its training on them",
                    max_length,
                    self.limited_by,
                )
            self.limited_by = f"reward_model.max_length={max_length}"

    def text(self, raw_prompt, response: str) -> str:
        """The conversation as the reward model was trained to read it."""
        return conversation_text(self.tokenizer, raw_prompt, response)


class RewardModel(RewardTemplate):
    def __init__(
        self,
        path: str,
        device: torch.device,
        micro_batch_size: int,
        max_length: int | None,
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForSequenceClassification

        super().__init__(path, max_length, trust_remote_code)
        # a truncated file is a coded error, not a SafetensorError
        weight_file_shapes(self.path)
        self.model = (
            AutoModelForSequenceClassification.from_pretrained(
                self.path, num_labels=1, trust_remote_code=trust_remote_code
            )
            .to(device)
            .eval()
        )
        # it finds each sequence's last token by it
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.micro_batch_size = micro_batch_size

    @torch.no_grad()
    def score(self, raw_prompts: list, responses: list[str]) -> list[float | str]:
        """A score per sample, or the reason it was not scored."""
        ids = [
            self.tokenizer(self.text(p, r), add_special_tokens=False)["input_ids"]
            for p, r in zip(raw_prompts, responses)
        ]
        out: list[float | str] = [
            f"longer than the reward model reads ({len(x)} > {self.max_length} tokens)"
            if self.max_length and len(x) > self.max_length
            else 0.0
            for x in ids
        ]
        fits = [i for i, x in enumerate(ids) if isinstance(out[i], float)]
        for start in range(0, len(fits), self.micro_batch_size):
            chunk = fits[start : start + self.micro_batch_size]
            batch = self.tokenizer.pad(
                {"input_ids": [ids[i] for i in chunk]}, padding=True, return_tensors="pt"
            )
            logits = self.model(
                input_ids=batch["input_ids"].to(self.device),
                attention_mask=batch["attention_mask"].to(self.device),
            ).logits  # [b, 1]
            for i, value in zip(chunk, logits[:, 0].float().tolist()):
                out[i] = value
        return out
