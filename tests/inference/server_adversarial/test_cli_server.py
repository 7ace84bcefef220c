"""``megatron-serve`` as users start it (a subprocess on a ``pretrain_gpt.py`` checkpoint): issue 46's
reproductions 1 (top_k above the vocabulary hung the server), 2 (streams ignored
``--max-pending-requests``), 4 (a TCPStore listened on every interface), 6 (loopback by default)
and, last because it stops the module's server, 5 (Ctrl-C with requests in flight)."""

from __future__ import annotations

import http.client
import json
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_core.inference.cli.serve import build_parser
from tests.inference.server_adversarial._support import (
    listening_sockets,
    post,
    request,
    sse_events,
    start_cli_server,
    stop_cli_server,
    wait_until,
)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

C = "/v1/completions"
GREEDY = {"model": "tiny", "prompt": "1 2 3", "max_tokens": 4, "temperature": 0}
LONG = {"model": "tiny", "prompt": "1 2", "max_tokens": 2000, "temperature": 0, "stream": True}


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, port = start_cli_server(tiny_checkpoint, "--max-pending-requests", "2", "--shutdown-timeout", "0.3", log=log)
    try:
        first = post(port, C, GREEDY)
        assert first.status == 200, first.body
        yield proc, port, first.json()["choices"][0]["text"], log
    finally:
        stop_cli_server(proc)


def assert_serves_greedy(port: int, reference: str) -> None:
    reply = post(port, C, GREEDY)
    assert reply.status == 200 and reply.json()["choices"][0]["text"] == reference, reply.body
    health = request(port, "GET", "/health")
    assert health.status == 200 and health.json()["status"] == "ok", health.body


@pytest.mark.parametrize("path,extra", [(C, {"prompt": "hi"}), (C, {"prompt": "1 2"}),
                                        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1"}]})],
                         ids=["completion-hi", "completion-ids", "chat"])
def test_top_k_above_the_vocabulary_is_a_400_not_a_hang(served, path, extra):
    """Repro 1: ``top_k: 5000`` with ``temperature: 1`` used to hang this request and every later one."""
    proc, port, reference, _ = served
    body = {"model": "tiny", "max_tokens": 4, "temperature": 1, "top_k": 5000, **extra}
    reply = post(port, path, body, timeout=20)
    assert reply.status == 400, reply.body
    assert reply.error["param"] == "top_k" and "top_k" in reply.error["message"]
    assert_serves_greedy(port, reference)
    assert proc.poll() is None


def test_streams_count_against_max_pending_requests(served):
    """Repro 2: with ``--max-pending-requests 2`` two long streams fill the server; eight more get 429."""
    _, port, reference, _ = served
    conns = [http.client.HTTPConnection("127.0.0.1", port, timeout=30) for _ in range(2)]
    try:
        for conn in conns:
            conn.request("POST", C, body=json.dumps(LONG), headers={"Content-Type": "application/json"})
        responses = [conn.getresponse() for conn in conns]
        assert [r.status for r in responses] == [200, 200]
        assert all(r.readline().startswith(b"data: ") for r in responses)  # both are generating
        rest = [post(port, C, {**LONG, "max_tokens": 4}, timeout=20) for _ in range(8)]
        assert [r.status for r in rest] == [429] * 8, [r.body for r in rest]
        assert request(port, "GET", "/health").json()["in_flight"] == 2
    finally:
        for conn in conns:
            conn.close()  # a client that leaves frees its slot
    assert wait_until(lambda: request(port, "GET", "/health").json()["in_flight"] == 0)
    assert_serves_greedy(port, reference)
    events = sse_events(post(port, C, {**GREEDY, "stream": True}).body)
    assert events[-1] == "[DONE]"


def test_nothing_listens_beyond_loopback(served):
    """Repros 4 and 6: the HTTP port is on 127.0.0.1 and no socket of the server (TCPStore included)
    listens on another or every interface; gloo's own per-group sockets stay on loopback."""
    proc, port, _, _ = served
    sockets = listening_sockets(proc.pid)
    assert ("127.0.0.1", port) in sockets, sockets
    assert all(address in ("127.0.0.1", "::1") for address, _ in sockets), sockets
    assert build_parser().parse_args(["--load", "x"]).host == "127.0.0.1"


def test_sigint_answers_in_flight_requests_with_openai_errors(served):
    """Repro 5 (runs last: it stops the server). After ``--shutdown-timeout`` the running requests are
    cancelled and answered: the plain one with OpenAI's JSON error (it used to be uvicorn's plain-text
    500), the stream with a last chunk whose ``finish_reason`` is ``"cancelled"``, then ``[DONE]``."""
    proc, port, _, log = served
    stream_conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        stream_conn.request("POST", C, body=json.dumps(LONG), headers={"Content-Type": "application/json"})
        stream = stream_conn.getresponse()
        first = stream.readline()
        with ThreadPoolExecutor(max_workers=1) as pool:
            plain = pool.submit(post, port, C, {**LONG, "stream": False})
            assert wait_until(lambda: request(port, "GET", "/health").json().get("in_flight") == 2)
            proc.send_signal(signal.SIGINT)
            reply = plain.result(timeout=30)
            rest = stream.read()
    finally:
        stream_conn.close()
    assert reply.status == 503, reply.body
    assert reply.error["code"] == "cancelled" and "shutting down" in reply.error["message"]
    events = sse_events(first + rest)
    assert events[-1] == "[DONE]", events[-3:]
    assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert proc.wait(timeout=30) == 0  # it exits on its own, cleanly
    assert "Internal Server Error" not in log.read_text()
