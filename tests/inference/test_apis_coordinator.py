"""``MegatronLLM`` / ``MegatronAsyncLLM`` with ``use_coordinator=True``: the same tokens as without the coordinator."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from megatron_core.inference.apis import MegatronAsyncLLM, MegatronLLM  # noqa: E402
from megatron_core.inference.config import InferenceConfig  # noqa: E402
from megatron_core.inference.engines.dynamic_engine import EngineState  # noqa: E402
from tests.inference.coordinator_fixture import CONFIG, GREEDY, PROMPTS, reference, tiny_gpt  # noqa: E402
from tests.inference.llama_fixture import CharTokenizer  # noqa: E402

WAIT_S = 120


def _coordinator_gone(llm) -> bool:
    handle = llm.engine.inference_coordinator_process
    return handle is not None and not handle.is_alive()


def test_sync_llm_through_coordinator_matches_direct():
    model = tiny_gpt()
    expected = reference(PROMPTS, model)
    llm = MegatronLLM(model=model, tokenizer=CharTokenizer(), inference_config=InferenceConfig(**CONFIG))
    try:
        assert llm.is_primary_rank and llm.engine.state == EngineState.RUNNING
        assert [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)] == expected
        single = llm.generate(PROMPTS[2], GREEDY)
        assert len(single) == 1 and single[0].generated_tokens == expected[2]
        assert llm.generate([], GREEDY) == []
        llm.pause()
        assert llm.engine.state == EngineState.PAUSED
        llm.suspend()
        llm.resume()
        llm.unpause()
        assert llm.engine.state == EngineState.RUNNING
        assert llm.generate(PROMPTS[0], GREEDY)[0].generated_tokens == expected[0]
    finally:
        llm.shutdown()
    assert llm.engine.state == EngineState.STOPPED and _coordinator_gone(llm)
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="after shutdown"):
        llm.generate(PROMPTS[0], GREEDY)


def test_direct_mode_lifecycle_methods_refuse():
    llm = MegatronLLM(model=tiny_gpt(), tokenizer=CharTokenizer(), inference_config=InferenceConfig(**CONFIG),
                      use_coordinator=False)
    with pytest.raises(RuntimeError, match="use_coordinator=True"):
        llm.pause()
    with pytest.raises(ValueError, match="coordinator_host"):
        MegatronLLM(model=tiny_gpt(), tokenizer=None, use_coordinator=False, coordinator_port=1234)


def test_async_llm_through_coordinator_matches_direct():
    model = tiny_gpt()
    expected = reference(PROMPTS, model)

    async def main():
        async with MegatronAsyncLLM(model=model, tokenizer=CharTokenizer(),
                                    inference_config=InferenceConfig(**CONFIG)) as llm:
            batch = await asyncio.wait_for(llm.generate(PROMPTS, GREEDY), WAIT_S)
            one = await asyncio.wait_for(llm.generate(PROMPTS[1], GREEDY), WAIT_S)
            await asyncio.wait_for(llm.pause(), WAIT_S)
            await asyncio.wait_for(llm.unpause(), WAIT_S)
            with pytest.raises(RuntimeError, match="use_coordinator=False"):
                llm.submit(PROMPTS[0], GREEDY)
        return llm, [r.generated_tokens for r in batch], one.generated_tokens

    llm, batch, one = asyncio.run(main())
    assert batch == expected and one == expected[1]
    assert llm.engine.state == EngineState.STOPPED and _coordinator_gone(llm)


def test_async_serve_through_coordinator_answers_http():
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from megatron_core.inference.apis import ServeConfig

    model = tiny_gpt()
    expected = reference(PROMPTS[:2], model)

    async def main():
        llm = MegatronAsyncLLM(model=model, tokenizer=CharTokenizer(), inference_config=InferenceConfig(**CONFIG))
        try:
            await llm.serve(ServeConfig(port=0), blocking=False)
            url = f"http://127.0.0.1:{llm.server_port}/v1/completions"
            body = {"prompt": PROMPTS[:2], "max_tokens": GREEDY.num_tokens_to_generate, "temperature": 0,
                    "ignore_eos": True}
            reply = await asyncio.to_thread(httpx.post, url, json=body, timeout=WAIT_S)
        finally:
            await llm.shutdown()
        return llm, reply, url

    llm, reply, url = asyncio.run(main())
    assert reply.status_code == 200, reply.text
    assert [c["generation_token_ids"] for c in reply.json()["choices"]] == expected
    assert llm.server_port is None and _coordinator_gone(llm)
    with pytest.raises(httpx.TransportError):
        httpx.post(url, json={}, timeout=5)


def _two_ranks_through_coordinator() -> list:
    import torch.distributed as dist

    llm = MegatronLLM(model=tiny_gpt(), tokenizer=CharTokenizer(), inference_config=InferenceConfig(**CONFIG))
    try:
        if dist.get_rank() != 0:
            assert not llm.is_primary_rank
            with pytest.raises(RuntimeError, match="primary rank"):
                llm.generate(PROMPTS[0], GREEDY)
            return []
        return [r.generated_tokens for r in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


def test_two_data_parallel_ranks_through_coordinator():
    from tests.dist_harness import run_on_ranks

    expected = reference(PROMPTS)
    primary, worker = run_on_ranks(2, _two_ranks_through_coordinator)
    assert primary == expected and worker == []
