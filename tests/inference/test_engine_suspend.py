"""``DynamicInferenceEngine.suspend()`` / ``resume()`` in the three ``kv_cache_management_mode``s (CPU, fp32).

Several requests are generated part-way (some decoding, some prefilling, some still waiting), the engine is
suspended, the context's buffers are checked (kept, copied to the host, or gone), the engine is resumed and the
requests finished: greedy outputs equal an uninterrupted run, for a GPT and for a hybrid (Mamba + attention) model.
Also: idempotence, the InferenceMode flag, refused steps and context calls while suspended, an overlapped decode
step in flight at suspend, the prefix cache reset by RECOMPUTE, the asyncio loop, shutdown while suspended, and the
CUDA-graph drop (the GPU test at the end checks memory and recaptured graphs on a device).
"""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from megatron_core.inference.config import InferenceConfig, KVCacheManagementMode, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.dynamic_context import StepEntry, TensorStateDeallocatedError
from megatron_core.inference.engines import DynamicInferenceEngine, EngineState, EngineSuspendedError
from megatron_core.inference.inference_request import Status
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.inference.utils import InferenceMode
from megatron_core.models.hybrid import HybridModel
from tests.inference.coordinator_fixture import tiny_gpt
from tests.inference.hybrid_fixture import MAX_SEQ, build_hybrid
from tests.inference.hybrid_fixture import prompts as hybrid_prompts
from tests.inference.llama_fixture import prompts as gpt_prompts

MODES = list(KVCacheManagementMode)
NEW = 10
LENGTHS = (5, 13, 7, 21, 4, 9)


@pytest.fixture(scope="module")
def gpt():
    return tiny_gpt()


@pytest.fixture(scope="module")
def hybrid():
    return build_hybrid("M*M-", chunk_size=4)


def _engine(model, mode=KVCacheManagementMode.PERSIST, device: str = "cpu", **settings) -> DynamicInferenceEngine:
    config = dict(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ, max_requests=4, max_tokens=24,
                  kv_cache_management_mode=mode)
    config.update(settings)
    if isinstance(model, HybridModel):
        config["mamba_inference_state_config"] = MambaInferenceStateConfig.from_model(model)
    context = DynamicInferenceContext(model.config, InferenceConfig(**config))
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)
    assert context.device.type == device
    return engine


def _greedy(n: int = NEW) -> SamplingParams:
    return SamplingParams(top_k=1, num_tokens_to_generate=n, termination_id=-1)


def _add(engine, prompts):
    return [engine.add_request(i, p, _greedy()) for i, p in enumerate(prompts)]


def _finish(engine, futures) -> list[list[int]]:
    while not all(f.done() for f in futures):
        engine.step_modern()
    results = [f.result(timeout=60) for f in futures]
    assert all(r.status == Status.COMPLETED for r in results)
    assert engine.context.block_allocator.get_total_used() == 0
    return [r.generated_tokens for r in results]


def _kv_tensors(context) -> list[torch.Tensor]:
    return [t for pair in context.kv_memory.values() for t in pair]


def _mamba_tensors(context) -> list[torch.Tensor]:
    slots = context.mamba_slots
    return [] if slots is None else [*slots.conv_states.values(), *slots.ssm_states.values()]


def _check_suspended(engine, mode, before: list[torch.Tensor], copies: list[torch.Tensor]) -> None:
    """The context's buffers after suspend: kept (PERSIST), on the host (OFFLOAD) or gone (RECOMPUTE)."""
    context = engine.context
    assert engine.state == EngineState.SUSPENDED and engine.is_suspended and not InferenceMode.is_active()
    assert not context.is_tensor_state_allocated
    refs = [weakref.ref(t) for t in before]
    before.clear()
    gc.collect()
    if mode == KVCacheManagementMode.PERSIST:
        assert all(r() is not None for r in refs) and _kv_tensors(context)
        return
    assert all(r() is None for r in refs), "a released buffer is still alive"
    assert context.kv_memory == {} and not _mamba_tensors(context)
    held = list(context._released_kv.values())
    if context.mamba_slots is not None:
        held += [b for released in context.mamba_slots._released for b in released.values()]
    assert len(held) == len(copies)
    if mode == KVCacheManagementMode.OFFLOAD:
        for buffer, copy in zip(held, copies):
            assert buffer.host_copy.device.type == "cpu"
            torch.testing.assert_close(buffer.host_copy, copy, rtol=0, atol=0)
    else:
        assert all(buffer.host_copy is None for buffer in held)


