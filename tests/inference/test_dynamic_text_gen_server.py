"""The coordinator-fed text-generation server (Megatron-Core's ``dynamic_text_gen_server``) over HTTP on 127.0.0.1."""

from __future__ import annotations

import threading

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from megatron_core.inference.apis import MegatronLLM  # noqa: E402
from megatron_core.inference.config import InferenceConfig  # noqa: E402
from megatron_core.inference.sampling_params import SamplingParams  # noqa: E402
from megatron_core.inference.text_generation_server.dynamic_text_gen_server import (  # noqa: E402
    start_text_gen_server,
    stop_text_gen_server,
    text_generation_server,
)
from megatron_core.inference.text_generation_server.dynamic_text_gen_server.endpoints.chat_completions import (  # noqa: E402
    replace_prefix_tokens,
)
from tests.inference.coordinator_fixture import CONFIG, tiny_gpt  # noqa: E402
from tests.inference.server_adversarial._support import CharTokenizer  # noqa: E402

NEW = 6
TEXTS = ["hello there", "abc", "a longer prompt here", "xyz 123"]
GREEDY = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
TIMEOUT_S = 120
SERVED = InferenceConfig(**{**CONFIG, "max_sequence_length": 128})


@pytest.fixture(scope="module")
def served():
    model, tok = tiny_gpt(), CharTokenizer()
    reference = MegatronLLM(model=model, tokenizer=tok, inference_config=SERVED,
                            use_coordinator=False)
    llm = MegatronLLM(model=model, tokenizer=tok, inference_config=SERVED)
    start_text_gen_server(llm._coord_runtime.coord_addr, tok, rank=0, server_port=0, num_replicas=2)
    client = httpx.Client(base_url=f"http://127.0.0.1:{text_generation_server.bound_port()}", timeout=TIMEOUT_S)
    try:
        yield client, reference, tok, llm
    finally:
        client.close()
        stop_text_gen_server()
        llm.shutdown()


def test_completions_greedy_equal_engine_generate(served):
    client, reference, tok, _ = served
    expected = reference.generate(TEXTS, GREEDY)
    body = {"prompt": TEXTS, "max_tokens": NEW, "temperature": 0, "ignore_eos": True}
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "text_completion" and data["model"] == "EMPTY"
    assert [c["generation_token_ids"] for c in data["choices"]] == [r.generated_tokens for r in expected]
    assert [c["text"] for c in data["choices"]] == [r.generated_text for r in expected]
    assert [c["prompt_token_ids"] for c in data["choices"]] == [tok.tokenize(t) for t in TEXTS]
    assert {c["finish_reason"] for c in data["choices"]} == {"length"}
    assert data["usage"]["completion_tokens"] == NEW * len(TEXTS)
    by_ids = client.post("/completions", json={**body, "prompt": tok.tokenize(TEXTS[2]), "echo": True}).json()
    assert by_ids["choices"][0]["generation_token_ids"] == expected[2].generated_tokens
    assert by_ids["choices"][0]["text"] == TEXTS[2] + expected[2].generated_text


