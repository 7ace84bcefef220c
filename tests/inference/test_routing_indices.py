"""Rollout routing replay in the dynamic engine: ``request.routing_indices`` (CPU, fp32).

With ``moe_enable_routing_replay`` every completed request carries the experts each of its tokens was routed
to, ``[total_tokens - 1, num_moe_layers, topk]`` (the last generated token is never fed). The oracle: the
same tokens through the same model, one request alone in one plain forward with the routers recording, route
identically, whatever shared the engine's steps with them (batched decode, chunked prefill, pauses and
evictions, the padded CUDA-graph layout, prefix-cached blocks). Without the flag nothing changes.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megatron_core.inference.config import InferenceConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.inference_request import DynamicInferenceEventType, DynamicInferenceRequest
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
from tests.transformer.moe.moe_parallel_utils import VOCAB, build

NEW, TOPK, LAYERS = 4, 2, 2
LENGTHS = (3, 9, 6, 11)  # prompt + NEW stays within the test model's 16 positions


@pytest.fixture(autouse=True)
def _no_routers_left():
    """Every test starts and ends with no registered replay instances."""
    RouterReplay.clear_global_router_replay_instances()
    yield
    RouterReplay.clear_global_router_replay_instances()


def _model(replay: bool = True, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return build("mixtral", moe_enable_routing_replay=replay).eval()


def _prompts(lengths=LENGTHS, seed: int = 5) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=gen).tolist() for n in lengths]


def _engine(model: torch.nn.Module, pad_decode: bool = False, **config) -> DynamicInferenceEngine:
    settings = dict(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=16)
    settings.update(config)
    context = DynamicInferenceContext(model.config, InferenceConfig(**settings))
    context.pad_decode_steps_on_cpu = pad_decode
    return DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)


def _generate(engine: DynamicInferenceEngine, prompts: list[list[int]]) -> list[DynamicInferenceRequest]:
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    return [record.merge() for record in engine.generate(prompts, params)]


def _oracle(model: torch.nn.Module, tokens: list[int]) -> np.ndarray:
    """Each router's top-k for ``tokens`` in one plain forward of the request alone: ``[n, layers, topk]``."""
    RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
    try:
        with torch.no_grad():
            model(torch.tensor([tokens]), torch.arange(len(tokens)).unsqueeze(0), None)
        return torch.stack(RouterReplay.get_recorded_data(), dim=1).numpy()
    finally:
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()


def _check(model: torch.nn.Module, requests: list[DynamicInferenceRequest]) -> None:
    for request in requests:
        tokens = list(request.prompt_tokens) + request.generated_tokens
        assert len(request.generated_tokens) == NEW
        routing = request.routing_indices
        assert isinstance(routing, np.ndarray) and routing.dtype == np.int16
        assert routing.shape == (len(tokens) - 1, LAYERS, TOPK)
        np.testing.assert_array_equal(routing, _oracle(model, tokens[:-1]),
                                      err_msg=f"request {request.request_id}")


def _routers_untouched() -> bool:
    return all(r.router_replay_action is None and r.static_buffer is None and r.recorded_topk_idx is None
               for r in RouterReplay.global_router_replay_instances)


def test_batched_requests_get_their_own_routing():
    model = _model()
    engine = _engine(model)
    requests = _generate(engine, _prompts())
    _check(model, requests)
    assert _routers_untouched()  # recording is scoped to the engine's forwards
    assert engine.context.block_allocator.get_total_used() == 0


def test_chunked_prefill():
    model = _model()
    engine = _engine(model, max_tokens=5, max_requests=3, enable_chunked_prefill=True)
    _check(model, _generate(engine, _prompts()))


def test_paused_and_evicted_requests():
    model = _model()
    # 2 layers * 2 groups * 4 dims * 4 bytes * 2 (k, v) = 128 bytes per token; 4-token blocks: 512 bytes each.
    engine = _engine(model, buffer_size_gb=5 * 512 / 1024**3, track_paused_request_events=True)
    assert engine.context.total_block_count == 5
    requests = _generate(engine, _prompts())
    _check(model, requests)
    assert engine.evicted_request_count > 0 and any(r.num_evictions for r in requests)
    assert any(e.type is DynamicInferenceEventType.PAUSE for r in requests for e in r.events)


def test_padded_decode_layout():
    """The CUDA-graph layout on CPU: padding rows are routed too and must be left out."""
    model = _model()
    engine = _engine(model, pad_decode=True, num_cuda_graphs=4, max_requests=3)
    _check(model, _generate(engine, _prompts()))
    assert engine.context.graph_inputs  # padded decode steps ran


def test_prefix_cached_blocks_bring_their_routing():
    model = _model()
    engine = _engine(model, enable_prefix_caching=True)
    system = _prompts((8,), seed=7)[0]
    prompts = [system + tail for tail in _prompts((2, 3), seed=8)]
    params = SamplingParams(top_k=1, num_tokens_to_generate=NEW, termination_id=-1)
    first = engine.add_request(0, prompts[0], params)
    engine.step_modern()  # the first request's prompt blocks are cached before the second one arrives
    second = engine.add_request(1, prompts[1], params)
    while not (first.done() and second.done()):
        engine.step_modern()
    assert second.result(timeout=60).num_cached_tokens == 8
    _check(model, [first.result(timeout=60), second.result(timeout=60)])


def test_without_routing_replay_nothing_is_recorded():
    bystander = _model(replay=True, seed=1)  # another model whose routers must not be touched
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    model = _model(replay=False)
    engine = _engine(model)
    assert engine.context.moe_routing_metadata is None and engine.controller.router_replays is None
    requests = _generate(engine, _prompts())
    assert all(r.routing_indices is None for r in requests)
    assert all(r.router_replay_action is RouterReplayAction.REPLAY_FORWARD and r.recorded_topk_idx is None
               and r.static_buffer is None for r in RouterReplay.global_router_replay_instances)
    assert len(RouterReplay.global_router_replay_instances) == LAYERS and bystander is not None
    assert "routing_indices" in requests[0].serialize() and requests[0].serialize()["routing_indices"] is None


def test_serialized_request_carries_routing_indices():
    model = _model()
    request = _generate(_engine(model), _prompts((5,)))[0]
    kind, payload = request.serialize()["routing_indices"]
    assert kind == "ndarray" and payload["dtype"] == "int16"
    np.testing.assert_array_equal(np.array(payload["data"], dtype=payload["dtype"]), request.routing_indices)
    request.routing_indices = request.routing_indices[:-1]
    with pytest.raises(ValueError, match="routing_indices has 7 rows; the model was fed 8 tokens"):
        request.serialize()