def _suspend_mid_generation(model, prompts, mode, steps: int = 5) -> list[list[int]]:
    """Generate ``steps`` steps, suspend, check, resume, finish; returns the generated tokens."""
    engine = _engine(model, mode)
    futures = _add(engine, prompts)
    for _ in range(steps):
        engine.step_modern()
    running, waiting = list(engine.running), list(engine.waiting)
    assert running and waiting  # some requests hold KV blocks, some are still queued
    assert any(engine.requests[r].generated_tokens for r in running)
    before = _kv_tensors(engine.context) + _mamba_tensors(engine.context)
    copies = [t.clone() for t in before]
    assert InferenceMode.is_active()

    engine.suspend()
    _check_suspended(engine, mode, before, copies)
    recompute = mode == KVCacheManagementMode.RECOMPUTE
    assert engine.resume_request_ids == (running + waiting if recompute else waiting)
    assert engine.running == ([] if recompute else running) and not engine.waiting
    engine.suspend()  # idempotent
    assert engine.state == EngineState.SUSPENDED and engine.resume_request_ids

    with pytest.raises(EngineSuspendedError) as error:
        engine.step_modern()
    assert error.value.args == (engine.context.step_count,)
    with pytest.raises(TensorStateDeallocatedError, match="add_request"):
        engine.context.add_request("late")
    with pytest.raises(TensorStateDeallocatedError, match="initialize_attention_state"):
        engine.context.initialize_attention_state([StepEntry(running[0], [1], 0)])

    engine.resume()
    assert engine.state == EngineState.RUNNING and InferenceMode.is_active()
    assert engine.context.is_tensor_state_allocated and not engine.resume_request_ids
    after = _kv_tensors(engine.context) + _mamba_tensors(engine.context)
    assert len(after) == len(copies)
    for tensor, copy in zip(after, copies):
        if recompute:
            assert not tensor.any()
        else:
            torch.testing.assert_close(tensor, copy, rtol=0, atol=0)
    if recompute:
        assert engine.context.total_request_count == 0 and list(engine.waiting) == running + waiting
        assert all(engine.requests[r].num_evictions == 1 for r in running)
    else:
        assert engine.running == running and list(engine.waiting) == waiting
    engine.resume()  # idempotent
    assert engine.state == EngineState.RUNNING
    return _finish(engine, futures)


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_gpt_suspend_resume_matches_uninterrupted(gpt, mode):
    prompts = gpt_prompts(LENGTHS)
    reference = _engine(gpt)
    expected = _finish(reference, _add(reference, prompts))
    assert _suspend_mid_generation(gpt, prompts, mode) == expected


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_hybrid_suspend_resume_matches_uninterrupted(hybrid, mode):
    prompts = hybrid_prompts(list(LENGTHS))
    reference = _engine(hybrid)
    expected = _finish(reference, _add(reference, prompts))
    assert _suspend_mid_generation(hybrid, prompts, mode) == expected


def test_suspend_before_any_forward_and_resume(gpt):
    prompts = gpt_prompts(LENGTHS[:3])
    reference = _engine(gpt)
    expected = _finish(reference, _add(reference, prompts))
    engine = _engine(gpt, KVCacheManagementMode.RECOMPUTE)
    futures = _add(engine, prompts)
    engine.suspend()  # nothing allocated yet, requests still in the inbox
    assert engine.context.kv_memory == {} and engine.resume_request_ids == []
    engine.resume()
    assert _finish(engine, futures) == expected


