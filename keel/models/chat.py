"""How a conversation is rendered for a model: one place, so a reward model is trained on the text
it is later scored on."""

from __future__ import annotations


def as_messages(prompt) -> list[dict]:
    """A prompt as chat messages: a string is one user turn."""
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def conversation_text(tokenizer, prompt, response: str) -> str:
    """The prompt and a whole response as one text, the way keel's reward model reads a sample:
    through the tokenizer's chat template where it has one, else the plain text joined."""
    if tokenizer.chat_template is None:
        text = prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)
        return text + response
    return tokenizer.apply_chat_template(
        as_messages(prompt) + [{"role": "assistant", "content": response}], tokenize=False
    )
