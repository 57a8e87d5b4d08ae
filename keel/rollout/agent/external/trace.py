"""What an externally driven sample (agent code behind an OpenAI client) sampled, as it will be
trained: the tokens the engine saw and sampled, never text encoded again.

Each request of a sample is one turn: its prompt tokens and the completion the engine sampled. A
request whose prompt extends everything before it (the last prompt, the tokens sampled, then the
tool or user turn the client added) continues the sample's stretch: the new tokens between are
attended to but not trained. One that does not (the client rewrote the history, or a template
rendered an earlier turn differently) starts a new stretch, and the sample counts a prefix break:
keel never trains on tokens the model did not sample as if it had."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class Stretch:
    """One continuous run of a sample's turns: its first prompt, then what followed it."""

    prompt: list[int]
    # after the prompt: sampled and in-between tokens
    ids: list[int] = field(default_factory=list)
    # 1 where the engine sampled the token
    trained: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)

    @property
    def context(self) -> list[int]:
        return self.prompt + self.ids

    def add(self, ids: list[int], log_probs: list[float] | None) -> None:
        self.ids += ids
        self.trained += [0 if log_probs is None else 1] * len(ids)
        self.log_probs += [0.0] * len(ids) if log_probs is None else list(log_probs)


@dataclass
class Trace:
    """One sample's turns as stretches (more than one: its history was rewritten between turns)."""

    stretches: list[Stretch] = field(default_factory=list)
    requests: int = 0
    # chat: the conversation so far, the last answer included
    messages: list[dict] | None = None
    # the last turn ended with a stop token (a next turn may follow it)
    finished_turn: bool = False
    # a request found the sample's token budget spent
    budget_spent: bool = False

    @property
    def prefix_breaks(self) -> int:
        return max(0, len(self.stretches) - 1)

    @property
    def context(self) -> list[int]:
        return self.stretches[-1].context if self.stretches else []

    def record(
        self, prompt: list[int], ids: list[int], log_probs: list[float], stopped: bool
    ) -> None:
        """A request's prompt and the completion the engine sampled for it."""
        self.requests += 1
        context = self.context
        if self.stretches and len(prompt) > len(context) and prompt[: len(context)] == context:
            self.stretches[-1].add(prompt[len(context) :], None)
        else:
            self.stretches.append(Stretch(list(prompt)))
        self.stretches[-1].add(ids, log_probs)
        self.finished_turn = stopped


def comparable(message) -> dict:
    """A chat message as far as the model saw it: role, text and tool calls (their arguments
    parsed), whatever shape the client sent it in (the openai package adds null fields)."""
    message = dict(message) if isinstance(message, dict) else {}
    content = message.get("content")
    # content parts: the text ones are what a text model sees
    if isinstance(content, list):
        content = "".join(
            str(p.get("text", ""))
            for p in content
            if isinstance(p, dict) and p.get("type") == "text"
        )
    calls = []
    tool_calls = message.get("tool_calls")
    for call in tool_calls if isinstance(tool_calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        function = function if isinstance(function, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        calls.append((function.get("name"), json.dumps(arguments, sort_keys=True)))
    return {"role": str(message.get("role")), "content": str(content or ""), "tool_calls": calls}
