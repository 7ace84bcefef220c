"""HybridModel (Mamba + attention) under the dynamic context and engine, fp32 on CPU.

The Mamba layers' state-carrying prefill (also split into chunks) and single-token decode give the logits of
the full-sequence forward at every position, for requests decoding and prefilling in one step; the engine's
greedy outputs equal a plain loop that re-runs the full forward on the growing sequence, with more requests
than fit in a step (some wait), chunked prefill, and pauses/evictions when KV blocks run out; slots are
freed when requests leave; the padded CUDA-graph decode layout (run without graphs here) gives the same tokens.
Prefix caching and the legacy static context are refused by name.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.inference.contexts.mamba_states import MambaStateSlots
from tests.inference.hybrid_fixture import (
    MAX_SEQ,
    build_hybrid,
    greedy_params,
    hybrid_engine,
    plain_greedy,
    prompts,
)

NEW = 6


@pytest.fixture(scope="module")
def model():
    return build_hybrid("M*M-", chunk_size=4)


def _context(model, **settings) -> DynamicInferenceContext:
    config = dict(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ, max_requests=4,
                  materialize_only_last_token_logits=False)
    config.update(settings)
    return DynamicInferenceContext(model.config, InferenceConfig(
        mamba_inference_state_config=MambaInferenceStateConfig.from_model(model), **config))


@torch.no_grad()
def _full_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], None)[0]


@torch.no_grad()
def _run_step(model, ctx: DynamicInferenceContext, entries: list[StepEntry]) -> dict:
    """One forward over the context; each request's logits rows ``[n, V]``."""
    for e in entries:
        assert ctx.grow_request(e.request_id, e.start + len(e.tokens))
    ctx.initialize_attention_state(entries)
    input_ids, position_ids = ctx.current_input_and_position_ids()
    logits = model(input_ids, position_ids, None, inference_context=ctx)[0]
    ctx.commit_step()
    return {e.request_id: logits[e.logit_rows] for e in ctx.step_entries}


@pytest.mark.parametrize("pattern", ["M*M-", "MM"])
def test_chunked_prefill_and_decode_give_the_full_forward_logits(pattern):
    """Request 0 prefills in chunks of 5 and 6 tokens, then decodes while request 1 prefills in the same step,
    then both decode; every row equals the full forward's logits at that position (fp32, 1e-5)."""
    model = build_hybrid(pattern, chunk_size=4)
    ctx = _context(model)
    a, b = prompts([11, 7], seed=3)
    a_seq, b_seq = a + prompts([4], seed=4)[0], b + prompts([3], seed=5)[0]
    full_a, full_b = _full_logits(model, a_seq), _full_logits(model, b_seq)
    ctx.add_request(0)
    out = _run_step(model, ctx, [StepEntry(0, a[:5], 0, sample=False)])
    torch.testing.assert_close(out[0], full_a[:5], atol=1e-5, rtol=1e-5)
    out = _run_step(model, ctx, [StepEntry(0, a[5:], 5)])
    torch.testing.assert_close(out[0], full_a[5:11], atol=1e-5, rtol=1e-5)
    ctx.add_request(1)
    out = _run_step(model, ctx, [StepEntry(0, [a_seq[11]], 11), StepEntry(1, b, 0)])
    assert ctx.num_decode == 1
    torch.testing.assert_close(out[0], full_a[11:12], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[1], full_b[:7], atol=1e-5, rtol=1e-5)
    for step in range(3):
        out = _run_step(model, ctx, [StepEntry(1, [b_seq[7 + step]], 7 + step),
                                     StepEntry(0, [a_seq[12 + step]], 12 + step)])
        torch.testing.assert_close(out[0], full_a[12 + step:13 + step], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out[1], full_b[7 + step:8 + step], atol=1e-5, rtol=1e-5)


