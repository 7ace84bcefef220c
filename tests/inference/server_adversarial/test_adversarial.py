"""Bad inputs and faults against the OpenAI-compatible server (one in-process server for the module).

Each case asserts the answer (status, OpenAI error shape, the field it names) and then that the
server still answers a greedy request with the reference text. Issue 46's reproductions 1 (top_k
above the vocabulary), 2 (streams ignored the limit) and 3 (top_p = 0) are here too.
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_core.inference.apis import MegatronAsyncLLM, MegatronLLM, ServeConfig
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.sampling_params import SamplingParams
from tests.inference.server_adversarial._support import (
    CharTokenizer,
    InProcessServer,
    post,
    request,
    sse_events,
    stream_text,
    tiny_model,
    wait_until,
)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "tiny"
CONFIG = dict(block_size_tokens=8, buffer_size_gb=0.02, max_sequence_length=128, max_requests=16)
LIMIT = 8
MAX_BYTES = 64 * 1024
NEW = 4
PROMPT = "hello"
IDS = [40, 41, 42, 43]
CHAT = [{"role": "user", "content": "hi"}]
C, CH = "/v1/completions", "/v1/chat/completions"


@pytest.fixture(scope="module")
def server():
    model, tok = tiny_model(), CharTokenizer()
    reference = MegatronLLM(model=model, tokenizer=tok, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    chat_prompt = tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = {
        "text": reference.generate(PROMPT, greedy)[0].generated_text,
        "ids": reference.generate(IDS, greedy)[0].generated_text,
        "chat": reference.generate(chat_prompt, greedy)[0].generated_text,
    }
    reference.shutdown()
    llm = MegatronAsyncLLM(model=model, tokenizer=tok, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    served = InProcessServer(llm, ServeConfig(port=0, model_name=MODEL, max_pending_requests=LIMIT,
                                              max_request_bytes=MAX_BYTES, request_body_timeout_s=1.0,
                                              default_max_tokens=NEW))
    served.expected = expected
    yield served
    served.stop()
    assert not llm.engine.has_unfinished_requests()
    assert llm.context.block_allocator.get_total_used() == 0


def assert_serves_greedy(server) -> None:
    """The server still answers, and its greedy answer is the reference's."""
    reply = post(server.port, C, {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0})
    assert reply.status == 200, reply.body
    assert reply.json()["choices"][0]["text"] == server.expected["text"]
    health = request(server.port, "GET", "/health")
    assert health.status == 200 and health.json()["status"] == "ok" and health.json()["in_flight"] == 0, health.body


def _c(**fields):
    return {"model": MODEL, "prompt": PROMPT, "max_tokens": NEW, **fields}


def _ch(**fields):
    return {"model": MODEL, "messages": CHAT, "max_tokens": NEW, **fields}


def _without(body, key):
    return {k: v for k, v in body.items() if k != key}


