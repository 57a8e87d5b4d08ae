"""A reward service over HTTP: `keel reward-server` and the client the trainer uses.

Protocol (JSON): `GET /health` -> {"status": "ok"}; `POST /score` with {"request_id": str,
"samples": [{"data_source", "response", "ground_truth", "extra_info"}]} -> {"request_id",
"scores": [float], "reasons": [str | null]} (a reason marks a sample not scored). Errors are 4xx
with {"error": ...}. The client retries with backoff; after the retries every sample of the batch
is not scored with the reason, and the trainer's reward.on_error policy decides: never a silent
drop.
"""

from __future__ import annotations

import http.client
import json
import logging
import threading
import time
import urllib.error
import urllib.request
import uuid
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

from keel.errors import SERVICE_UNAVAILABLE, KeelError
from keel.rewards.worker import NotANumber, SampleResult, as_number

log = logging.getLogger("keel")

FIELDS = ("data_source", "response", "ground_truth")


# --- server -----------------------------------------------------------------------------------


def make_server(
    scorer,
    host: str = "127.0.0.1",
    port: int = 8000,
    token: str | None = None,
    max_request_bytes: int = 8 << 20,
    max_concurrency: int = 8,
    inject: list[str] | None = None,
    queue_timeout_s: float = 60.0,
) -> ThreadingHTTPServer:
    """`inject`: faults answered to the first POST /score requests, in order (`500`, `malformed`
    JSON, `slow`: 60 s of silence), for testing a client's handling of a failing service."""
    return _Server(
        (host, port),
        _ScoreHandler,
        scorer,
        token,
        max_request_bytes,
        max_concurrency,
        inject or [],
        queue_timeout_s,
    )


class _ScoreHandler(BaseHTTPRequestHandler):
    """GET /health and POST /score; its settings are the server's (`self.server`)."""

    # one line per request is noise in a training log
    def log_message(self, *args) -> None:
        pass

    def reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def authorised(self) -> bool:
        token = self.server.token
        if token and self.headers.get("Authorization") != f"Bearer {token}":
            self.reply(HTTPStatus.UNAUTHORIZED, {"error": "missing or wrong bearer token"})
            return False
        return True

    def body_length(self) -> int | None:
        """Content-Length, checked before a byte is read: missing, negative, not a number or over
        the limit is answered 4xx (a negative length once made the server read without end)."""
        raw = self.headers.get("Content-Length")
        raw = raw.strip() if raw is not None else None
        if raw is None or not (raw.isascii() and raw.isdigit() and len(raw) <= 18):
            self.reply(
                HTTPStatus.LENGTH_REQUIRED,
                {"error": f"Content-Length must be a byte count, got {raw!r}"},
            )
            return None
        length, limit = int(raw), self.server.max_request_bytes
        if length > limit:
            self.reply(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                {"error": f"request of {length} bytes is over {limit}"},
            )
            return None
        return length

    def do_GET(self) -> None:
        if not self.authorised():
            return
        if self.path != "/health":
            return self.reply(HTTPStatus.NOT_FOUND, {"error": "GET /health or POST /score"})
        self.reply(HTTPStatus.OK, {"status": "ok"})

    def do_POST(self) -> None:
        if not self.authorised():
            return
        if self.path != "/score":
            return self.reply(HTTPStatus.NOT_FOUND, {"error": "GET /health or POST /score"})
        length = self.body_length()
        if length is None:
            return
        try:
            request = parse_request(self.rfile.read(length))
        except ValueError as e:
            return self.reply(HTTPStatus.BAD_REQUEST, {"error": f"malformed request: {e}"})
        server = self.server
        # a burst waits; a flood is told to back off
        if not server.busy.acquire(timeout=server.queue_timeout_s):
            return self.reply(
                HTTPStatus.TOO_MANY_REQUESTS,
                {
                    "error": f"over {server.max_concurrency} requests at once for "
                    f"{server.queue_timeout_s} s"
                },
            )
        try:
            if not self.answered_with_fault(server.next_fault()):
                self.reply(HTTPStatus.OK, score_request(server.scorer, request))
        # a bug on the server: the client retries a 500
        except Exception as e:
            self.reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": f"{type(e).__name__}: {e}"})
        finally:
            server.busy.release()

    def answered_with_fault(self, fault: str | None) -> bool:
        """An injected fault: answered here (True), or (slow) a delay before the real answer."""
        if fault == "500":
            self.reply(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": "injected fault"})
            return True
        if fault == "malformed":
            self.send_response(HTTPStatus.OK)
            self.end_headers()
            self.wfile.write(b"{not json")
            return True
        if fault == "slow":
            time.sleep(60)
        return False


class _Server(ThreadingHTTPServer):
    # the listen backlog: socketserver's 5 reset connections under a burst
    request_queue_size = 1024
    daemon_threads = True

    def __init__(
        self,
        address,
        handler,
        scorer,
        token: str | None,
        max_request_bytes: int,
        max_concurrency: int,
        faults: list[str],
        queue_timeout_s: float,
    ):
        self.scorer, self.token, self.max_request_bytes = scorer, token, max_request_bytes
        self.max_concurrency, self.queue_timeout_s = max_concurrency, queue_timeout_s
        self.busy = threading.BoundedSemaphore(max_concurrency)
        self._faults, self._faults_lock = list(faults), threading.Lock()
        super().__init__(address, handler)

    def next_fault(self) -> str | None:
        with self._faults_lock:
            return self._faults.pop(0) if self._faults else None


def parse_request(body: bytes) -> dict:
    """A /score body: {"samples": [{data_source, response, ground_truth, ...}, ...]}, or
    ValueError."""
    try:
        request = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"not JSON: {e}") from None
    samples = request.get("samples") if isinstance(request, dict) else None
    if not isinstance(samples, list) or not all(isinstance(sample, dict) for sample in samples):
        raise ValueError('the body must be {"samples": [{...}, ...]}')
    missing = sorted({f for sample in samples for f in FIELDS if f not in sample})
    if missing:
        raise ValueError(f"samples lack {missing}")
    if not all(isinstance(sample["response"], str) for sample in samples):
        raise ValueError("every response must be a string")
    return request


