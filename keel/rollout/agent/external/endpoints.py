"""Where keel's OpenAI endpoint (openai_server.py) runs during rollouts: a thread of the engine's
process (InProcessEndpoint), or processes of its own (EndpointProcesses,
`actor_rollout_ref.rollout.agent.endpoint_processes`), as vLLM splits its API servers from its
engine. Each endpoint process parses requests, renders and tokenizes the conversation, keeps the
samples' traces and answers in JSON; the engine's process only receives token ids and sends sampled
ones back. A wave of turns (every sample's next request, arriving together) is then read by several
processes at once instead of one thread in turn, so the engine gets the wave's turns close together
and prefills and decodes them as one batch.

Each process serves for the rollout object's life (spawned once: a tokenizer and a web server
take seconds to start). Per rollout the engine's process `begin`s them over that rollout's
EngineService and `collect`s their traces at its end. A sample's requests all go to one process
(its agent's), so its trace is whole in one place.

Messages over each process's pipe (pickled, a few small ones a turn):
  engine -> endpoint: ("begin", settings), ("answer", n, completion, error), ("collect",), ("stop",)
  endpoint -> engine: ("ready", url) | ("failed", error), ("turn", n, key, context, limit),
  ("traces", traces)
"""

from __future__ import annotations

import itertools
import multiprocessing
import pickle
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from types import SimpleNamespace

from keel.errors import AGENT_FUNCTION, KeelError

# a process that has not said it listens by then is said to have failed
START_S = 120.0


@dataclass
class EndpointSettings:
    """What an endpoint process is told at the start of each rollout."""

    temperature: float
    top_p: float
    top_k: int
    # the engine service's (sequences, max_len, turn_tokens)
    shape: tuple[int, int, int]
    stop_ids: list[int]
    budget: int | None


class RemoteService:
    """In an endpoint process: what OpenAIEndpoint needs of an EngineService, each turn sent to the
    engine's process and answered from it."""

    def __init__(self, connection):
        self.connection, self.lock = connection, threading.Lock()
        # before the first rollout: settings no request matches (refused with a 400, never a 500)
        self.params = SimpleNamespace(temperature=None, top_p=None, top_k=None)
        self.shape, self.stop_ids = (0, 0, 0), set()
        # between a begin and a collect
        self.open = False
        self.waiting: dict[int, Future] = {}
        self.numbers = itertools.count()

    def submit(self, key, context: list[int], limit: int) -> Future:
        future: Future = Future()
        # a turn is sent before the rollout's collect, or refused
        with self.lock:
            if not self.open:
                future.set_exception(RuntimeError("no rollout is under way: its requests are over"))
                return future
            number = next(self.numbers)
            self.waiting[number] = future
            self.connection.send(("turn", number, key, list(context), limit))
        return future

    def begin(self, settings: EndpointSettings) -> None:
        """The rollout's settings, then its requests are served; said back, so the engine's process
        starts the agents only once this process takes their requests."""
        self.params = SimpleNamespace(
            temperature=settings.temperature, top_p=settings.top_p, top_k=settings.top_k
        )
        self.shape, self.stop_ids = settings.shape, set(settings.stop_ids)
        with self.lock:
            self.open = True
            self.connection.send(("begun",))

    def answer(self, number: int, completion, error: BaseException | None) -> None:
        future = self.waiting.pop(number, None)
        if future is not None and not future.done():
            future.set_exception(error) if error is not None else future.set_result(completion)

    def collect(self, traces: bytes) -> None:
        """`traces`: pickled, taken while no handler wrote to them (OpenAIEndpoint.take_traces)."""
        with self.lock:
            self.open = False
            self.connection.send(("traces", traces))


def _serve(connection, tokenizer, options: dict) -> None:
    """An endpoint process: serve until told to stop, one rollout after another."""
    from keel.rollout.agent.external.openai_server import OpenAIEndpoint

    service = RemoteService(connection)
    try:
        endpoint = OpenAIEndpoint(service, tokenizer, **options["endpoint"])
        connection.send(("ready", endpoint.serve(options["host"])))
    except BaseException as error:  # noqa: BLE001 - said to the engine's process, which raises it
        connection.send(
            ("failed", RuntimeError(f"keel's endpoint process could not start: {error!r}"))
        )
        return
    try:
        while (message := connection.recv())[0] != "stop":
            if message[0] == "answer":
                service.answer(*message[1:])
            elif message[0] == "begin":
                # a previous rollout's late requests, if any: not this one's
                endpoint.take_traces()
                endpoint.budget = message[1].budget
                service.begin(message[1])
            elif message[0] == "collect":
                service.collect(endpoint.take_traces())
    # the engine's process went away
    except EOFError:
        pass
    finally:
        endpoint.close()


class InProcessEndpoint:
    """The endpoint as a thread of the engine's process, started for each rollout
    (endpoint_processes=0)."""

    def __init__(self, tokenizer, host: str, token: str, max_in_flight: int):
        self.tokenizer, self.host, self.token, self.max_in_flight = (
            tokenizer,
            host,
            token,
            max_in_flight,
        )
        self.endpoint = None

    def begin(self, service, budget: int | None) -> list[str]:
        from keel.rollout.agent.external.openai_server import OpenAIEndpoint

        self.endpoint = OpenAIEndpoint(
            service,
            self.tokenizer,
            token=self.token,
            budget=budget,
            max_in_flight=self.max_in_flight,
        )
        return [self.endpoint.serve(self.host)]

    def collect(self) -> dict:
        """After the rollout's service closed (a request still waiting is answered, so the server
        can stop)."""
        if self.endpoint is None:
            return {}
        self.endpoint.close()
        endpoint, self.endpoint = self.endpoint, None
        return endpoint.traces

    def close(self) -> None:
        self.collect()