def test_slots_are_allocated_zeroed_and_freed():
    """A request gets a free slot whose states are zero even after another request used it; leaving frees it."""
    model = build_hybrid("M*M-")
    ctx = _context(model, max_requests=2)
    slots = ctx.mamba_slots
    assert slots.num_mamba_layers == 2 and slots.free_count == 2
    ctx.add_request("a")
    _run_step(model, ctx, [StepEntry("a", prompts([6])[0], 0)])
    conv, ssm = ctx.mamba_states_cache(1)  # two slots and the scratch slot
    assert conv.shape == (3, *ctx.inference_config.mamba_inference_state_config.conv_states_shape)
    assert ssm.shape == (3, 4, 8, 8) and ssm[slots.slot("a")].abs().sum() > 0
    used = slots.slot("a")
    ctx.release_request("a")
    assert slots.free_count == 2
    ctx.add_request("b")
    assert slots.slot("b") == used and ssm[used].abs().sum() == 0 and conv[used].abs().sum() == 0
    ctx.reset()
    assert slots.free_count == 2 and not slots.request_slot


def test_engine_greedy_equals_plain_loop_with_waiting_requests(model):
    """Seven prompts of 2..14 tokens through a context of 2 request slots: later requests wait and join as
    earlier ones finish; every greedy output equals the plain loop's, and every slot is free at the end."""
    batch = prompts([3, 9, 5, 14, 7, 2, 11])
    lengths = [NEW, NEW, 3, NEW, 9, NEW, 4]
    expected = [plain_greedy(model, p, n) for p, n in zip(batch, lengths)]
    engine = hybrid_engine(model, max_requests=2)
    futures = [engine.add_request(i, p, greedy_params(n)) for i, (p, n) in enumerate(zip(batch, lengths))]
    waited = False
    while not all(f.done() for f in futures):
        engine.step_modern()
        waited |= len(engine.waiting) > 0 and len(engine.running) == 2
    assert waited
    assert [f.result(timeout=60).generated_tokens for f in futures] == expected
    assert engine.context.mamba_slots.free_count == 2 and engine.context.total_request_count == 0


def test_engine_chunked_prefill_pauses_and_evictions(model):
    """Prompts longer than a step (chunked prefill) and too few KV blocks for all running requests (pauses and
    evictions, which re-prefill with fresh Mamba states): the greedy outputs still equal the plain loop's."""
    batch = prompts([13, 10, 14, 9], seed=7)
    expected = [plain_greedy(model, p, 8) for p in batch]
    per_request = MambaStateSlots.bytes_per_request(MambaInferenceStateConfig.from_model(model))
    block_bytes = 2 * 1 * 4 * 2 * 4 * 4  # K and V, one attention layer, 4 tokens, 2 groups of 4, fp32
    engine = hybrid_engine(model, max_requests=3, max_tokens=8, enable_chunked_prefill=True,
                           buffer_size_gb=(4 * per_request + 8 * block_bytes) / 1024**3)
    assert engine.context.total_block_count == 8
    futures = [engine.add_request(i, p, greedy_params(8)) for i, p in enumerate(batch)]
    paused = 0
    while not all(f.done() for f in futures):
        paused += len(engine.step_modern()["paused_request_ids"])
    assert [f.result(timeout=60).generated_tokens for f in futures] == expected
    assert engine.evicted_request_count > 0 and paused > 0
    assert engine.context.mamba_slots.free_count == 3


@pytest.mark.parametrize("overlap", [False, True], ids=["legacy", "async"])
def test_padded_graph_decode_layout_equals_plain_loop(model, overlap):
    """The CUDA-graph decode layout, run without graphs on CPU: decode steps padded to 1, 2, 4 rows whose padding
    rows use the scratch slot (fixed-address slot tensors per batch size), also with the next step laid out
    before the previous one's tokens are read (async); greedy outputs equal the plain loop's."""
    batch = prompts([3, 9, 5, 6, 7], seed=17)
    lengths = [NEW, 2, 2, NEW, NEW]  # two finish early: 3 decode rows padded to 4 follow
    expected = [plain_greedy(model, p, n) for p, n in zip(batch, lengths)]
    engine = hybrid_engine(model, max_requests=4, num_cuda_graphs=4,
                           async_sched_mode="async" if overlap else "legacy")
    engine.context.pad_decode_steps_on_cpu = True
    futures = [engine.add_request(i, p, greedy_params(n)) for i, (p, n) in enumerate(zip(batch, lengths))]
    padded_batches = set()
    while not all(f.done() for f in futures):
        engine.step_modern()
        if engine.context.graph_batch_size is not None:
            padded_batches.add((engine.context.graph_batch_size, len(engine.context.step_entries)))
    assert [f.result(timeout=60).generated_tokens for f in futures] == expected
    assert any(size > rows for size, rows in padded_batches)  # some steps had padding rows
    slots = engine.context.mamba_slots
    assert sorted(slots._graph_slots) == sorted({size for size, _ in padded_batches})
    assert not overlap or engine.overlapped_step_count > 0
    assert slots.free_count == 4