def test_context_alone_deallocate_and_reinitialize_are_idempotent(gpt):
    engine = _engine(gpt, KVCacheManagementMode.OFFLOAD)
    futures = _add(engine, gpt_prompts(LENGTHS[:2]))
    engine.step_modern()
    context = engine.context
    copies = [t.clone() for t in _kv_tensors(context)]
    context.deallocate_inference_state_buffers()
    released = dict(context._released_kv)
    context.deallocate_inference_state_buffers()  # no second copy
    assert context._released_kv == released
    with pytest.raises(TensorStateDeallocatedError, match="attention"):
        context._layer_memory(1, context.num_groups_local, context.head_dim, copies[0])
    context.reinitialize_inference_state_buffers()
    restored = _kv_tensors(context)
    context.reinitialize_inference_state_buffers()
    assert _kv_tensors(context) == restored  # same objects: nothing allocated twice
    for tensor, copy in zip(restored, copies):
        torch.testing.assert_close(tensor, copy, rtol=0, atol=0)
    _finish(engine, futures)


def test_hybrid_mamba_states_refused_while_released(hybrid):
    engine = _engine(hybrid, KVCacheManagementMode.RECOMPUTE)
    _add(engine, hybrid_prompts([6]))
    engine.step_modern()
    engine.suspend()
    layer = next(iter(engine.context.mamba_slots._released[0]))
    with pytest.raises(TensorStateDeallocatedError, match="mamba_states_cache"):
        engine.context.mamba_states_cache(layer)
    with pytest.raises(TensorStateDeallocatedError, match=f"layer {layer}"):
        engine.context.mamba_slots.states(layer, torch.device("cpu"))
    engine.resume()
    conv, ssm = engine.context.mamba_states_cache(layer)
    assert not conv.any() and not ssm.any()


def test_recompute_resets_the_prefix_cache(gpt):
    shared = gpt_prompts((16,))[0]
    prompts = [shared + [3, 5], shared + [7], shared + [11, 13, 17]]
    config = dict(enable_prefix_caching=True)
    reference = _engine(gpt, **config)
    expected = _finish(reference, _add(reference, prompts))
    engine = _engine(gpt, KVCacheManagementMode.RECOMPUTE, **config)
    futures = _add(engine, prompts)
    for _ in range(3):
        engine.step_modern()
    assert engine.context.block_allocator.kv_hash_to_block_id
    engine.suspend()
    engine.resume()
    assert not engine.context.block_allocator.kv_hash_to_block_id
    assert engine.context.block_allocator.get_total_used() == 0
    assert _finish(engine, futures) == expected


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_overlapped_decode_step_in_flight_at_suspend(gpt, mode):
    prompts = gpt_prompts(LENGTHS[:4])

    def overlapped(kv_mode):
        engine = _engine(gpt, kv_mode, num_cuda_graphs=4)
        engine.context.pad_decode_steps_on_cpu = True  # the CUDA-graph layout, run eagerly
        engine.overlap_decode_steps = True
        return engine

    reference = overlapped(KVCacheManagementMode.PERSIST)
    expected = _finish(reference, _add(reference, prompts))
    engine = overlapped(mode)
    futures = _add(engine, prompts)
    for _ in range(20):
        if engine._inflight is not None:
            break
        engine.step_modern()
    assert engine._inflight is not None
    inflight = [e.request_id for e in engine._inflight.entries]
    lengths = {r: len(engine.requests[r].generated_tokens) for r in inflight}
    engine.suspend()
    assert engine._inflight is None  # its tokens were booked before the buffers went
    assert all(len(engine.requests[r].generated_tokens) == lengths[r] + 1 for r in inflight)
    engine.resume()
    assert _finish(engine, futures) == expected


@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_cuda_graphs_dropped_unless_persisted(gpt, mode):
    engine = _engine(gpt, mode)
    wrapper = engine.controller.inference_wrapped_model
    runner = wrapper.decode_graphs
    runner.graphs[1] = ("captured graph", torch.zeros(1))  # stands in for a graph captured over the buffers
    engine.suspend()
    engine.resume()
    if mode == KVCacheManagementMode.PERSIST:
        assert wrapper.decode_graphs is runner and 1 in runner.graphs
    else:
        assert wrapper.decode_graphs is not runner and not wrapper.decode_graphs.graphs


def test_pause_and_unpause_refused_while_suspended(gpt):
    engine = _engine(gpt, KVCacheManagementMode.OFFLOAD)
    engine.pause()
    engine.suspend()  # from PAUSED, as the coordinator does
    for call in (engine.pause, engine.unpause):
        with pytest.raises(RuntimeError, match=f"{call.__name__}: the engine is suspended"):
            call()
    assert engine.state == EngineState.SUSPENDED
    engine.resume()
    assert engine.state == EngineState.RUNNING