# (id, path, JSON body or raw bytes, expected status, the field the error must name or None)
BAD = [
    # The body is not a JSON object.
    ("malformed", C, b"{not json", 400, None),
    ("empty-body", C, b"", 400, None),
    ("truncated", C, b'{"model": "tiny", "prompt": "hi"', 400, None),
    ("trailing-garbage", C, b'{"model": "tiny", "prompt": "hi"} xyz', 400, None),
    ("array", C, b"[]", 400, None),
    ("string", C, b'"hello"', 400, None),
    ("null", C, b"null", 400, None),
    ("number", C, b"42", 400, None),
    ("binary-garbage", C, bytes(range(256)), 400, None),
    ("invalid-utf8", C, b'{"model": "tiny\xff\xfe", "prompt": "hi"}', 400, None),
    ("deep-nesting", C, b"[" * 50_000, 400, None),
    ("huge-integer", C, b'{"model": "tiny", "prompt": "hi", "max_tokens": ' + b"9" * 5000 + b"}", 400, None),
    ("nan-literal", C, b'{"model": "tiny", "prompt": "hi", "temperature": NaN}', 400, "temperature"),
    ("infinity-literal", C, b'{"model": "tiny", "prompt": "hi", "top_p": Infinity}', 400, "top_p"),
    ("minus-infinity", C, b'{"model": "tiny", "prompt": "hi", "temperature": -Infinity}', 400, "temperature"),
    # Missing fields.
    ("missing-model", C, _without(_c(), "model"), 400, "model"),
    ("missing-prompt", C, _without(_c(), "prompt"), 400, "prompt"),
    ("chat-missing-messages", CH, _without(_ch(), "messages"), 400, "messages"),
    ("chat-missing-model", CH, _without(_ch(), "model"), 400, "model"),
    # model
    ("model-int", C, _c(model=5), 400, "model"),
    ("model-null", C, _c(model=None), 400, "model"),
    ("model-list", C, _c(model=[MODEL]), 400, "model"),
    ("model-unknown", C, _c(model="gpt-4"), 404, "model"),
    ("model-empty", C, _c(model=""), 404, "model"),
    ("chat-model-unknown", CH, _ch(model="other"), 404, "model"),
    # prompt
    ("prompt-int", C, _c(prompt=5), 400, "prompt"),
    ("prompt-null", C, _c(prompt=None), 400, "prompt"),
    ("prompt-object", C, _c(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt-float-ids", C, _c(prompt=[1.5, 2]), 400, "prompt"),
    ("prompt-bool-ids", C, _c(prompt=[True, False]), 400, "prompt"),
    ("prompt-empty-string", C, _c(prompt=""), 400, "prompt"),
    ("prompt-empty-list", C, _c(prompt=[]), 400, "prompt"),
    ("prompt-list-of-empty", C, _c(prompt=[[]]), 400, "prompt"),
    ("prompt-mixed-list", C, _c(prompt=["a", 5]), 400, "prompt"),
    ("prompt-negative-id", C, _c(prompt=[-1, 5]), 400, "prompt"),
    ("prompt-id-past-vocab", C, _c(prompt=[10**6]), 400, "prompt"),
    ("prompt-id-huge", C, _c(prompt=[2**70]), 400, "prompt"),
    ("prompt-longer-than-context", C, _c(prompt="x" * 300), 400, "prompt"),
    ("prompt-batch-over-limit", C, _c(prompt=["a"] * (LIMIT + 1)), 400, "prompt"),
    ("stream-batch", C, _c(prompt=["a", "b"], stream=True), 400, "stream"),
    # max_tokens
    ("max_tokens-string", C, _c(max_tokens="4"), 400, "max_tokens"),
    ("max_tokens-float", C, _c(max_tokens=4.0), 400, "max_tokens"),
    ("max_tokens-bool", C, _c(max_tokens=True), 400, "max_tokens"),
    ("max_tokens-negative", C, _c(max_tokens=-1), 400, "max_tokens"),
    ("max_tokens-zero", C, _c(max_tokens=0), 400, "max_tokens"),
    ("max_tokens-huge", C, _c(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens-past-context", C, _c(max_tokens=125), 400, "max_tokens"),
    ("max_completion_tokens-string", CH, _ch(max_completion_tokens="x"), 400, "max_completion_tokens"),
    # temperature
    ("temperature-string", C, _c(temperature="1"), 400, "temperature"),
    ("temperature-negative", C, _c(temperature=-0.1), 400, "temperature"),
    ("temperature-above-2", C, _c(temperature=2.5), 400, "temperature"),
    ("temperature-bool", C, _c(temperature=True), 400, "temperature"),
    ("temperature-list", C, _c(temperature=[1]), 400, "temperature"),
    # top_p
    ("top_p-negative", C, _c(top_p=-0.5), 400, "top_p"),
    ("top_p-above-1", C, _c(top_p=1.5), 400, "top_p"),
    ("top_p-string", C, _c(top_p="0.5"), 400, "top_p"),
    ("top_p-bool", C, _c(top_p=False), 400, "top_p"),
    # top_k (repro 1: above the vocabulary used to hang the server)
    ("top_k-above-vocab", C, _c(temperature=1, top_k=5000), 400, "top_k"),
    ("chat-top_k-above-vocab", CH, _ch(temperature=1, top_k=129), 400, "top_k"),
    ("top_k-negative", C, _c(top_k=-1), 400, "top_k"),
    ("top_k-float", C, _c(top_k=2.5), 400, "top_k"),
    ("top_k-string", C, _c(top_k="5"), 400, "top_k"),
    ("top_k-bool", C, _c(top_k=True), 400, "top_k"),
    ("top_k-and-top_p", C, _c(top_k=5, top_p=0.5), 400, "top_p"),
    # stream
    ("stream-string", C, _c(stream="yes"), 400, "stream"),
    ("stream-int", C, _c(stream=1), 400, "stream"),
    # stop
    ("stop-int", C, _c(stop=5), 400, "stop"),
    ("stop-empty-string", C, _c(stop=[""]), 400, "stop"),
    ("stop-ints", C, _c(stop=[1, 2]), 400, "stop"),
    ("stop-too-many", C, _c(stop=list("abcde")), 400, "stop"),
    ("stop-empty-list", C, _c(stop=[]), 400, "stop"),
    ("stop-object", C, _c(stop={"a": 1}), 400, "stop"),
    ("stop-nested", C, _c(stop=[["a"]]), 400, "stop"),
    # unsupported fields
    ("n-2", C, _c(n=2), 400, "n"),
    ("n-bool", C, _c(n=True), 400, "n"),
    ("n-string", C, _c(n="1"), 400, "n"),
    ("chat-n-3", CH, _ch(n=3), 400, "n"),
    ("best_of-3", C, _c(best_of=3), 400, "best_of"),
    ("echo-true", C, _c(echo=True), 400, "echo"),
    ("seed", C, _c(seed=1), 400, "seed"),
    ("suffix", C, _c(suffix="x"), 400, "suffix"),
    ("chat-tools", CH, _ch(tools=[{"type": "function"}]), 400, "tools"),
    # logprobs
    ("logprobs-21", C, _c(logprobs=21), 400, "logprobs"),
    ("logprobs-negative", C, _c(logprobs=-1), 400, "logprobs"),
    ("logprobs-bool", C, _c(logprobs=True), 400, "logprobs"),
    ("logprobs-string", C, _c(logprobs="2"), 400, "logprobs"),
    ("chat-logprobs-string", CH, _ch(logprobs="yes"), 400, "logprobs"),
    ("chat-top_logprobs-50", CH, _ch(logprobs=True, top_logprobs=50), 400, "top_logprobs"),
    # chat messages
    ("messages-empty", CH, _ch(messages=[]), 400, "messages"),
    ("messages-string", CH, _ch(messages="hi"), 400, "messages"),
    ("messages-no-content", CH, _ch(messages=[{"role": "user"}]), 400, "messages"),
    ("messages-no-role", CH, _ch(messages=[{"content": "hi"}]), 400, "messages"),
    ("messages-bad-role", CH, _ch(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages"),
    ("messages-content-int", CH, _ch(messages=[{"role": "user", "content": 5}]), 400, "messages"),
    ("messages-image-part", CH, _ch(messages=[{"role": "user", "content": [{"type": "image_url"}]}]), 400, "messages"),
    ("messages-list-of-strings", CH, _ch(messages=["hi"]), 400, "messages"),
    ("messages-too-long", CH, _ch(messages=[{"role": "user", "content": "y" * 300}]), 400, "prompt"),
]


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_request_is_refused_clearly(server, case):
    _, path, body, status, param = case
    reply = post(server.port, path, None, raw=body) if isinstance(body, bytes) else post(server.port, path, body)
    assert reply.status == status, reply.body
    error = reply.error
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error" and error["message"], error
    if param is not None:
        assert param in error["message"] or param == "prompt", error
    assert_serves_greedy(server)


# (id, method, path, headers, raw body, expected status)
PROTOCOL = [
    ("content-type-text", "POST", C, {"Content-Type": "text/plain"}, json.dumps(_c()).encode(), 415),
    ("content-type-form", "POST", C, {"Content-Type": "application/x-www-form-urlencoded"}, b"model=tiny", 415),
    ("get-completions", "GET", C, {}, None, 405),
    ("put-chat", "PUT", CH, {}, json.dumps(_ch()).encode(), 405),
    ("post-models", "POST", "/v1/models", {}, b"{}", 405),
    ("delete-health", "DELETE", "/health", {}, None, 405),
    ("unknown-route", "GET", "/v1/engines", {}, None, 404),
    ("unknown-post-route", "POST", "/v1/embeddings", {}, b"{}", 404),
    ("path-traversal", "GET", "/../../etc/passwd", {}, None, 404),
    ("oversized-declared", "POST", C, {}, json.dumps(_c(prompt="a" * (MAX_BYTES + 10))).encode(), 413),
]


@pytest.mark.parametrize("case", PROTOCOL, ids=[c[0] for c in PROTOCOL])
def test_protocol_misuse_gets_an_openai_error(server, case):
    _, method, path, headers, raw, status = case
    reply = request(server.port, method, path, raw=raw, headers=headers)
    assert reply.status == status, reply.body
    assert reply.error["message"]
    assert_serves_greedy(server)


def test_oversized_chunked_body_is_cut_off(server):
    """No Content-Length: the server stops reading at max_request_bytes."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        conn.putrequest("POST", C)
        conn.putheader("Content-Type", "application/json")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        chunk = b"a" * 16384
        try:
            for _ in range(2 * MAX_BYTES // len(chunk)):
                conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            conn.send(b"0\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        response = conn.getresponse()
        assert response.status == 413
        assert "exceeds" in json.loads(response.read())["error"]["message"]
    finally:
        conn.close()
    assert_serves_greedy(server)


# (id, path, body, which reference text the answer must equal)
GOOD = [
    ("top_p-0-is-greedy", C, _c(temperature=1, top_p=0), "text"),  # repro 3
    ("top_p-0-temperature-2", C, _c(temperature=2, top_p=0.0), "text"),
    ("temperature-0", C, _c(temperature=0), "text"),
    ("top_k-1", C, _c(temperature=1.5, top_k=1), "text"),
    ("top_k-vocab", C, _c(temperature=0, top_k=128), "text"),
    ("tiny-temperature", C, _c(temperature=1e-300, top_k=0), "text"),
    ("token-ids", C, _c(prompt=IDS, temperature=0), "ids"),
    ("n-1-and-nulls", C, _c(temperature=0, n=1, stream=None, stop=None, logprobs=None, seed=None), "text"),
    ("chat", CH, _ch(temperature=0), "chat"),
    ("chat-text-parts", CH, _ch(temperature=0, messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
     "chat"),
    ("content-type-charset", C, _c(temperature=0), "text"),
]


@pytest.mark.parametrize("case", GOOD, ids=[c[0] for c in GOOD])
def test_edge_values_that_are_valid_give_the_right_answer(server, case):
    name, path, body, key = case
    headers = {"Content-Type": "application/json; charset=utf-8"} if name == "content-type-charset" else None
    reply = post(server.port, path, body, headers=headers)
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    assert (choice.get("text") if path == C else choice["message"]["content"]) == server.expected[key]
    assert_serves_greedy(server)


UNICODE = [
    ("emoji", "héllo wörld 🙂"),
    ("nul-and-controls", "a\u0000b\u0007c\u001b"),
    ("lone-surrogate", "\ud800x"),
    ("rtl-and-combining", "\u202eabc\u0301"),
    ("only-unknown-chars", "日本語"),
]


@pytest.mark.parametrize("case", UNICODE, ids=[c[0] for c in UNICODE])
def test_unicode_prompts_never_cause_a_server_error(server, case):
    _, text = case
    raw = json.dumps(_c(prompt=text, temperature=0)).encode()  # ensure_ascii: a lone surrogate survives as \ud800
    reply = post(server.port, C, None, raw=raw)
    assert reply.status in (200, 400), reply.body
    if reply.status == 400:
        assert reply.error["param"] == "prompt"
    else:
        assert isinstance(reply.json()["choices"][0]["text"], str)
    assert_serves_greedy(server)


def test_logprobs_and_stop_give_a_well_formed_answer(server):
    reply = post(server.port, C, _c(temperature=0, logprobs=2, stop=["zzz"]))
    assert reply.status == 200, reply.body
    choice = reply.json()["choices"][0]
    assert choice["text"] == server.expected["text"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["tokens"]) > 0
    assert all(len(top) == 2 for top in choice["logprobs"]["top_logprobs"])
    assert_serves_greedy(server)


def test_streams_end_with_done_and_the_reference_text(server):
    reply = post(server.port, C, _c(temperature=0, stream=True))
    events = sse_events(reply.body)
    assert reply.status == 200 and events[-1] == "[DONE]"
    assert stream_text(events) == server.expected["text"]
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length")
    reply = post(server.port, CH, _ch(temperature=0, stream=True))
    assert stream_text(sse_events(reply.body)) == server.expected["chat"]
    assert_serves_greedy(server)


@pytest.fixture
def limit_two(server):
    """The server's limit at 2 and its engine paused (the admitted requests stay in flight until unpaused)."""
    admission = server.app.state.admission
    admission.limit = 2
    server.llm.engine.pause()
    yield admission
    server.llm.engine.unpause()
    admission.limit = LIMIT


def _open(port: int, body: dict) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", C, body=json.dumps(body), headers={"Content-Type": "application/json"})
    return conn, conn.getresponse()


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_flood_beyond_the_limit_gets_429_streaming_or_not(server, limit_two, stream):
    """Repro 2: ten requests, limit 2: two are served, eight get 429 (streams used to get ten 200s)."""
    body = _c(temperature=0, stream=stream)
    first = [None, None]
    with ThreadPoolExecutor(max_workers=2) as pool:
        if stream:  # a stream's 200 comes before its tokens
            first = [_open(server.port, body) for _ in range(2)]
            assert [r.status for _, r in first] == [200, 200]
        else:
            first = [pool.submit(post, server.port, C, body) for _ in range(2)]
            assert wait_until(lambda: limit_two.used == 2)
        rest = [post(server.port, C, body, timeout=10) for _ in range(8)]
        assert [r.status for r in rest] == [429] * 8
        assert all("capacity" in r.error["message"] and r.headers.get("retry-after") for r in rest)
        assert request(server.port, "GET", "/health").json()["in_flight"] == 2
        server.llm.engine.unpause()
        if stream:
            texts = [stream_text(sse_events(r.read())) for _, r in first]
            for conn, _ in first:
                conn.close()
        else:
            texts = [f.result(timeout=30).json()["choices"][0]["text"] for f in first]
    assert texts == [server.expected["text"]] * 2
    assert wait_until(lambda: limit_two.used == 0)
    limit_two.limit = LIMIT
    assert_serves_greedy(server)


@pytest.mark.parametrize("when", ["before-first-token", "mid-stream"])
def test_stream_disconnect_frees_its_slot_and_blocks(server, when):
    llm = server.llm
    if when == "before-first-token":
        llm.engine.pause()
    try:
        conn, response = _open(server.port, _c(prompt=PROMPT, max_tokens=100, temperature=0, stream=True))
        assert response.status == 200
        if when == "mid-stream":
            assert response.readline().startswith(b"data: ")
        assert request(server.port, "GET", "/health").json()["in_flight"] == 1
        conn.sock.shutdown(socket.SHUT_RDWR)
        conn.close()
    finally:
        llm.engine.unpause()
    assert wait_until(lambda: server.app.state.admission.used == 0)
    assert wait_until(lambda: not llm.engine.has_unfinished_requests())
    assert wait_until(lambda: llm.context.block_allocator.get_total_used() == 0)
    assert_serves_greedy(server)


def test_plain_request_disconnect_cancels_it(server):
    llm = server.llm
    llm.engine.pause()
    try:
        cancelled = llm.engine.cancelled_request_count
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        body = json.dumps(_c(max_tokens=100, temperature=0)).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        assert wait_until(lambda: server.app.state.admission.used == 1)
        sock.close()
        assert wait_until(lambda: server.app.state.admission.used == 0)
    finally:
        llm.engine.unpause()
    assert wait_until(lambda: llm.engine.cancelled_request_count == cancelled + 1)
    assert_serves_greedy(server)


def test_slowloris_body_times_out_while_others_are_served(server):
    """A client that sends its headers and part of its body, then stalls, gets 408 after the body timeout."""
    slow = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    headers_only = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    try:
        slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        headers_only.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")  # never finishes its headers
        start = time.monotonic()
        assert_serves_greedy(server)  # others are served meanwhile
        answer = b""
        while b'"error"' not in answer and time.monotonic() - start < 10:
            answer += slow.recv(65536)
        assert time.monotonic() - start < 10
        assert answer.startswith(b"HTTP/1.1 408") and b"did not arrive" in answer, answer[:300]
    finally:
        slow.close()
        headers_only.close()
    assert_serves_greedy(server)


def test_openai_client_sees_typed_errors(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=30)
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=1, extra_body={"top_k": 5000})
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=-1)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="other", messages=CHAT, max_tokens=NEW)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "x"}], max_tokens=NEW)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=NEW, temperature=1, top_p=0)
    assert out.choices[0].text == server.expected["text"]
    assert_serves_greedy(server)