def test_decode_state_snapshot_undoes_a_forward(model):
    """What the CUDA-graph warm-up relies on: after a padded decode step's forward, the snapshot taken before it
    puts every layer's states back, so running the step again gives the same logits and states."""
    ctx = _context(model, num_cuda_graphs=4, materialize_only_last_token_logits=True)
    ctx.pad_decode_steps_on_cpu = True
    for rid, prompt in enumerate(prompts([5, 8, 3], seed=19)):
        ctx.add_request(rid)
        _run_step(model, ctx, [StepEntry(rid, prompt, 0)])
    entries = [StepEntry(rid, [rid + 1], n) for rid, n in enumerate([5, 8, 3])]
    for e in entries:
        assert ctx.grow_request(e.request_id, e.start + 1)
    ctx.initialize_attention_state(entries)
    assert ctx.graph_batch_size == 4 and ctx.mamba_step_layout()[0].tolist()[3] == ctx.mamba_slots.scratch_slot
    before = {layer: (conv.clone(), ctx.mamba_slots.ssm_states[layer].clone())
              for layer, conv in ctx.mamba_slots.conv_states.items()}
    restore = ctx.snapshot_decode_states()
    with torch.no_grad():
        first = model(ctx.input_ids, ctx.position_ids, None, inference_context=ctx)
        after = {layer: conv.clone() for layer, conv in ctx.mamba_slots.conv_states.items()}
        restore()
        for layer, (conv, ssm) in before.items():
            torch.testing.assert_close(ctx.mamba_slots.conv_states[layer], conv, rtol=0, atol=0)
            torch.testing.assert_close(ctx.mamba_slots.ssm_states[layer], ssm, rtol=0, atol=0)
        again = model(ctx.input_ids, ctx.position_ids, None, inference_context=ctx)
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    for layer, conv in after.items():
        torch.testing.assert_close(ctx.mamba_slots.conv_states[layer], conv, rtol=0, atol=0)
    assert _context(build_hybrid("*-")).snapshot_decode_states() is None  # no Mamba layer: nothing to restore


def test_mamba_memory_comes_out_of_the_buffer(model):
    """Without mamba_memory_ratio the slots of max_requests requests (and the scratch slot) are taken first; with it
    the ratio caps max_requests; a buffer too small for them is refused by name."""
    per_request = MambaStateSlots.bytes_per_request(MambaInferenceStateConfig.from_model(model))
    assert per_request == 2 * (64 * 4 + 4 * 8 * 8) * 4
    ctx = _context(model, buffer_size_gb=(5 * per_request + 10 * 256) / 1024**3)
    assert ctx.max_requests == 4 and ctx.total_block_count == 10
    ctx = _context(model, buffer_size_gb=(20 * per_request) / 1024**3, mamba_memory_ratio=0.25, max_requests=8)
    assert ctx.max_requests == 4 and ctx.mamba_slots.max_requests == 4
    with pytest.raises(ValueError, match="cannot hold the Mamba states of max_requests"):
        _context(model, buffer_size_gb=(4 * per_request) / 1024**3)
    with pytest.raises(ValueError, match=r"mamba_memory_ratio \(1.5\)"):
        InferenceConfig(mamba_memory_ratio=1.5)


