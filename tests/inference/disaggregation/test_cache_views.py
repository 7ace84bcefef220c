"""``disaggregation.cache_views``: the layouts of a model's pipeline stages count layers among the model's
attention (Mamba) layers only, so a hybrid pattern's uneven stages map to the right global layers; the context
views list each request's token slots, and a receiving context admits only what fits."""

from __future__ import annotations

import torch

from tests.dist_harness import run_on_ranks


def _stage_layouts(pattern: str) -> tuple:
    import torch.distributed as dist

    from megatron_core.inference.disaggregation.cache_views import (
        attention_layer_numbers,
        kv_shard_layout,
        mamba_layer_numbers,
        mamba_shard_layout,
    )
    from megatron_core.inference.shards import build_inference_pg_collection
    from megatron_core.models.hybrid import HybridModel
    from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from tests.inference.hybrid_fixture import MAX_SEQ, VOCAB, hybrid_config

    pgs = build_inference_pg_collection(2, tp_size=1, pp_size=2, cp_size=1, ep_size=1, expt_tp_size=1)
    stage = dist.get_rank(pgs.pp)
    config = hybrid_config(pattern.replace("|", ""), pipeline_model_parallel_size=2, pipeline_dtype=torch.float32)
    model = HybridModel(config, hybrid_stack_spec, VOCAB, MAX_SEQ, hybrid_layer_pattern=pattern,
                        position_embedding_type="rope", pre_process=stage == 0, post_process=stage == 1,
                        pg_collection=pgs)
    kv, mamba = kv_shard_layout(model, pgs), mamba_shard_layout(model, pgs)
    return (attention_layer_numbers(model), mamba_layer_numbers(model), kv.layer_range(), kv.num_layers,
            kv.num_heads, kv.pp_rank, mamba.layer_range(), (mamba.dims.nheads, mamba.dims.ngroups))


def test_hybrid_stages_get_explicit_windows_among_their_kinds_layers():
    """``M*M|*-M``: stage 0 holds layers 1-3 (attention 2, Mamba 1 and 3), stage 1 layers 4-6 (attention 4,
    Mamba 6); among the model's 2 attention and 3 Mamba layers these are [0, 1) / [1, 2) and [0, 2) / [2, 3)."""
    stage0, stage1 = run_on_ranks(2, _stage_layouts, "M*M|*-M")
    assert stage0 == ([2], [1, 3], (0, 1), 2, 2, 0, (0, 2), (4, 2))
    assert stage1 == ([4], [6], (1, 2), 2, 2, 1, (2, 3), (4, 2))


def test_context_views_list_each_requests_token_slots_and_admission_refuses_a_full_cache():
    """Slots follow the block tables (token ``p`` in ``table[p // 4] * 4 + p % 4``); buffers not yet used are
    made in the requested dtype; a request that does not fit is refused and left out of the context."""
    from megatron_core.inference.config import InferenceConfig
    from megatron_core.inference.contexts import DynamicInferenceContext
    from megatron_core.inference.disaggregation.cache_views import (
        admit_transferred_request,
        attention_layer_numbers,
        context_kv_cache,
    )
    from tests.models.gpt_test_utils import build, llama_like

    model = build(llama_like())
    context = DynamicInferenceContext(model.config, InferenceConfig(
        block_size_tokens=4, buffer_size_gb=4 * 1024 / 1024**3, max_sequence_length=16, max_requests=4))
    assert context.total_block_count == 4
    admit_transferred_request(context, "a", 6)
    admit_transferred_request(context, "b", 3)
    assert context.kv_length("a") == 6 and context.kv_length("b") == 3
    view = context_kv_cache(context, attention_layer_numbers(model), ["b", "a"], dtype=torch.float64)
    a, b = context.request_blocks["a"], context.request_blocks["b"]
    expected = [b[0] * 4 + p for p in range(3)] + [a[p // 4] * 4 + p % 4 for p in range(6)]
    assert view.slots.tolist() == expected
    assert len(view.keys) == 2 and view.keys[0].dtype == torch.float64 and view.keys[0].shape[1:] == (4, 4)
    try:
        admit_transferred_request(context, "c", 8)
    except RuntimeError as error:
        assert str(error) == ("admit_transferred_request: request c needs 2 KV blocks for 8 tokens, but only 1 "
                              "are free")
    else:
        raise AssertionError("admitting past the free blocks must fail")
    assert not context.has_request("c") and context.block_allocator.get_active_avail() == 1