def _fail_rows_with_temperature(llm, temperature: float):
    """Make the sampler raise for rows whose temperature is ``temperature`` (a request-specific fault)."""
    sampler = llm.controller.sampler
    original = sampler.sample

    def sample(logits, params):
        if any(p.temperature == temperature for p in params):
            raise RuntimeError("injected sampling fault")
        return original(logits, params)

    sampler.sample = sample
    return lambda: setattr(sampler, "sample", original)


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "streaming"])
def test_a_fault_in_one_request_fails_it_alone(server, stream):
    """Repro 1 (b): an exception while serving one request fails that request (500, OpenAI error); the
    requests that shared its step are isolated, re-run, and answer the reference text; the loop goes on."""
    llm = server.llm
    restore = _fail_rows_with_temperature(llm, 0.77)
    llm.engine.pause()  # everyone is admitted into the same first step
    try:
        with ThreadPoolExecutor(max_workers=4) as pool:
            good = [pool.submit(post, server.port, C, _c(temperature=0)) for _ in range(3)]
            bad = pool.submit(post, server.port, C, _c(temperature=0.77, stream=stream))
            assert wait_until(lambda: server.app.state.admission.used == 4)
            llm.engine.unpause()
            bad_reply = bad.result(timeout=30)
            texts = [g.result(timeout=30).json()["choices"][0]["text"] for g in good]
    finally:
        llm.engine.unpause()
        restore()
    assert texts == [server.expected["text"]] * 3
    if stream:
        events = sse_events(bad_reply.body)
        assert bad_reply.status == 200 and events[-1] == "[DONE]"
        assert "injected sampling fault" in events[-2]["error"]["message"]
    else:
        assert bad_reply.status == 500
        assert "injected sampling fault" in bad_reply.error["message"]
        assert bad_reply.error["type"] == "server_error"
    assert llm.engine.isolated_request_count >= 4 and llm.engine.failure is None
    assert_serves_greedy(server)


def test_top_k_past_the_vocabulary_set_behind_validation_fails_only_its_request(server):
    """Repro 1 at the engine depth: the ValueError the sampler raises (it used to kill the loop) now fails
    that request alone, even when it shares the step with others."""
    llm = server.llm
    llm.engine.pause()
    try:
        good = [llm.submit(PROMPT, SamplingParams(top_k=1, num_tokens_to_generate=NEW)) for _ in range(2)]
        bad_params = SamplingParams(temperature=1.0, top_k=5, num_tokens_to_generate=NEW)
        bad = llm.submit(PROMPT, bad_params)
        bad_params.top_k = 5000  # past add_request's check, as a library caller could
    finally:
        llm.engine.unpause()
    failed = bad[1].result(timeout=30)
    assert failed.status.name == "FAILED" and "larger than the vocabulary" in failed.error
    assert [f.result(timeout=30).generated_text for _, f in good] == [server.expected["text"]] * 2
    assert llm.engine_failure is None
    assert_serves_greedy(server)