def score_request(scorer, request: dict) -> dict:
    records = [
        SimpleNamespace(
            data_source=s["data_source"],
            ground_truth=s["ground_truth"],
            extra_info=s.get("extra_info") or {},
            raw_prompt=s.get("prompt"),
            index=i,
        )
        for i, s in enumerate(request["samples"])
    ]
    result = scorer.score_batch(
        records, [s["response"] for s in request["samples"]], on_error="zero"
    )
    reasons = result.reasons
    return {
        "request_id": request.get("request_id"),
        "scores": result.scores.tolist(),
        "reasons": reasons,
    }


# --- client -----------------------------------------------------------------------------------

MAX_REPLY_BYTES = 16 << 20


class BadReply(ValueError):
    """A /score answer that does not fit the request: another shape, length or request id."""


def read_scores(body, request_id: str, count: int) -> tuple[list[float | None], list[str | None]]:
    """The scores and reasons of a /score answer, checked: the server is not trusted to be right.
    A score that is not a finite number is that sample's reason, never a number."""
    if not isinstance(body, dict):
        raise BadReply(f"a JSON {type(body).__name__}, not an object")
    scores, reasons = body.get("scores"), body.get("reasons", [None] * count)
    if body.get("request_id") != request_id:
        raise BadReply("another request's id")
    if (
        not isinstance(scores, list)
        or not isinstance(reasons, list)
        or len(scores) != count
        or len(reasons) != count
    ):
        raise BadReply(f"{count} scores and reasons expected")
    checked_scores, checked_reasons = [], []
    for score, reason in zip(scores, reasons):
        if reason is None:
            try:
                score, reason = as_number(score), None
            except NotANumber as e:
                score, reason = None, str(e)
        checked_scores.append(score)
        checked_reasons.append(None if reason is None else str(reason)[:200])
    return checked_scores, checked_reasons


