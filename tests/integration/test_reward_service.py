"""Fault injection against a real `keel reward-server` on 127.0.0.1: every failure ends as
retried-and-recovered or as counted not-scored samples, never as a silently dropped batch."""

import json
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from types import SimpleNamespace

import pytest

from keel.errors import SERVICE_UNAVAILABLE, KeelError
from keel.rewards.reward_fn import RewardScorer
from keel.rewards.service import RewardServiceClient

SCORER = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str == "slow":
        time.sleep(3)
    return float(solution_str == str(ground_truth))
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(path, port, *extra) -> subprocess.Popen:
    return launch(port, "--custom", f"{path}:compute_score", *extra)


def launch(port, *flags) -> subprocess.Popen:
    """`keel reward-server` with these flags, once /health answers."""
    process = subprocess.Popen(
        [sys.executable, "-m", "keel", "reward-server", "--port", str(port), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    token = flags[flags.index("--token") + 1] if "--token" in flags else None
    # a long limit: a loaded machine starts it slowly
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            RewardServiceClient(f"http://127.0.0.1:{port}", token=token).check_health()
            return process
        except KeelError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError(process.stderr.read().decode())


@contextmanager
def serving(tmp_path, *extra):
    """A keel reward-server with these flags, for one test: its URL."""
    path = tmp_path / "scorer.py"
    path.write_text(SCORER)
    port = free_port()
    process = start_server(path, port, *extra)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        process.kill()
        process.wait()


@pytest.fixture
def server(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text(SCORER)
    port = free_port()
    process = start_server(path, port)
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", port=port, path=path, process=process)
    process.kill()
    process.wait()


def rows(n):
    return [
        SimpleNamespace(data_source="any", ground_truth="7", extra_info={}, raw_prompt="q", index=i)
        for i in range(n)
    ]


def test_scores_come_back_in_order(server):
    result = RewardServiceClient(server.url).score(rows(3), ["7", "8", "7"])
    assert [r.values["service"] if r.values else None for r in result] == [1.0, 0.0, 1.0]


def test_slow_endpoint_past_the_timeout_is_retried_then_not_scored(server, caplog):
    client = RewardServiceClient(server.url, timeout_s=1.0, retry_times=1, retry_delay_s=0.1)
    scorer = RewardScorer(service=client, max_not_scored_ratio=1.0)
    result = scorer.score_batch(rows(2), ["slow", "7"])
    # the whole request timed out: both samples counted, none dropped
    assert not result.scored.any()
    assert result.reasons[0] == "service timeout after 1 retries (KEEL-R008)"
    assert result.metrics["reward/not_scored/service_timeout_after_1_retries"] == 2
    assert (
        result.metrics["reward/not_scored_ratio"] == 1.0
        and result.metrics["reward/service_retries"] == 1
    )
    # the log says so too
    assert "retry 1 of 1" in caplog.text and "2 of 2 samples not scored" in caplog.text


def test_connection_refused_fails_the_health_check_and_marks_batches(tmp_path):
    client = RewardServiceClient(
        f"http://127.0.0.1:{free_port()}", timeout_s=1, retry_times=1, retry_delay_s=0.05
    )
    with pytest.raises(KeelError) as info:
        client.check_health()
    assert info.value.code == SERVICE_UNAVAILABLE
    result = client.score(rows(2), ["7", "7"])
    assert all(r.values is None and r.reason.startswith("service URLError") for r in result)


def test_server_restarted_mid_run_is_recovered_by_retries(server):
    # Retries until about 2 minutes after the kill: a restart on a loaded machine fits in that.
    client = RewardServiceClient(server.url, timeout_s=2, retry_times=8, retry_delay_s=0.5)
    server.process.kill()
    server.process.wait()
    restarted = {}
    threading.Thread(
        target=lambda: restarted.setdefault("p", start_server(server.path, server.port))
    ).start()
    try:
        result = client.score(rows(1), ["7"])
        assert result[0].values == {"service": 1.0} and client.retries >= 1
    finally:
        time.sleep(0.1)
        if "p" in restarted:
            restarted["p"].kill()


def test_bearer_token_bad_input_and_size_limits(tmp_path):
    path = tmp_path / "scorer.py"
    path.write_text(SCORER)
    port = free_port()
    process = start_server(path, port, "--token", "s3cret", "--max-request-bytes", "2000")
    url = f"http://127.0.0.1:{port}"
    try:
        assert (
            RewardServiceClient(url, retry_times=2).score(rows(1), ["7"])[0].reason
            == "service HTTP 401 not retried (KEEL-R008)"
        )
        assert RewardServiceClient(url, token="s3cret").score(rows(1), ["7"])[0].values == {
            "service": 1.0
        }

        def post(body: bytes) -> int:
            request = urllib.request.Request(
                url + "/score", data=body, method="POST", headers={"Authorization": "Bearer s3cret"}
            )
            try:
                urllib.request.urlopen(request, timeout=5)
            except urllib.error.HTTPError as e:
                return e.code
            return 200

        assert post(b"{not json") == 400
        # missing fields
        assert post(json.dumps({"samples": [{"response": "7"}]}).encode()) == 400
        assert (
            post(
                json.dumps(
                    {"samples": [{"data_source": "a", "response": "x" * 3000, "ground_truth": 1}]}
                ).encode()
            )
            == 413
        )
    finally:
        process.kill()


def test_http_500_and_malformed_json_are_retried(tmp_path):
    with serving(tmp_path, "--inject", "500,malformed") as url:
        client = RewardServiceClient(url, retry_times=3, retry_delay_s=0.05)
        result = client.score(rows(2), ["7", "8"])
        assert [r.values for r in result] == [
            {"service": 1.0},
            {"service": 0.0},
        ] and client.retries == 2


def test_keel_train_with_the_reward_service(server, tiny_config):
    from keel.api import train

    result = train(
        tiny_config, {"reward.service.url": server.url, "custom_reward_function.path": None}
    )
    assert result.last_step == 2 and result.last_metrics["reward/not_scored_ratio"] == 0.0


def test_the_servers_timeout_answers_for_a_slow_scorer(tmp_path):
    with serving(tmp_path, "--timeout-s", "0.5") as url:
        result = RewardServiceClient(url, timeout_s=60).score(rows(2), ["slow", "7"])
        assert result[0].values is None and result[0].reason == "service: timeout"
        assert result[1].values == {"service": 1.0}


def raw_exchange(port: int, request: bytes) -> bytes:
    """What the server answers to bytes sent as they are, with the connection left open."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as connection:
        connection.sendall(request)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = connection.recv(4096)
            if not chunk:
                break
            answer += chunk
        return answer


@pytest.mark.parametrize(
    "length_header",
    [
        "Content-Length: -1\r\n",
        "",
        "Content-Length: 1e9\r\n",
        "Content-Length: \u00b2\r\n",
        "Content-Length: " + "9" * 5000 + "\r\n",
    ],
)
def test_a_bad_content_length_is_refused_before_reading(server, length_header):
    head = f"POST /score HTTP/1.1\r\nHost: x\r\n{length_header}\r\n".encode()
    # then nothing: a reading server would hang
    answer = raw_exchange(server.port, head + b'{"samples": [')
    assert answer.split(b" ")[1] in (b"400", b"411")


def test_a_burst_of_1000_requests_from_50_clients_is_held(server):
    body = json.dumps(
        {"request_id": "b", "samples": [{"data_source": "a", "response": "7", "ground_truth": 7}]}
    )
    statuses, errors = [], []

    def client() -> None:
        for _ in range(20):
            request = urllib.request.Request(
                server.url + "/score", data=body.encode(), method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=120) as response:
                    statuses.append(response.status)
            # a reset or refusal is what this test looks for
            except Exception as error:
                errors.append(repr(error))

    threads = [threading.Thread(target=client) for _ in range(50)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and statuses == [200] * 1000


class HostileServer:
    """Answers each connection with the next canned reply, bytes as they are, then closes."""

    def __init__(self, replies: list[bytes]):
        self.replies = list(replies)
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self) -> None:
        while self.replies:
            connection, _ = self.listener.accept()
            with connection:
                connection.recv(1 << 16)
                connection.sendall(self.replies.pop(0))


def http_reply(body: bytes, length: int | None = None, status: bytes = b"HTTP/1.1 200 OK") -> bytes:
    return (
        status
        + b"\r\nContent-Type: application/json\r\nContent-Length: "
        + str(len(body) if length is None else length).encode()
        + b"\r\n\r\n"
        + body
    )


ONE_ROW_OK = b'{"request_id": "%s", "scores": [1.0], "reasons": [null]}'
BROKEN_REPLIES = {
    "truncated body": http_reply(b'{"request_id": "x", "sco', length=500),
    "broken status line": b"HTTP/1.1 twohundred OK\r\n\r\n{}",
    "not http at all": b"\x00\x01garbage",
    "a JSON list": http_reply(b"[1.0]"),
    "not JSON": http_reply(b"{scores: [1.0]"),
    "wrong length": http_reply(
        b'{"request_id": null, "scores": [1.0, 2.0], "reasons": [null, null]}'
    ),
    "closed without a word": b"",
}


@pytest.mark.parametrize("name", BROKEN_REPLIES)
def test_every_broken_reply_is_retried_then_not_scored_never_raised(name):
    reply = BROKEN_REPLIES[name]
    hostile = HostileServer([reply] * 3)
    client = RewardServiceClient(hostile.url, timeout_s=30, retry_times=2, retry_delay_s=0.01)
    result = client.score(rows(1), ["7"])
    assert result[0].values is None and result[0].reason.startswith("service ")
    assert result[0].reason.endswith("after 2 retries (KEEL-R008)") and client.retries == 2


def test_a_broken_reply_then_a_good_one_recovers(monkeypatch):
    monkeypatch.setattr("uuid.uuid4", lambda: SimpleNamespace(hex="fixed"))
    hostile = HostileServer([BROKEN_REPLIES["truncated body"], http_reply(ONE_ROW_OK % b"fixed")])
    client = RewardServiceClient(hostile.url, timeout_s=30, retry_times=2, retry_delay_s=0.01)
    assert client.score(rows(1), ["7"])[0].values == {"service": 1.0} and client.retries == 1


@pytest.mark.parametrize(
    "score, reason",
    [
        ("NaN", "not a number: nan"),
        ('"1.0"', "not a number: '1.0'"),
        ("[1]", "not a number: [1]"),
        ("1" + "0" * 400, "not a number: inf"),
    ],
)
def test_a_score_that_is_not_a_number_is_that_samples_reason(monkeypatch, score, reason):
    monkeypatch.setattr("uuid.uuid4", lambda: SimpleNamespace(hex="fixed"))
    body = b'{"request_id": "fixed", "scores": [%s], "reasons": [null]}' % score.encode()
    result = RewardServiceClient(HostileServer([http_reply(body)]).url, retry_times=0).score(
        rows(1), ["7"]
    )
    assert result[0].values is None and result[0].reason == f"service: {reason}"


def test_a_health_answer_of_the_wrong_shape_is_a_coded_error():
    with pytest.raises(KeelError) as info:
        RewardServiceClient(HostileServer([http_reply(b'["ok"]')]).url).check_health()
    assert info.value.code == SERVICE_UNAVAILABLE


def test_a_code_exec_server_runs_code_in_its_own_jail_and_says_so():
    port = free_port()
    process = launch(port, "--scorer", "code_exec")
    try:
        tests = json.dumps([{"input": "2 3\n", "output": "5"}])
        row = SimpleNamespace(
            data_source="code", ground_truth=tests, extra_info={}, raw_prompt="q", index=0
        )
        result = RewardServiceClient(f"http://127.0.0.1:{port}").score(
            [row], ["print(sum(map(int, input().split())))"]
        )
        assert result[0].values == {"service": 1.0}
    finally:
        process.kill()
    said = process.communicate()[0].decode()
    assert "[ok] filesystem" in said and "[ok] network" in said


def test_nan_scores_from_a_service_skip_the_step_under_nonfinite_skip(monkeypatch):
    from keel.observe.guards import SkipStep

    monkeypatch.setattr("uuid.uuid4", lambda: SimpleNamespace(hex="fixed"))
    body = b'{"request_id": "fixed", "scores": [NaN, NaN], "reasons": [null, null]}'
    client = RewardServiceClient(HostileServer([http_reply(body)]).url, retry_times=0)
    with pytest.raises(SkipStep):
        RewardScorer(service=client, nonfinite="skip").score_batch(rows(2), ["7", "7"])
