"""An OpenAI-compatible endpoint over keel's engine service, for agent code and environment
libraries written against an OpenAI client: `/v1/chat/completions` and `/v1/completions`
(streamed or not), `/v1/models`. Starlette serves it under uvicorn, as vLLM's and SGLang's
servers are served (pydantic-free, so it runs where keel's GPU machines run).

Every request belongs to a sample, named by the `X-Keel-Sample` header or else the request's
`model`: the engine keeps the sample's KV cache across its turns and `traces[sample]` records the
exact prompt and sampled tokens with their log-probs (trace.py), which is what gets trained.

A chat turn that repeats the conversation so far with the answer keel gave, then adds tool or user
messages, continues the sampled tokens (the template's text after the answer's stop token, as
keel's own agent loop does): the answer is never re-encoded from text. Anything else is rendered
whole; if that does not extend the sample's tokens, the trace counts a prefix break.

Requests are hostile input: a bearer token when set, bodies bounded in size, requests in flight
bounded, the endpoint on loopback unless told otherwise; a client that goes away mid-answer costs
its own turn only.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
import uuid

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from keel.errors import AGENT_REQUEST
from keel.rollout.agent.external.trace import Trace, comparable
from keel.rollout.agent.parse import HERMES, PARSERS
from keel.rollout.agent.template import TurnTemplate

SAMPLING_KEYS = ("temperature", "top_p", "top_k")
# the error type of a turn refused because its sample's budget is spent
BUDGET_SPENT = "context_length_exceeded"


class RequestError(Exception):
    """`kind`: OpenAI's error type; context_length_exceeded is what clients (verifiers, ...) read as a
    rollout that reached its length, not as a failure."""

    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.kind = status, kind


class OpenAIEndpoint:
    """The endpoint's handlers over an EngineService (service.py); `serve` runs it in a thread."""

    def __init__(
        self,
        service,
        tokenizer,
        token: str | None = None,
        max_request_bytes: int = 4 << 20,
        max_in_flight: int = 1024,
        tool_format: str = "hermes",
        budget: int | None = None,
    ):
        """`budget`: the tokens a sample may add after its first prompt, over all its turns
        (data.max_response_length in training); None: each turn within the service's limit only."""
        self.service, self.tokenizer, self.token, self.budget = service, tokenizer, token, budget
        self.max_request_bytes, self.parse = max_request_bytes, PARSERS[tool_format]
        self.in_flight = asyncio.Semaphore(max_in_flight)
        self.traces: dict[str, Trace] = {}
        # handlers add and record traces; take_traces pickles them elsewhere
        self.traces_lock = threading.Lock()
        # by the tools' schema
        self.templates: dict[str, TurnTemplate] = {}
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
            ]
        )
        self._server = None

    # --- serving --------------------------------------------------------------------------------
    def serve(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Start serving in a thread -> the base URL (`.../v1`); port 0: a free one."""
        import uvicorn

        config = uvicorn.Config(
            self.app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=5,
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, name="keel-openai", daemon=True)
        self._thread.start()
        # bound by uvicorn's own startup, which fails loudly
        while not self._server.started:
            if not self._thread.is_alive():
                raise RuntimeError(f"keel's endpoint could not listen on {host}:{port}")
            time.sleep(0.01)
        bound = self._server.servers[0].sockets[0].getsockname()
        return f"http://{bound[0]}:{bound[1]}/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join()

    def take_traces(self) -> bytes:
        """The traces so far, pickled while no handler writes to them, and a fresh set in their place
        (a late request of a sample already taken starts a trace nobody collects)."""
        with self.traces_lock:
            traces, self.traces = self.traces, {}
            return pickle.dumps(traces)

    # --- handlers -------------------------------------------------------------------------------
    async def models(self, request: Request):
        if not self._authorised(request):
            return _error("a bearer token is required", 401)
        return JSONResponse(
            {"object": "list", "data": [{"id": "keel", "object": "model", "owned_by": "keel"}]}
        )

    async def chat(self, request: Request):
        return await self._handle(request, self._chat_prompt, chat=True)

    async def completions(self, request: Request):
        return await self._handle(request, self._text_prompt, chat=False)

    async def _handle(self, request: Request, prompt_of, chat: bool):
        if not self._authorised(request):
            return _error("a bearer token is required", 401)
        if self.in_flight.locked():
            return _error("too many requests in flight", 429)
        async with self.in_flight:
            try:
                body = await self._body(request)
                sample = request.headers.get("x-keel-sample") or body.get("model")
                if not isinstance(sample, str) or not sample:
                    raise RequestError(
                        "no sample: send the X-Keel-Sample header or the model name keel gave"
                    )
                with self.traces_lock:
                    trace = self.traces.setdefault(sample, Trace())
                # reads the trace: no lock, no tokenizing under one
                prompt, conversation = prompt_of(body, trace)
                limit = self._within_budget(self._limit(body), trace, prompt)
                completion = await asyncio.wrap_future(self.service.submit(sample, prompt, limit))
            except RequestError as error:
                return _error(str(error), error.status, error.kind)
            # the engine service's refusal (a turn that cannot fit)
            except ValueError as error:
                return _error(str(error), 400)
            # the service closed: the rollout is over (or the engine failed)
            except RuntimeError as error:
                return _error(str(error), 503)
            except ClientDisconnect:
                return _error("the client went away", 400)
            answer = self._answer(completion, chat)
            with self.traces_lock:
                trace.record(prompt, completion.ids, completion.log_probs, completion.stopped)
                if chat:
                    trace.messages = conversation + [comparable(answer["message"])]
            return self._respond(body, answer, chat, len(prompt), len(completion.ids))

    async def _body(self, request: Request) -> dict:
        declared = request.headers.get("content-length")
        if declared is not None and (
            not declared.isdigit() or int(declared) > self.max_request_bytes
        ):
            raise RequestError(f"the body is over {self.max_request_bytes} bytes", 413)
        raw = b""
        async for chunk in request.stream():
            raw += chunk
            if len(raw) > self.max_request_bytes:
                raise RequestError(f"the body is over {self.max_request_bytes} bytes", 413)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as error:
            raise RequestError(f"the body is not JSON: {error}") from None
        if not isinstance(body, dict):
            raise RequestError("the body is not a JSON object")
        return body

    def _limit(self, body: dict) -> int:
        """The turn's token limit, after refusing settings the engine's graphs do not hold."""
        params = self.service.params
        for key in SAMPLING_KEYS:
            if body.get(key) is not None and body[key] != getattr(params, key):
                raise RequestError(
                    f"{key}={body[key]!r} differs from the rollout's {getattr(params, key)!r}"
                )
        if body.get("n", 1) != 1:
            raise RequestError("n must be 1: each sample sends its own requests")
        _, _, budget = self.service.shape
        limit = next(
            (body[k] for k in ("max_completion_tokens", "max_tokens") if body.get(k) is not None),
            budget,
        )
        if not isinstance(limit, int) or isinstance(limit, bool) or not 0 < limit <= budget:
            raise RequestError(
                f"max_tokens must be a whole number from 1 to the rollout's {budget}"
            )
        return limit

    def _within_budget(self, limit: int, trace: Trace, prompt: list[int]) -> int:
        """The turn's limit within what the sample's budget leaves after `prompt`."""
        if self.budget is None:
            return limit
        first = trace.stretches[0].prompt if trace.stretches else prompt
        left = self.budget - (len(prompt) - len(first) if prompt[: len(first)] == first else 0)
        if left <= 0:
            trace.budget_spent = True
            raise RequestError(
                f"the sample's budget of {self.budget} tokens (data.max_response_length) is spent: its context "
                "length is at the rollout's limit",
                kind=BUDGET_SPENT,
            )
        return min(limit, left)

    def _chat_prompt(self, body: dict, trace: Trace) -> tuple[list[int], list[dict]]:
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
        except Exception as error:  # noqa: BLE001 - jinja's (or keel's template check's) errors on a malformed conversation
            raise RequestError(f"the chat template refused the messages: {error}") from None
        return self.tokenizer.encode(text, add_special_tokens=False), conversation

    def _text_prompt(self, body: dict, trace: Trace) -> tuple[list[int], None]:
        prompt = body.get("prompt")
        if isinstance(prompt, str) and prompt:
            return self.tokenizer.encode(prompt, add_special_tokens=False), None
        vocab = len(self.tokenizer)
        if (
            isinstance(prompt, list)
            and prompt
            and all(isinstance(t, int) and 0 <= t < vocab for t in prompt)
        ):
            return list(prompt), None
        raise RequestError("prompt must be a non-empty string or a non-empty list of token ids")

    def _template(self, tools) -> TurnTemplate:
        key = json.dumps(tools, sort_keys=True)
        if key not in self.templates:
            self.templates[key] = TurnTemplate(self.tokenizer, tools, sorted(self.service.stop_ids))
        return self.templates[key]

    def _answer(self, completion, chat: bool) -> dict:
        text = self.tokenizer.decode(completion.ids, skip_special_tokens=True)
        reason = "stop" if completion.stopped else "length"
        if not chat:
            return {"text": text, "finish_reason": reason}
        calls = self.parse(text).calls
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

    def _respond(
        self, body: dict, answer: dict, chat: bool, prompt_tokens: int, completion_tokens: int
    ):
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

    def _authorised(self, request: Request) -> bool:
        return self.token is None or request.headers.get("authorization") == f"Bearer {self.token}"


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


def _error(message: str, status: int, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "code": AGENT_REQUEST}}, status_code=status
    )
