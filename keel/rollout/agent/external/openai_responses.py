"""What keel's OpenAI endpoint (openai_server.py) answers: a completed turn in OpenAI's form (its
tool calls parsed out of the text), whole or as server-sent events, and its errors."""

from __future__ import annotations

import json
import time
import uuid

from starlette.responses import JSONResponse, StreamingResponse

from keel.errors import AGENT_REQUEST
from keel.rollout.agent.parse import HERMES


def answer_of(completion, chat: bool, tokenizer, parse) -> dict:
    """The engine's completion as OpenAI's choice: {text} or {message}, and its finish reason;
    `parse` reads the tool calls out of a chat turn's text."""
    text = tokenizer.decode(completion.ids, skip_special_tokens=True)
    reason = "stop" if completion.stopped else "length"
    if not chat:
        return {"text": text, "finish_reason": reason}
    calls = parse(text).calls
    message = {"role": "assistant", "content": _without_calls(text) if calls else text}
    if calls:
        message["tool_calls"] = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments)},
            }
            for c in calls
        ]
        # OpenAI's form of a turn that only calls tools
        message["content"] = message["content"] or None
        reason = "tool_calls" if completion.stopped else reason
    return {"message": message, "finish_reason": reason}


def response(body: dict, answer: dict, chat: bool, prompt_tokens: int, completion_tokens: int):
    """The answer as the request asked for it: one JSON object, or streamed (`stream`)."""
    kind = "chat.completion" if chat else "text_completion"
    head = {
        "id": f"keel-{uuid.uuid4().hex}",
        "created": int(time.time()),
        "model": body.get("model", "keel"),
    }
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if not body.get("stream"):
        return JSONResponse(
            {**head, "object": kind, "choices": [{"index": 0, **answer}], "usage": usage}
        )
    return StreamingResponse(_chunks(head, answer, chat, usage), media_type="text/event-stream")


async def _chunks(head: dict, answer: dict, chat: bool, usage: dict):
    """The answer as server-sent events: the whole turn in one delta (the engine answers a turn
    when it ends), then its finish reason and usage, then [DONE]."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    if chat:
        delta = dict(answer["message"])
        # a streamed call carries its index, which clients accumulate by
        if "tool_calls" in delta:
            delta["tool_calls"] = [
                {"index": i, **call} for i, call in enumerate(delta["tool_calls"])
            ]
        first = {"index": 0, "delta": delta, "finish_reason": None}
        last = {"index": 0, "delta": {}, "finish_reason": answer["finish_reason"]}
    else:
        first = {"index": 0, "text": answer["text"], "finish_reason": None}
        last = {"index": 0, "text": "", "finish_reason": answer["finish_reason"]}
    yield f"data: {json.dumps({**head, 'object': kind, 'choices': [first]})}\n\n"
    yield f"data: {json.dumps({**head, 'object': kind, 'choices': [last], 'usage': usage})}\n\n"
    yield "data: [DONE]\n\n"


def _without_calls(text: str) -> str:
    return HERMES.sub("", text).strip()


def error_response(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": AGENT_REQUEST}}, status_code=status
    )
