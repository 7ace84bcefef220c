"""The legacy text-generation server (``PUT /api``, ``POST /completions``, ``run_mcore_engine``) on the tiny GPT."""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_on_ranks

pytest.importorskip("httpx")
pytest.importorskip("fastapi")

NEW = 6
TEXTS = ["hello there", "abc", "xyz 123"]
STOP_SERVING = 9  # what rank 0 broadcasts to end the other ranks' loop (any value but GENERATE_NUM)


def _engine(static: bool = False):
    from megatron_core.inference.apis import MegatronLLM
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.contexts import StaticInferenceContext
    from megatron_core.inference.engines import StaticInferenceEngine
    from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
    from megatron_core.inference.text_generation_controllers import TextGenerationController
    from tests.inference.coordinator_fixture import CONFIG, tiny_gpt
    from tests.inference.llama_fixture import CharTokenizer

    model = tiny_gpt()
    if static:
        wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=4, max_sequence_length=64))
        return StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=CharTokenizer()), max_batch_size=4)
    return MegatronLLM(model=model, tokenizer=CharTokenizer(), inference_config=InferenceConfig(**CONFIG),
                       use_coordinator=False).engine


def _greedy_loop(model, prompt: list[int], new: int, eod: int) -> tuple[list[int], list[float]]:
    """Greedy tokens by full forwards (stopping at ``eod``, which is kept) and every token's log-prob."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(new):
            logits = model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)[0, -1]
            tokens.append(int(logits.argmax()))
            if tokens[-1] == eod:
                break
        logp = torch.log_softmax(model(torch.tensor([tokens]), torch.arange(len(tokens))[None], None)[0], dim=-1)
    return tokens, [float(logp[i, tokens[i + 1]]) for i in range(len(tokens) - 1)]


@pytest.fixture(scope="module")
def client():
    from fastapi.testclient import TestClient

    from megatron_core.inference.text_generation_server import MegatronServer

    engine = _engine()
    with TestClient(MegatronServer(engine).app) as test_client:
        yield test_client, engine


def test_put_api_equals_a_plain_greedy_loop(client):
    test_client, engine = client
    reply = test_client.put("/api", json={"prompts": TEXTS, "tokens_to_generate": NEW, "top_k": 1, "logprobs": True})
    assert reply.status_code == 200, reply.text
    data = reply.json()
    tok, model = engine.controller.tokenizer, engine.controller.inference_wrapped_model.model
    for i, text in enumerate(TEXTS):
        tokens, log_probs = _greedy_loop(model, tok.tokenize(text), NEW, tok.eod)
        assert data["tokens"][i] == tokens
        assert data["text"][i] == text + tok.detokenize(tokens[len(tok.tokenize(text)):])
        assert data["logprobs"][i] == pytest.approx(log_probs, abs=1e-5)
        assert "".join(data["segments"][i]) == tok.detokenize(tokens[len(tok.tokenize(text)):])


def test_static_engine_through_run_mcore_engine():
    from megatron_core.inference.text_generation_server.run_mcore_engine import run_mcore_engine

    static, dynamic = _engine(static=True), _engine()
    expected = run_mcore_engine(dynamic, TEXTS, top_k=1, logprobs=False, tokens_to_generate=NEW)
    got = run_mcore_engine(static, TEXTS, top_k=1, logprobs=False, tokens_to_generate=NEW)
    assert got["tokens"] == expected["tokens"] and got["text"] == expected["text"] and "logprobs" not in got


@pytest.mark.parametrize("body, message", [
    ({"tokens_to_generate": 4}, "prompts argument required"),
    ({"prompts": ["a"], "max_len": 4}, "max_len is no longer used.  Replace with tokens_to_generate"),
    ({"prompts": ["a"], "sentences": ["a"]}, "sentences is no longer used.  Replace with prompts"),
    ({"prompts": ["a"], "beam_width": 2}, "Beam search is no longer supported."),
    ({"prompts": "a"}, "prompts is not a list of strings"),
    ({"prompts": []}, "prompts is empty"),
    ({"prompts": ["a"] * 129}, "Maximum number of prompts is 128"),
    ({"prompts": ["a"], "tokens_to_generate": 1.5}, "tokens_to_generate must be an integer greater than 0"),
    ({"prompts": ["a"], "tokens_to_generate": -1}, "tokens_to_generate must be an integer greater than or equal to 0"),
    ({"prompts": ["a"], "logprobs": "yes"}, "logprobs must be a boolean value"),
    ({"prompts": ["a"], "tokens_to_generate": 0}, "tokens_to_generate=0 implies logprobs should be True"),
    ({"prompts": ["a"], "temperature": 0.0}, "temperature must be a positive number less than or equal to 100.0"),
    ({"prompts": ["a"], "top_k": 1001}, "top_k must be equal to or greater than 0 and less than or equal to 1000"),
    ({"prompts": ["a"], "top_p": 1}, "top_p must be a positive float less than or equal to 1.0"),
    ({"prompts": ["a"], "top_k": 2, "top_p": 0.5}, "cannot set both top-k and top-p samplings."),
    ({"prompts": ["a"], "top_p_decay": 0.5}, "top_p_decay cannot be set without top_p"),
    ({"prompts": ["a"], "top_p": 0.5, "top_p_bound": 0.9}, "top_p_bound must be greater than 0 and less than top_p"),
    ({"prompts": ["a"], "add_BOS": 1}, "add_BOS must be a boolean value"),
    ({"prompts": [""]}, "Empty prompts require add_BOS=true"),
    ({"prompts": ["a"], "stop_on_eol": "no"}, "stop_on_eol must be a boolean value"),
    ({"prompts": ["a"], "random_seed": -3}, "random_seed must be a positive integer"),
    ({"prompts": ["a"], "stop_token": "x"}, "stop_token must be an integer"),
    ({"prompts": ["a"], "length_penalty": 1}, "length_penalty must be a float"),
])
def test_put_api_field_validation(client, body, message):
    reply = client[0].put("/api", json=body)
    assert reply.status_code == 400 and reply.json() == message


def test_bad_json_and_completions(client):
    test_client, engine = client
    reply = test_client.put("/api", content=b"{oops", headers={"content-type": "application/json"})
    assert reply.status_code == 400 and "not valid JSON" in reply.json()
    assert test_client.post("/completions", json={"prompt": "a"}).json() == "max_tokens is required"
    assert test_client.post("/completions", json={"prompt": "a", "max_tokens": 2, "n": 2}).status_code == 400
    assert test_client.post("/completions", json={"prompt": [], "max_tokens": 2}).status_code == 400
    tok = engine.controller.tokenizer
    reply = test_client.post("/completions", json={"prompt": TEXTS[0], "max_tokens": NEW, "temperature": 0})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    model = engine.controller.inference_wrapped_model.model
    tokens, log_probs = _greedy_loop(model, tok.tokenize(TEXTS[0]), NEW, tok.eod)
    start = len(tok.tokenize(TEXTS[0]))
    assert choice["text"] == tok.detokenize(tokens[start:])
    kept = len(choice["logprobs"]["tokens"])
    assert choice["logprobs"]["token_logprobs"] == pytest.approx(log_probs[start - 1:start - 1 + kept], abs=1e-5)
    echoed = test_client.post("/completions", json={"prompt": [tok.tokenize(TEXTS[1])], "max_tokens": NEW,
                                                     "temperature": 0, "echo": True}).json()["choices"][0]
    assert echoed["text"].startswith(TEXTS[1]) and echoed["logprobs"]["token_logprobs"][0] is None


def _two_ranks() -> list:
    """Rank 0 serves PUT /api; rank 1 follows the broadcasts (Megatron's server loop) and records its results."""
    import torch.distributed as dist
    from fastapi.testclient import TestClient

    from megatron_core.device import get_current_device
    from megatron_core.inference.text_generation_server import MegatronServer
    from megatron_core.inference.text_generation_server.endpoints.common import GENERATE_NUM
    from megatron_core.inference.text_generation_server.run_mcore_engine import run_mcore_engine

    engine = _engine()
    if dist.get_rank() == 0:
        with TestClient(MegatronServer(engine).app) as test_client:
            replies = [test_client.put("/api", json={"prompts": TEXTS[:n], "tokens_to_generate": NEW, "top_k": 1})
                       for n in (1, 3)]
        dist.broadcast(torch.tensor([STOP_SERVING], device=get_current_device()), 0)
        return [r.json()["tokens"] for r in replies]
    seen, generate = [], engine.generate

    def recording(*args, **kwargs):
        results = generate(*args, **kwargs)
        seen.append([list(r.merge().prompt_tokens) + list(r.merge().generated_tokens) for r in results])
        return results

    engine.generate = recording
    while True:
        choice = torch.tensor([-1], device=get_current_device())
        dist.broadcast(choice, 0)
        if int(choice) != GENERATE_NUM:
            return seen
        assert run_mcore_engine(engine) is None


def test_send_do_generate_on_two_gloo_ranks():
    served, followed = run_on_ranks(2, _two_ranks)
    assert followed == served and len(served[1]) == 3
