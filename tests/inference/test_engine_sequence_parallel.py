"""Sequence-parallel steps of the dynamic engine: each step padded to a multiple of the TP size.

The layout (one process): a mixed step of an odd token count gets one padding row (token 0, position 0, a slot of
the scratch block, no logits row); attention over it writes and returns exactly what the unpadded step does for the
real rows, zeros for the padding row, and leaves every request's KV slots as the unpadded step leaves them. The
decode CUDA-graph batch sizes are multiples of the TP size. Served (TP=2 with sequence parallelism on gloo ranks):
the CUDA-graph decode layout (run without graphs on CPU; decode batches of 1 and 3 padded to 2 and 4) gives the
one-process plain loop's tokens and log-probabilities, and its tokens also with the next step laid out before the
previous one's tokens are read (overlapped steps return no log-probabilities), for a dense GPT, an MoE model with shared experts and the hybrid Mamba model. What a padded,
sequence-split step cannot serve (speculative decoding, routing replay, MoE token dropping) is refused by name.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
from megatron_core.inference.contexts import DynamicInferenceContext
from megatron_core.inference.contexts.decode_graph_inputs import graph_batch_sizes
from megatron_core.inference.contexts.dynamic_context import StepEntry
from megatron_core.inference.contexts.step_layout import step_token_multiple
from megatron_core.inference.engines import DynamicInferenceEngine
from megatron_core.inference.engines.model_support import check_model_supported
from megatron_core.inference.model_inference_wrappers.gpt import GPTInferenceWrapper
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.text_generation_controllers import TextGenerationController
from megatron_core.models.hybrid import HybridModel
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks
from tests.inference.engine_feature_runner import (
    FEATURES,
    MAX_SEQ,
    PROMPTS,
    _init,
    _load,
    build,
    new_tokens,
    reference_runs,
)

TOL = dict(rtol=1e-5, atol=1e-5)
NAMES = ["gpt", "moe_shared_bias", "hybrid"]


def _config(sequence_parallel: bool) -> TransformerConfig:
    return TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=4, tensor_model_parallel_size=2,
                             sequence_parallel=sequence_parallel)


def test_step_token_multiple_is_the_tp_size_of_a_sequence_parallel_model() -> None:
    assert step_token_multiple(_config(True)) == 2
    assert step_token_multiple(_config(False)) == 1
    assert step_token_multiple(SimpleNamespace(tensor_model_parallel_size=1, sequence_parallel=True)) == 1


def test_graph_batch_sizes_are_rounded_up_to_the_multiple() -> None:
    assert graph_batch_sizes(3, multiple=2) == [2, 4]
    assert graph_batch_sizes(40, multiple=4) == [4, 8, 16, 32, 40]
    assert graph_batch_sizes(40, "linear", multiple=3) == [3, 6, 9, 18, 24, 33, 42]
    with pytest.raises(ValueError, match="multiple must be >= 1"):
        graph_batch_sizes(8, multiple=0)


def _mixed_step(sequence_parallel: bool) -> tuple[DynamicInferenceContext, torch.Tensor, torch.Tensor]:
    """A context with request 0 decoding (5 cached tokens) and request 1 prefilling 2 more tokens after 3 cached:
    3 real tokens. Returns the context laid out for that step and the attention output ``[T, 1, heads * hn]`` of
    fixed random query / key / value for its real rows (all caches prefilled with the same values)."""
    config = _config(sequence_parallel)
    ctx = DynamicInferenceContext(config, InferenceConfig(block_size_tokens=4, buffer_size_gb=0.001,
                                                          max_sequence_length=16, max_requests=2, max_tokens=8))
    gen = torch.Generator().manual_seed(3)
    heads, groups, hn = 2, 2, 4  # this rank's share of 4 heads at TP=2
    attention = SimpleNamespace(layer_number=1, config=config, core_attention=None)

    def attend(real: int) -> torch.Tensor:
        """Attention of the laid-out step on random rows for the ``real`` tokens and 5.0 for the padding."""
        qkv = torch.randn(3, real, 1, heads, hn, generator=gen)
        qkv = torch.cat([qkv, torch.full((3, ctx.input_ids.shape[1] - real, 1, heads, hn), 5.0)], dim=1)
        return ctx.attention(attention, qkv[0], qkv[1][..., :groups, :], qkv[2][..., :groups, :], None)

    for rid, cached in ((0, 5), (1, 3)):
        ctx.add_request(rid)
        assert ctx.grow_request(rid, cached)
        ctx.initialize_attention_state([StepEntry(rid, [1] * cached, 0)])
        attend(cached)
        ctx.request_kv_length[rid] = cached
    assert ctx.grow_request(0, 6) and ctx.grow_request(1, 5)
    ctx.initialize_attention_state([StepEntry(0, [7], 5), StepEntry(1, [8, 9], 3)])
    out = attend(3)
    return ctx, out, ctx._layer_memory(1, groups, hn, out)[0]


def test_padding_rows_write_the_scratch_block_and_attend_to_nothing() -> None:
    plain, plain_out, plain_keys = _mixed_step(False)
    ctx, out, keys = _mixed_step(True)
    assert plain.input_ids.shape == (1, 3) and ctx.input_ids.shape == (1, 4)
    assert (ctx.active_token_count, ctx.padded_active_token_count, ctx.padding_slice) == (3, 4, slice(3, 4))
    assert ctx.input_ids[0, 3].item() == 0 and ctx.position_ids[0, 3].item() == 0
    scratch = range(ctx.scratch_block * ctx.block_size_tokens, (ctx.scratch_block + 1) * ctx.block_size_tokens)
    assert ctx.slot_mapping[3].item() in scratch
    assert torch.equal(ctx.logit_index, plain.logit_index) and not ctx._all_rows
    hidden = torch.arange(4.0).view(4, 1, 1)
    assert ctx.select_logit_hidden_states(hidden).flatten().tolist() == plain.logit_index.float().tolist()
    torch.testing.assert_close(out[:3], plain_out, **TOL)
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    requests = slice(0, ctx.scratch_block * ctx.block_size_tokens)
    assert torch.equal(keys[requests], plain_keys[requests])  # no request's slot holds the padding's key
    assert torch.equal(keys[scratch.start:scratch.stop].unique(), torch.tensor([0.0, 5.0]))


def test_device_tokens_fill_only_the_real_rows() -> None:
    ctx, _, _ = _mixed_step(True)
    for rid in (0, 1):
        ctx.request_kv_length[rid] = ctx.request_kv_length[rid] + (1 if rid == 0 else 2)
    assert ctx.grow_request(0, 7) and ctx.grow_request(1, 6)
    ctx.initialize_attention_state([StepEntry(0, [0], 6), StepEntry(1, [0], 5)], torch.tensor([11, 12, 13]), [2, 0])
    assert ctx.input_ids.tolist() == [[13, 11]] and ctx.padded_active_token_count == 2
    ctx.request_kv_length[0], ctx.request_kv_length[1] = 7, 6
    assert ctx.grow_request(0, 8)
    ctx.initialize_attention_state([StepEntry(0, [0], 7)], torch.tensor([21, 22]), [1])
    assert ctx.input_ids.tolist() == [[22, 0]] and ctx.padding_slice == slice(1, 2)


def _serve(model: Any, overlap: bool) -> dict[str, Any]:
    """:data:`PROMPTS` through the engine with the CUDA-graph decode layout (without graphs, on CPU): tokens,
    log-probs (without ``overlap``: overlapped decode steps return no log-probs), and the ``(real, padded, graph
    batch)`` token counts of the steps."""
    mamba = MambaInferenceStateConfig.from_model(model) if isinstance(model, HybridModel) else None
    config = InferenceConfig(block_size_tokens=4, buffer_size_gb=0.01, max_sequence_length=MAX_SEQ, max_requests=3,
                             max_tokens=8, enable_chunked_prefill=True, mamba_inference_state_config=mamba,
                             num_cuda_graphs=3, async_sched_mode="async" if overlap else "legacy")
    context = DynamicInferenceContext(model.config, config)
    context.pad_decode_steps_on_cpu = True
    engine = DynamicInferenceEngine(TextGenerationController(GPTInferenceWrapper(model, context), None), context)
    futures = [engine.add_request(i, prompt, SamplingParams(top_k=1, num_tokens_to_generate=new_tokens(i),
                                                             termination_id=-1, return_log_probs=not overlap))
               for i, prompt in enumerate(PROMPTS)]
    steps = set()
    while not all(f.done() for f in futures):
        engine.step_modern()
        steps.add((context.active_token_count, context.padded_active_token_count, context.graph_batch_size))
    requests = [f.result(timeout=60) for f in futures]
    return dict(tokens=[list(r.generated_tokens) for r in requests], steps=sorted(steps, key=str),
                log_probs=[list(r.generated_log_probs or []) for r in requests], graph_sizes=context.graph_sizes,
                overlapped=engine.overlapped_step_count)


def _sequence_parallel_runs(names: list[str], weights: dict[str, dict[str, torch.Tensor]],
                            overlap: bool) -> dict[str, Any]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        out = {}
        for name in names:
            feature = FEATURES[name]
            config = _init(feature, tensor_model_parallel_size=2, sequence_parallel=True,
                           pipeline_dtype=torch.float32)
            model = build(feature, config)
            _load(model, weights[name])
            out[name] = _serve(model, overlap)
        return out
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("overlap", [False, True], ids=["legacy", "async"])
def test_padded_graph_decode_layout_under_sequence_parallelism_equals_plain_loop(overlap: bool) -> None:
    references = run_on_ranks(1, reference_runs, NAMES)[0]
    weights = {name: references[name]["weights"] for name in NAMES}
    for rank, runs in enumerate(run_on_ranks(2, _sequence_parallel_runs, NAMES, weights, overlap)):
        for name in NAMES:
            run, reference = runs[name], references[name]
            assert run["tokens"] == reference["tokens"], (name, rank)
            if not overlap:
                for got, want in zip(run["log_probs"], reference["log_probs"], strict=True):
                    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
            assert run["graph_sizes"] == [2, 4]
            assert all(padded % 2 == 0 for _, padded, _ in run["steps"]), run["steps"]
            assert any(graph is None and padded > real for real, padded, graph in run["steps"]), run["steps"]
            assert any(graph is not None and padded > real for real, padded, graph in run["steps"]), run["steps"]
            assert not overlap or run["overlapped"] > 0


def _refusal(config: dict[str, Any], drafts: int = 0) -> str:
    model_config = SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True, **config)
    with pytest.raises(ValueError) as error:
        check_model_supported(torch.nn.Linear(2, 2), model_config, SimpleNamespace(num_speculative_tokens=drafts))
    return str(error.value)


def test_what_a_sequence_parallel_step_cannot_serve_is_refused_by_name() -> None:
    assert "num_speculative_tokens (1) with sequence_parallel=True" in _refusal({}, drafts=1)
    assert "moe_enable_routing_replay with sequence_parallel=True" in _refusal(
        dict(num_moe_experts=4, moe_enable_routing_replay=True))
    assert "moe_expert_capacity_factor (1.5) with sequence_parallel=True" in _refusal(
        dict(num_moe_experts=4, moe_expert_capacity_factor=1.5))
    served = SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True, num_moe_experts=4)
    check_model_supported(torch.nn.Linear(2, 2), served, SimpleNamespace(num_speculative_tokens=0))
