"""Tool calls in an assistant turn's text. `format: hermes` (verl's default, Qwen2.5's and Hermes'
chat templates): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`. Parsers are looked up
by name in PARSERS, so another format is one function."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class ToolCall:
    name: str
    arguments: dict


@dataclass
class ParsedTurn:
    calls: list[ToolCall]
    # why each call that could not be read was refused (fed back to the model)
    malformed: list[str]


HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
# a call longer than this is refused unread: the model's JSON is hostile input
MAX_CALL_CHARS = 20_000


def parse_hermes(text: str) -> ParsedTurn:
    calls, malformed = [], []
    for body in HERMES.findall(text):
        if len(body) > MAX_CALL_CHARS:
            malformed.append(f"a tool call of {len(body)} characters (at most {MAX_CALL_CHARS})")
            continue
        try:
            call = json.loads(body)
        except json.JSONDecodeError as error:
            malformed.append(
                f"the tool call is not valid JSON ({error.msg} at character {error.pos})"
            )
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            malformed.append('a tool call needs {"name": ..., "arguments": {...}}')
            continue
        arguments = call.get("arguments", {})
        # some models write the arguments as a JSON string
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                arguments = None
        if not isinstance(arguments, dict):
            malformed.append(f"the arguments of {call['name']!r} are not a JSON object")
            continue
        calls.append(ToolCall(call["name"], arguments))
    # an opening tag never closed
    if text.count("<tool_call>") > len(calls) + len(malformed):
        malformed.append("a <tool_call> without its </tool_call>")
    return ParsedTurn(calls, malformed)


PARSERS: dict[str, Callable[[str], ParsedTurn]] = {"hermes": parse_hermes}