def test_cancel_and_shutdown_while_suspended(gpt):
    engine = _engine(gpt, KVCacheManagementMode.RECOMPUTE)
    futures = _add(engine, gpt_prompts(LENGTHS))
    for _ in range(3):
        engine.step_modern()
    engine.suspend()
    asyncio.run(engine.shutdown())  # cancels without a step: the buffers stay released
    results = [f.result(timeout=5) for f in futures]
    assert all(r.status == Status.FAILED for r in results)
    assert engine.resume_request_ids == [] and not engine.context.is_tensor_state_allocated


def test_run_engine_loop_suspend_resume(gpt):
    prompts = gpt_prompts(LENGTHS)
    reference = _engine(gpt)
    expected = _finish(reference, _add(reference, prompts))
    engine = _engine(gpt, KVCacheManagementMode.RECOMPUTE)

    async def main():
        loop_task = asyncio.create_task(engine.run_engine())
        futures = [asyncio.wrap_future(f) for f in _add(engine, prompts)]
        while not any(engine.requests[r].generated_tokens for r in list(engine.running)):
            await asyncio.sleep(0.001)
        engine.suspend()  # waits for a step in progress
        assert engine.state == EngineState.SUSPENDED
        generated = {r: len(q.generated_tokens) for r, q in engine.requests.items()}
        await asyncio.sleep(0.2)
        assert {r: len(q.generated_tokens) for r, q in engine.requests.items()} == generated  # no steps
        assert not any(f.done() for f in futures)
        engine.resume()
        results = await asyncio.wait_for(asyncio.gather(*futures), 60)
        await engine.shutdown()
        await asyncio.wait_for(loop_task, 60)
        return [r.generated_tokens for r in results]

    assert asyncio.run(main()) == expected
    assert engine.state == EngineState.STOPPED


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", MODES, ids=lambda m: m.value)
def test_gpu_memory_and_cuda_graphs(mode):
    """On a GPU with decode CUDA graphs: OFFLOAD / RECOMPUTE free the KV and Mamba buffers (pinned host copies
    for OFFLOAD) and capture graphs again after resume; PERSIST frees nothing and keeps its graphs; greedy outputs
    equal an uninterrupted run."""
    models = {"gpt": tiny_gpt().cuda(), "hybrid": build_hybrid("M*M-", chunk_size=4).cuda()}
    for name, model in models.items():
        prompts = gpt_prompts(LENGTHS) if name == "gpt" else hybrid_prompts(list(LENGTHS))
        reference = _engine(model, device="cuda", num_cuda_graphs=4)
        expected = _finish(reference, _add(reference, prompts))
        engine = _engine(model, mode, device="cuda", num_cuda_graphs=4)
        futures = _add(engine, prompts)
        for _ in range(12):
            engine.step_modern()
        runner = engine.controller.inference_wrapped_model.decode_graphs
        assert runner.graphs, "no decode step was captured before the suspend"
        buffer_bytes = sum(t.numel() * t.element_size()
                           for t in _kv_tensors(engine.context) + _mamba_tensors(engine.context))
        torch.cuda.synchronize()
        allocated = torch.cuda.memory_allocated()
        engine.suspend()
        freed = allocated - torch.cuda.memory_allocated()
        if mode == KVCacheManagementMode.PERSIST:
            assert freed <= 0 and engine.controller.inference_wrapped_model.decode_graphs is runner
        else:
            assert freed >= buffer_bytes, (name, freed, buffer_bytes)
            assert not engine.controller.inference_wrapped_model.decode_graphs.graphs
        if mode == KVCacheManagementMode.OFFLOAD:
            assert all(b.host_copy.is_pinned() for b in engine.context._released_kv.values())
        engine.resume()
        if mode != KVCacheManagementMode.PERSIST:
            assert torch.cuda.memory_allocated() - allocated + freed >= buffer_bytes
        assert _finish(engine, futures) == expected, name
        assert engine.controller.inference_wrapped_model.decode_graphs.graphs  # captured (again) after resume
