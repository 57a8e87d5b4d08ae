"""An OpenAI-compatible endpoint over keel's engine service, for agent code and environment
libraries written against an OpenAI client: `/v1/chat/completions` and `/v1/completions`
(streamed or not), `/v1/models`, and the token-level `/inference/v1/generate` (token ids in and
out, as vLLM's and verifiers' TrainClient's; generate_requests.py). Starlette serves it under
uvicorn, as vLLM's and SGLang's servers are served (pydantic-free, so it runs where keel's GPU
machines run).

Every request belongs to a sample, named by the `X-Keel-Sample` header or else the request's
`model`: the engine keeps the sample's KV cache across its turns and `traces[sample]` records the
exact prompt and sampled tokens with their log-probs (trace.py), which is what gets trained.

A request's body, limit and prompt are read by openai_requests.py (a continuing chat turn's tokens
are the sampled ones, never re-encoded from text); its answer is written by openai_responses.py.

Requests are hostile input: a bearer token when set, bodies bounded in size, requests in flight
bounded, the endpoint on loopback unless told otherwise; a client that goes away mid-answer costs
its own turn only.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time

from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from keel.rollout.agent.external.generate_requests import GenerateReader, generate_answer
from keel.rollout.agent.external.openai_requests import (
    PromptReader,
    RequestError,
    read_body,
    within_budget,
)
from keel.rollout.agent.external.openai_responses import answer_of, error_response, response
from keel.rollout.agent.external.trace import Trace, comparable
from keel.rollout.agent.parse import PARSERS


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
        self.prompts = PromptReader(service, tokenizer)
        self.generate_reader = GenerateReader(service, len(tokenizer))
        self.tokenizer_path = str(getattr(tokenizer, "name_or_path", "") or "")
        self.app = Starlette(
            routes=[
                Route("/v1/chat/completions", self.chat, methods=["POST"]),
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/inference/v1/generate", self.generate, methods=["POST"]),
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
        """The traces so far, pickled while no handler writes to them, and a fresh set in their
        place (a late request of a sample already taken starts a trace nobody collects)."""
        with self.traces_lock:
            traces, self.traces = self.traces, {}
            return pickle.dumps(traces)

    # --- handlers -------------------------------------------------------------------------------
    async def models(self, request: Request):
        if not self._authorised(request):
            return error_response("a bearer token is required", 401)
        # root: the policy's tokenizer, as vLLM names its model's (clients that render prompts to
        # token ids themselves, verifiers' TrainClient, load it from there)
        card = {"id": "keel", "object": "model", "owned_by": "keel", "root": self.tokenizer_path}
        return JSONResponse({"object": "list", "data": [card]})

    async def chat(self, request: Request):
        return await self._handle(request, self.prompts.chat_prompt, chat=True)

    async def completions(self, request: Request):
        return await self._handle(request, self.prompts.text_prompt, chat=False)

    async def generate(self, request: Request):
        """Token ids in, sampled token ids and their log-probs out; the trace records them as they
        are."""
        return await self._handle(request, self.generate_reader.prompt, chat=None)

    async def _handle(self, request: Request, prompt_of, chat: bool | None):
        """`chat`: True a chat turn, False a text completion, None a token-level generate."""
        if not self._authorised(request):
            return error_response("a bearer token is required", 401)
        if self.in_flight.locked():
            return error_response("too many requests in flight", 429)
        async with self.in_flight:
            try:
                body = await read_body(request, self.max_request_bytes)
                sample = request.headers.get("x-keel-sample") or body.get("model")
                if not isinstance(sample, str) or not sample:
                    raise RequestError(
                        "no sample: send the X-Keel-Sample header or the model name keel gave"
                    )
                with self.traces_lock:
                    trace = self.traces.setdefault(sample, Trace())
                # reads the trace: no lock, no tokenizing under one
                prompt, conversation = prompt_of(body, trace)
                limit_of = self.generate_reader.limit if chat is None else self.prompts.limit
                limit = within_budget(self.budget, limit_of(body), trace, prompt)
                completion = await asyncio.wrap_future(self.service.submit(sample, prompt, limit))
            except RequestError as error:
                return error_response(str(error), error.status, error.kind)
            # the engine service's refusal (a turn that cannot fit)
            except ValueError as error:
                return error_response(str(error), 400)
            # the service closed: the rollout is over (or the engine failed)
            except RuntimeError as error:
                return error_response(str(error), 503)
            except ClientDisconnect:
                return error_response("the client went away", 400)
            if chat is None:
                with self.traces_lock:
                    trace.record(prompt, completion.ids, completion.log_probs, completion.stopped)
                    # the tokens now run past any conversation a later chat turn could continue
                    trace.messages = None
                return JSONResponse(generate_answer(body, prompt, completion))
            answer = self._answer(completion, chat)
            with self.traces_lock:
                trace.record(prompt, completion.ids, completion.log_probs, completion.stopped)
                if chat:
                    trace.messages = conversation + [comparable(answer["message"])]
            return response(body, answer, chat, len(prompt), len(completion.ids))

    def _answer(self, completion, chat: bool) -> dict:
        """The completion as OpenAI's choice, its tool calls read by the endpoint's parser."""
        return answer_of(completion, chat, self.tokenizer, self.parse)

    def _authorised(self, request: Request) -> bool:
        return self.token is None or request.headers.get("authorization") == f"Bearer {self.token}"
