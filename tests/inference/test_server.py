"""The OpenAI-compatible server, driven by the official ``openai`` client on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_core.inference.apis import MegatronAsyncLLM, MegatronLLM, ServeConfig
from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.sampling_params import SamplingParams
from tests.inference.hf_char_tokenizer import HFCharTokenizer
from tests.inference.llama_fixture import mcore_llama

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

MODEL = "tiny-llama"
CONFIG = dict(block_size_tokens=8, buffer_size_gb=0.02, max_sequence_length=128, max_requests=64)
TEXTS = [f"prompt {i}: " + "abcdefghij"[: 1 + i % 10] for i in range(64)]  # 64 concurrent clients (issue 18)
NEW = 4
LONG = 100


def _wait_until(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


@pytest.fixture(scope="module")
def served():
    model, tok = mcore_llama(), HFCharTokenizer()
    reference = MegatronLLM(model=model, tokenizer=tok, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    greedy = SamplingParams(top_k=1, num_tokens_to_generate=NEW)
    expected = {t: r.generated_text for t, r in zip(TEXTS, reference.generate(TEXTS, greedy))}
    chat_prompt = tok.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True)
    expected["<chat>"] = reference.generate(chat_prompt, greedy)[0].generated_text
    # A prompt whose greedy continuation does not hit the end token within LONG tokens.
    long_params = SamplingParams(top_k=1, num_tokens_to_generate=LONG)
    candidates = [f"long prompt {i}" for i in range(8)]
    expected["<long>"] = next(
        c for c in candidates if len(reference.generate(c, long_params)[0].generated_tokens) == LONG
    )
    reference.shutdown()

    llm = MegatronAsyncLLM(model=model, tokenizer=tok, inference_config=InferenceConfig(**CONFIG), use_coordinator=False)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    config = ServeConfig(port=0, model_name=MODEL, max_pending_requests=64)
    asyncio.run_coroutine_threadsafe(llm.serve(config, blocking=False), loop).result(timeout=30)
    base = f"http://127.0.0.1:{llm.server_port}"
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=180)
    yield llm, client, base, expected
    asyncio.run_coroutine_threadsafe(llm.shutdown(), loop).result(timeout=60)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(timeout=10)
    assert not llm.engine.has_unfinished_requests()
    assert llm.context.block_allocator.get_total_used() == 0


def test_models_and_health(served):
    llm, client, base, _ = served
    assert [m.id for m in client.models.list().data] == [MODEL]
    health = httpx.get(base + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"


def test_completion_and_chat_match_the_engine(served):
    _, client, _, expected = served
    out = client.completions.create(model=MODEL, prompt=TEXTS[3], max_tokens=NEW, temperature=0)
    assert out.choices[0].text == expected[TEXTS[3]]
    assert out.usage.completion_tokens <= NEW
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
                                          temperature=0)
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == expected["<chat>"]


def test_streaming(served):
    _, client, _, expected = served
    stream = client.completions.create(model=MODEL, prompt=TEXTS[5], max_tokens=NEW, temperature=0, stream=True)
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == expected[TEXTS[5]]
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=NEW,
                                            temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream) == expected["<chat>"]


def test_concurrent_clients_each_get_their_own_answer(served):
    _, client, _, expected = served

    def ask(text):
        return client.completions.create(model=MODEL, prompt=text, max_tokens=NEW, temperature=0).choices[0].text

    with ThreadPoolExecutor(max_workers=len(TEXTS)) as pool:
        answers = list(pool.map(ask, TEXTS))
    assert answers == [expected[t] for t in TEXTS]


def test_bad_requests_get_4xx_with_a_message(served):
    _, client, base, _ = served
    bad_json = httpx.post(base + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert bad_json.status_code == 400 and "JSON" in bad_json.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="other", prompt="x", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_sequence_length"):
        client.completions.create(model=MODEL, prompt="x" * 200, max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=2)


def test_full_queue_answers_429(served):
    llm, client, base, _ = served
    admission = llm._server.config.app.state.admission
    admission.limit = 1
    llm.engine.pause()  # the first request stays in flight until unpaused
    try:
        with ThreadPoolExecutor(max_workers=1) as pool:
            first = pool.submit(client.completions.create, model=MODEL, prompt="first", max_tokens=3, temperature=0)
            assert _wait_until(lambda: len(admission.in_flight) == 1, timeout=60)
            with pytest.raises(openai.RateLimitError, match="capacity"):
                client.completions.create(model=MODEL, prompt="x", max_tokens=2)
            llm.engine.unpause()
            assert first.result(timeout=120).choices[0].finish_reason in ("stop", "length")
    finally:
        llm.engine.unpause()
        admission.limit = 64


def test_disconnect_mid_stream_frees_kv_blocks(served):
    llm, _, base, expected = served
    assert _wait_until(lambda: not llm.engine.has_unfinished_requests(), timeout=60)
    cancelled = llm.engine.cancelled_request_count
    wrapper = llm.controller.inference_wrapped_model
    forward = wrapper.run_one_forward_step

    def slow_forward(inputs):  # >= 20 s for the whole generation: the client leaves long before the end
        time.sleep(0.2)
        return forward(inputs)

    wrapper.run_one_forward_step = slow_forward
    try:
        with httpx.stream("POST", base + "/v1/completions", json={
            "model": MODEL, "prompt": expected["<long>"], "max_tokens": LONG, "temperature": 0, "stream": True,
        }, timeout=120) as response:
            first = next(response.iter_lines())
            assert first.startswith("data: ")
            assert json.loads(first[len("data: "):])["choices"][0]["finish_reason"] is None, first
            assert llm.engine.has_unfinished_requests()  # still generating
            assert llm.context.block_allocator.get_total_used() > 0
        # The client closed the connection before the generation finished.
        assert _wait_until(lambda: llm.context.block_allocator.get_total_used() == 0, timeout=60)
        assert llm.engine.cancelled_request_count == cancelled + 1
    finally:
        wrapper.run_one_forward_step = forward


def test_server_listens_on_loopback_only_by_default(served):
    """Reliability check 15: the HTTP server binds 127.0.0.1 unless told otherwise."""
    psutil = pytest.importorskip("psutil")
    llm, _, _, _ = served
    assert ServeConfig().host == "127.0.0.1"
    listening = [c.laddr for c in psutil.Process().net_connections(kind="tcp")
                 if c.status == psutil.CONN_LISTEN and c.laddr.port == llm.server_port]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)