class EndpointProcesses:
    """`count` endpoint processes; `begin(service, budget)` -> their URLs, `collect()` -> the
    traces."""

    def __init__(self, tokenizer, count: int, host: str, token: str, max_in_flight: int):
        # not fork: the parent holds threads and CUDA
        context = multiprocessing.get_context("spawn")
        self.token, self.bridges = token, []
        options = {"host": host, "endpoint": {"token": token, "max_in_flight": max_in_flight}}
        self.connections, self.processes = [], []
        for i in range(count):
            ours, theirs = context.Pipe()
            process = context.Process(
                target=_serve,
                args=(theirs, tokenizer, options),
                name=f"keel-endpoint-{i}",
                daemon=True,
            )
            process.start()
            theirs.close()
            self.connections.append(ours)
            self.processes.append(process)
        self.urls = [self._ready(c, p) for c, p in zip(self.connections, self.processes)]
        self.locks = [threading.Lock() for _ in self.connections]

    def _ready(self, connection, process) -> str:
        if not connection.poll(START_S):
            raise KeelError(AGENT_FUNCTION, f"{process.name} did not start within {START_S:.0f} s")
        try:
            kind, payload = connection.recv()
        except EOFError:
            raise KeelError(
                AGENT_FUNCTION, f"{process.name} exited (code {process.exitcode}) while starting"
            ) from None
        if kind == "failed":
            raise KeelError(AGENT_FUNCTION, str(payload))
        return payload

    def begin(self, service, budget: int | None) -> list[str]:
        """Serve this rollout's turns from `service` -> the processes' base URLs, once every process
        said it takes the rollout's requests."""
        params = service.params
        settings = EndpointSettings(
            params.temperature,
            params.top_p,
            params.top_k,
            service.shape,
            sorted(service.stop_ids),
            budget,
        )
        for i in range(len(self.connections)):
            self._send(i, ("begin", settings))
        # nothing else comes before it: no rollout is open
        for i, connection in enumerate(self.connections):
            if not connection.poll(START_S) or self._received(i) != ("begun",):
                self._broke(i)
        self.bridges = [_Bridge(c, lock, service) for c, lock in zip(self.connections, self.locks)]
        for bridge in self.bridges:
            bridge.start()
        return self.urls

    def collect(self) -> dict:
        """After the rollout's service closed: every process's traces, merged (a sample's are in
        one). Every process is asked and waited for, then the first that broke off is said."""
        traces, broken = {}, []
        for i, bridge in enumerate(self.bridges):
            try:
                self._send(i, ("collect",))
            except KeelError:
                broken.append(i)
                continue
            bridge.join()
            if bridge.error is not None:
                broken.append(i)
            traces.update(pickle.loads(bridge.traces) if bridge.traces else {})
        self.bridges = []
        if broken:
            self._broke(broken[0])
        return traces

    def _received(self, i: int):
        try:
            return self.connections[i].recv()
        except (EOFError, OSError):
            return None

    def close(self) -> None:
        for i in range(len(self.connections)):
            try:
                self._send(i, ("stop",))
            # already gone
            except KeelError:
                pass
        for process in self.processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()

    def _send(self, i: int, message) -> None:
        try:
            with self.locks[i]:
                self.connections[i].send(message)
        except OSError:
            self._broke(i)

    def _broke(self, i: int):
        process = self.processes[i]
        process.join(timeout=5)
        raise KeelError(
            AGENT_FUNCTION,
            f"endpoint process {process.name} broke off the rollout (exit code {process.exitcode})",
            "run with actor_rollout_ref.rollout.agent.endpoint_processes=0 to serve the endpoint "
            "from the engine's process and see its own error there",
        )


class _Bridge(threading.Thread):
    """In the engine's process, one an endpoint process for a rollout: its turns into the service,
    each answer back as the service gives it; ends with the process's traces."""

    def __init__(self, connection, lock, service):
        super().__init__(name="keel-endpoint-bridge", daemon=True)
        self.connection, self.lock, self.service = connection, lock, service
        # pickled by the endpoint process
        self.traces: bytes | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while (message := self.connection.recv())[0] == "turn":
                _, number, key, context, limit = message
                future = self.service.submit(key, context, limit)
                future.add_done_callback(lambda done, number=number: self._reply(number, done))
            self.traces = message[1]
        except (EOFError, OSError) as error:
            self.error = error

    def _reply(self, number: int, done: Future) -> None:
        error = done.exception()
        # plain types only: the engine's own (CUDA, ...) may not cross a pipe
        if error is not None:
            error = (ValueError if isinstance(error, ValueError) else RuntimeError)(str(error))
        try:
            with self.lock:
                self.connection.send(("answer", number, None if error else done.result(), error))
        # the endpoint process is gone: collect says so
        except OSError:
            pass
