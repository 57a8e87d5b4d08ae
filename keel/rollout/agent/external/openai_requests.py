"""Reading a request to keel's OpenAI endpoint (openai_server.py): its body, bounded in size; its
turn's token limit, within the rollout's settings and the sample's budget; and its prompt's tokens.

A chat turn that repeats the conversation so far with the answer keel gave, then adds tool or user
messages, continues the sampled tokens (the template's text after the answer's stop token, as
keel's own agent loop does): the answer is never re-encoded from text. Anything else is rendered
whole; if that does not extend the sample's tokens, the trace counts a prefix break.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from keel.rollout.agent.external.trace import Trace, comparable
from keel.rollout.agent.template import TurnTemplate

if TYPE_CHECKING:
    from starlette.requests import Request

SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# a turn's token limit, the first one given (OpenAI's newer name first)
LIMIT_KEYS = ("max_completion_tokens", "max_tokens")
# the error type of a turn refused because its sample's budget is spent
BUDGET_SPENT = "context_length_exceeded"


class RequestError(Exception):
    """`kind`: OpenAI's error type; context_length_exceeded is what clients (verifiers, ...) read as
    a rollout that reached its length, not as a failure."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


async def read_body(request: Request, max_bytes: int) -> dict:
    """The request's JSON object, refused past `max_bytes` before it is all read."""
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > max_bytes):
        raise RequestError(f"the body is over {max_bytes} bytes", 413)
    raw = b""
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise RequestError(f"the body is over {max_bytes} bytes", 413)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RequestError(f"the body is not JSON: {error}") from None
    # arrays nested deeper than the parser's recursion limit
    except RecursionError:
        raise RequestError("the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise RequestError("the body is not a JSON object")
    return body


def within_budget(budget: int | None, limit: int, trace: Trace, prompt: list[int]) -> int:
    """The turn's limit within what the sample's budget leaves after `prompt`; `budget` None: no
    budget but the service's."""
    if budget is None:
        return limit
    first = trace.stretches[0].prompt if trace.stretches else prompt
    left = budget - (len(prompt) - len(first) if prompt[: len(first)] == first else 0)
    if left <= 0:
        trace.budget_spent = True
        raise RequestError(
            f"the sample's budget of {budget} tokens (data.max_response_length) is spent: its "
            "context length is at the rollout's limit",
            kind=BUDGET_SPENT,
        )
    return min(limit, left)


def rollout_limit(settings: dict, service, prefix: str = "") -> int:
    """A request's turn limit from its `settings` (the chat body, or the generate endpoint's
    sampling_params, named with `prefix`), after refusing sampling settings that are not the
    rollout's: the engine's graphs hold those."""
    rollout = service.params
    for key in SAMPLING_KEYS:
        if settings.get(key) is not None and settings[key] != getattr(rollout, key):
            raise RequestError(
                f"{prefix}{key}={settings[key]!r} differs from the rollout's "
                f"{getattr(rollout, key)!r}"
            )
    if settings.get("n", 1) != 1:
        raise RequestError(f"{prefix}n must be 1: each sample sends its own requests")
    _, _, turn_tokens = service.shape
    limit = next(
        (settings[k] for k in LIMIT_KEYS if settings.get(k) is not None),
        turn_tokens,
    )
    if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= turn_tokens:
        raise RequestError(
            f"{prefix}max_tokens must be a whole number from 1 to the rollout's {turn_tokens}"
        )
    return limit


class PromptReader:
    """A request's turn limit and prompt tokens, over an EngineService's settings and the tokenizer;
    it keeps a turn template per tools' schema."""

    def __init__(self, service, tokenizer):
        self.service, self.tokenizer = service, tokenizer
        # by the tools' schema
        self.templates: dict[str, TurnTemplate] = {}

    def limit(self, body: dict) -> int:
        """The turn's token limit, after refusing settings the engine's graphs do not hold."""
        return rollout_limit(body, self.service)

    def chat_prompt(self, body: dict, trace: Trace) -> tuple[list[int], list[dict]]:
        """(the prompt's tokens, the conversation as comparable messages, read once)."""
        messages, tools = body.get("messages"), body.get("tools") or None
        if (
            not isinstance(messages, list)
            or not messages
            or not all(isinstance(m, dict) for m in messages)
        ):
            raise RequestError("messages must be a non-empty list of message objects")
        if tools is not None and not (
            isinstance(tools, list) and all(isinstance(t, dict) for t in tools)
        ):
            raise RequestError("tools must be a list of tool objects")
        seen, conversation = trace.messages, [comparable(m) for m in messages]
        try:
            if seen and len(messages) > len(seen) and conversation[: len(seen)] == seen:
                # The conversation continues after keel's answer: tokens in, tokens out. An answer
                # cut by max_tokens gets the end token the template closes a turn with (attended,
                # not trained).
                template = self._template(tools)
                ended = [] if trace.finished_turn else [template.end_id]
                return trace.context + ended + template.suffix_ids(
                    messages[len(seen) :]
                ), conversation
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=True
            )
        # jinja's (or keel's template check's) errors on a malformed conversation
        except Exception as error:  # noqa: BLE001
            raise RequestError(f"the chat template refused the messages: {error}") from None
        return self.tokenizer.encode(text, add_special_tokens=False), conversation

    def text_prompt(self, body: dict, trace: Trace) -> tuple[list[int], None]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt, add_special_tokens=False), None
        vocab = len(self.tokenizer)
        if (
            isinstance(prompt, list)
            and prompt
            # a bool is an int to Python, never a token id
            and all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in prompt
            )
        ):
            return list(prompt), None
        raise RequestError("prompt must be a non-empty string or a non-empty list of token ids")

    def _template(self, tools) -> TurnTemplate:
        key = json.dumps(tools, sort_keys=True)
        if key not in self.templates:
            self.templates[key] = TurnTemplate(self.tokenizer, tools, sorted(self.service.stop_ids))
        return self.templates[key]
