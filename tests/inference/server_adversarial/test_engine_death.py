"""Issue 46, repro 1 (c): when the engine loop itself dies, nobody waits forever.

Every pending request (plain and streaming) fails at once with an OpenAI-shaped error, ``/health``
answers 503 with the reason, the cause is logged with its traceback, and new requests get 503.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_core.inference.apis import MegatronAsyncLLM, ServeConfig
from megatron_core.inference.config import InferenceConfig
from tests.inference.server_adversarial._support import (
    CharTokenizer,
    InProcessServer,
    post,
    request,
    sse_events,
    tiny_model,
    wait_until,
)

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

C = "/v1/completions"
BODY = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server():
    config = InferenceConfig(block_size_tokens=8, buffer_size_gb=0.01, max_sequence_length=128, max_requests=8)
    llm = MegatronAsyncLLM(model=tiny_model(), tokenizer=CharTokenizer(), inference_config=config,
                           use_coordinator=False)
    served = InProcessServer(llm, ServeConfig(port=0, model_name="tiny", max_pending_requests=8))
    yield served
    served.stop()


def test_a_dead_engine_loop_fails_every_pending_request_and_health_says_so(server, caplog):
    llm = server.llm
    assert post(server.port, C, BODY).status == 200
    drain = llm.engine._drain_inbox

    def broken() -> None:
        raise RuntimeError("injected loop fault")

    llm.engine.pause()
    with caplog.at_level(logging.ERROR), ThreadPoolExecutor(max_workers=4) as pool:
        plain = [pool.submit(post, server.port, C, BODY) for _ in range(3)]
        stream = pool.submit(post, server.port, C, {**BODY, "stream": True})
        assert wait_until(lambda: server.app.state.admission.used == 4)
        llm.engine._drain_inbox = broken  # the next step raises outside any one request
        start = time.monotonic()
        llm.engine.unpause()
        replies = [f.result(timeout=20) for f in plain]
        streamed = stream.result(timeout=20)
        elapsed = time.monotonic() - start
    llm.engine._drain_inbox = drain
    assert elapsed < 5, elapsed  # at once: no waiter sat out a timeout
    for reply in replies:
        assert reply.status == 500 and "injected loop fault" in reply.error["message"], reply.body
        assert reply.error["type"] == "server_error"
    events = sse_events(streamed.body)
    assert events[-1] == "[DONE]" and "injected loop fault" in events[-2]["error"]["message"]
    health = request(server.port, "GET", "/health")
    assert health.status == 503, health.body
    assert health.json()["status"] == "engine_failed" and "injected loop fault" in health.json()["reason"]
    again = post(server.port, C, BODY)
    assert again.status == 503 and again.error["code"] == "engine_failed", again.body
    logged = [r for r in caplog.records if "engine loop stopped" in r.getMessage()]
    assert logged and "Traceback" in logged[0].getMessage() and "injected loop fault" in logged[0].getMessage()
    assert server.app.state.admission.used == 0