class RewardServiceClient:
    """Scores batches on a keel reward service, with retries; failures become not-scored samples."""

    def __init__(
        self,
        url: str,
        timeout_s: float = 30.0,
        retry_times: int = 3,
        retry_delay_s: float = 1.0,
        token: str | None = None,
    ):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retry_times = retry_times
        self.retry_delay_s = retry_delay_s
        self.token = token
        # over the run, for the metrics
        self.retries = 0

    def check_health(self, start: str | None = None) -> None:
        """`start`: the fix when nothing answers (the command that serves the config's scorer
        there)."""
        try:
            body = self._call("GET", "/health", None, timeout=min(self.timeout_s, 10.0))
        # any failure to reach it: say where and why, before training starts
        except Exception as e:
            raise KeelError(
                SERVICE_UNAVAILABLE,
                f"the reward service at {self.url} is not healthy: {type(e).__name__}: {e}",
                start,
            ) from e
        if not isinstance(body, dict) or body.get("status") != "ok":
            raise KeelError(
                SERVICE_UNAVAILABLE,
                f"{self.url}/health answered {str(body)[:200]}",
                'serve GET /health with {"status": "ok"} (keel reward-server does), or fix '
                "reward.service.url",
            )

    def score(self, records: list, responses: list[str]) -> list[SampleResult]:
        request = {
            "request_id": uuid.uuid4().hex,
            "samples": [
                {
                    "data_source": r.data_source,
                    "response": text,
                    "ground_truth": r.ground_truth,
                    "extra_info": r.extra_info,
                    "prompt": getattr(r, "raw_prompt", None),
                }
                for r, text in zip(records, responses)
            ],
        }
        start = time.perf_counter()
        error, retried = "no attempt", 0
        for attempt in range(self.retry_times + 1):
            if attempt:
                retried = attempt
                self.retries += 1
                # exponential backoff
                delay = self.retry_delay_s * 2 ** (attempt - 1)
                log.warning(
                    "reward service %s: %s; retry %d of %d in %.1f s",
                    self.url,
                    error,
                    attempt,
                    self.retry_times,
                    delay,
                )
                time.sleep(delay)
            try:
                body = self._call("POST", "/score", request, timeout=self.timeout_s)
                scores, reasons = read_scores(body, request["request_id"], len(records))
            except urllib.error.HTTPError as e:
                error = f"HTTP {e.code}"
                if 400 <= e.code < 500 and e.code != HTTPStatus.TOO_MANY_REQUESTS:
                    # the request itself is wrong: retrying would not help
                    error += " not retried"
                    break
            # Whatever the server or the network did: refused, reset, timed out, a broken status
            # line, a truncated body, JSON of the wrong shape. Retried, then not scored, with why.
            except (OSError, http.client.HTTPException, ValueError) as e:
                error = "timeout" if "timed out" in str(e) else f"{type(e).__name__}"
                if isinstance(e, BadReply):
                    error = f"bad reply ({e})"
            else:
                seconds = (time.perf_counter() - start) / max(len(records), 1)
                return [
                    SampleResult(None, f"service: {reason}", seconds)
                    if reason
                    else SampleResult({"service": score}, None, seconds)
                    for score, reason in zip(scores, reasons)
                ]
        seconds = (time.perf_counter() - start) / max(len(records), 1)
        failure = error if error.endswith("not retried") else f"{error} after {retried} retries"
        return [SampleResult(None, f"service {failure} ({SERVICE_UNAVAILABLE})", seconds)] * len(
            records
        )

    def _call(self, method: str, path: str, payload: dict | None, timeout: float) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        data = json.dumps(payload).encode() if payload is not None else None
        request = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        with urllib.request.urlopen(request, timeout=timeout) as response:
            # a server that never stops sending costs no memory
            body = response.read(MAX_REPLY_BYTES + 1)
        if len(body) > MAX_REPLY_BYTES:
            raise BadReply(f"over {MAX_REPLY_BYTES} bytes")
        return json.loads(body)