def test_refusals(model):
    """Prefix caching is refused for hybrid models with the reason; a hybrid model under a context without the
    Mamba config, or under the static context, fails by name."""
    with pytest.raises(ValueError, match="enable_prefix_caching=True cannot serve a hybrid model.*not per KV block"):
        _context(model, enable_prefix_caching=True)
    with pytest.raises(ValueError, match=r"prefix_caching_mamba_gb \(1.0\) must be None"):
        InferenceConfig(prefix_caching_mamba_gb=1.0)
    plain = DynamicInferenceContext(model.config, InferenceConfig(block_size_tokens=4, buffer_size_gb=0.01,
                                                                  max_sequence_length=MAX_SEQ, max_requests=2))
    plain.add_request(0)
    with pytest.raises(ValueError, match="without InferenceConfig.mamba_inference_state_config"):
        _run_step(model, plain, [StepEntry(0, [1, 2, 3], 0)])
    from megatron_core.inference.contexts.static_context import StaticInferenceContext

    with pytest.raises(NotImplementedError, match="StaticInferenceContext is not supported"), torch.no_grad():
        model(torch.tensor([[1, 2, 3]]), torch.arange(3)[None], None,
              inference_context=StaticInferenceContext(1, MAX_SEQ))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs_async", "graphs_compiled"])
def test_engine_greedy_equals_plain_loop_on_cuda(mode):
    """fp32 on CUDA (the paged decode kernel for attention, the compiled conv and Triton scan in the plain loop's
    forward), without and with CUDA-graph decode (padding rows on the scratch slot; overlapped scheduling; the
    compiled captured forward): token-for-token equal to the plain loop, with waiting requests and chunked prefill."""
    model = build_hybrid("M*M-M*", chunk_size=4).cuda()
    batch = prompts([3, 9, 5, 14, 7, 2, 11, 20], seed=9)
    lengths = [10, 4, 10, 7, 10, 3, 10, 10]
    expected = [plain_greedy(model, p, n) for p, n in zip(batch, lengths)]
    graphs = {"eager": {}, "graphs": dict(num_cuda_graphs=4),
              "graphs_async": dict(num_cuda_graphs=4, async_sched_mode="async"),
              "graphs_compiled": dict(num_cuda_graphs=4, compile_decode_graphs=True)}[mode]
    engine = hybrid_engine(model, max_requests=4, max_tokens=12, enable_chunked_prefill=True, **graphs)
    assert engine.context.device.type == "cuda"
    futures = [engine.add_request(i, p, greedy_params(n)) for i, (p, n) in enumerate(zip(batch, lengths))]
    graph_steps = 0
    while not all(f.done() for f in futures):
        engine.step_modern()
        graph_steps += engine.context.graph_batch_size is not None
    assert [f.result(timeout=60).generated_tokens for f in futures] == expected
    assert (graph_steps > 0) == (mode != "eager")
    assert engine.context.mamba_slots.free_count == 4
    conv, ssm = engine.context.mamba_states_cache(1)
    assert conv.is_cuda and ssm.is_cuda and ssm.dtype == torch.float32


def test_static_engine_serves_a_hybrid_model(model):
    """The (non-legacy) static engine builds its dynamic context with the model's Mamba state config: greedy
    outputs equal the plain loop's; the legacy static-batch loop refuses the Mamba layers by name."""
    from megatron_core.inference.contexts.static_context import StaticInferenceContext
    from megatron_core.inference.engines import StaticInferenceEngine
    from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
    from megatron_core.inference.text_generation_controllers import TextGenerationController

    batch = prompts([4, 10, 6], seed=13)
    expected = [plain_greedy(model, p, NEW) for p in batch]
    wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=2, max_sequence_length=MAX_SEQ))
    engine = StaticInferenceEngine(TextGenerationController(wrapper, tokenizer=None), max_batch_size=2,
                                   buffer_size_gb=0.01)
    assert engine.dynamic_engine.context.mamba_slots.max_requests == 2
    results = engine.generate(inference_requests=None, prompts=batch, sampling_params=greedy_params(NEW))
    assert [r.generated_tokens for r in results] == expected
    legacy_wrapper = GPTInferenceWrapper(model, StaticInferenceContext(max_batch_size=2, max_sequence_length=MAX_SEQ))
    legacy = StaticInferenceEngine(TextGenerationController(legacy_wrapper, tokenizer=None), max_batch_size=2,
                                   legacy=True)
    with pytest.raises(NotImplementedError, match="StaticInferenceContext is not supported"):
        legacy.generate(prompts=batch[:1], sampling_params=greedy_params(2))