def test_completion_logprobs_equal_reference(served):
    client, reference, _, _ = served
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1, return_log_probs=True,
                            skip_prompt_log_probs=True)
    expected = reference.generate(TEXTS[0], params)[0]
    body = {"prompt": TEXTS[0], "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    block = choice["logprobs"]
    assert block["token_logprobs"][0] is None and len(block["tokens"]) == NEW
    assert block["token_logprobs"][1:] == pytest.approx(expected.generated_log_probs, abs=1e-5)
    assert "".join(block["tokens"]) == expected.generated_text and block["text_offset"][0] == 0
    assert len(block["top_logprobs"]) == NEW + 1


def test_chat_completions_with_template(served):
    client, reference, tok, _ = served
    prompt = tok.tokenize(tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                                   {"role": "user", "content": "hi"}]))
    expected = reference.generate(prompt, GREEDY)[0]
    body = {"messages": CHAT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True, "n": 2}
    reply = client.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    data = reply.json()
    assert data["object"] == "chat.completion" and len(data["choices"]) == 2
    for choice in data["choices"]:
        message = choice["message"]
        assert message["role"] == "assistant" and message["content"] == expected.generated_text
        assert message["prompt_token_ids"] == prompt and message["generation_token_ids"] == expected.generated_tokens
        assert choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert data["usage"]["prompt_tokens"] == len(prompt)
    assert data["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # A second turn carrying the first turn's tokens: the prefix is those tokens, not a retokenization.
    turn = {"role": "assistant", "content": "ignored text", "prompt_token_ids": prompt,
            "generation_token_ids": expected.generated_tokens}
    follow = client.post("/chat/completions", json={**body, "n": 1, "messages": CHAT + [
        turn, {"role": "user", "content": "more"}]}).json()["choices"][0]["message"]
    assert follow["prompt_token_ids"][:len(prompt) + NEW] == prompt + expected.generated_tokens


def test_replace_prefix_tokens():
    eos = 2
    assert replace_prefix_tokens(eos, [5, 6, 7, eos], [5, 6, 9, eos], [5, 6, 9, eos, 8, 8]) == [5, 6, 7, eos, 8, 8]
    assert replace_prefix_tokens(eos, [5, 6], [5, 4], [5, 4, 3]) == [5, 6, 4, 3]


def test_health_and_profile_routes(served):
    client = served[0]
    for path in ("/health", "/v1/health"):
        assert client.get(path).json() == {"status": "ok", "service": "Megatron Inference Server", "ready": True}
    assert client.post("/start_profile").json() == {"status": "ok", "action": "start_profile"}
    assert client.post("/v1/stop_profile").json() == {"status": "ok", "action": "stop_profile"}


@pytest.mark.parametrize("path, body, status, words", [
    ("/v1/completions", b"{not json", 400, "JSON"),
    ("/v1/completions", b"[1, 2]", 400, "JSON object"),
    ("/v1/completions", b'{"max_tokens": 2}', 400, "Missing 'prompt'"),
    ("/v1/completions", b'{"prompt": [1.5]}', 400, "Invalid 'prompt' format"),
    ("/v1/completions", b'{"prompt": "a", "temperature": "hot"}', 400, "temperature"),
    ("/v1/completions", b'{"prompt": "a", "top_k": 2, "top_p": 0.5}', 400, "top_k"),
    ("/v1/completions", b'{"prompt": "a", "max_tokens": 200}', 400, "Inference request(s) failed"),
    ("/v1/chat/completions", b'{"max_tokens": 2}', 400, "Missing 'messages'"),
    ("/v1/chat/completions", b'{"messages": "hi"}', 400, "must be a list"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"x" * 80 + b'"}], "max_tokens": 40}',
     400, "maximum context length"),
    ("/v1/nothing", b"{}", 404, "Not Found"),
])
def test_bad_requests_get_json_4xx(served, path, body, status, words):
    reply = served[0].post(path, content=body, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    assert words in reply.json()["error"]["message"]


def test_stop_leaves_nothing_running(served):
    """Runs last: stops the module's server and LLM (the fixture's own teardown is then a no-op)."""
    _, _, tok, llm = served
    with pytest.raises(ValueError, match="num_replicas"):
        stop_text_gen_server()
        start_text_gen_server(llm._coord_runtime.coord_addr, tok, 0, 0, num_replicas=0)
    start_text_gen_server(llm._coord_runtime.coord_addr, tok, 0, 0, num_replicas=1)
    port = text_generation_server.bound_port()
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=TIMEOUT_S).status_code == 200
    stop_text_gen_server()
    assert text_generation_server.bound_port() is None
    assert not any(t.name.startswith("text-gen-server") for t in threading.enumerate())
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    stop_text_gen_server()  # a no-op when stopped
    llm.shutdown()
    assert not llm.engine.inference_coordinator_process.is_alive()
