"""Prefill/decode disaggregation end to end on 3 gloo ranks: a prefill shard and a decode shard at different TP
sizes (``tp=2 -> tp=1`` and ``tp=1 -> tp=2``), each holding the same model's weights at its own layout.

Both shards prefill the same prompts in their own dynamic contexts. The prefill shard then sends its KV cache
(and, for the hybrid model, its Mamba states) to fresh contexts on the decode shard through the planned
point-to-point transfers. Each decode rank's received cache must equal the one it computed itself, token by
token (fp32, 1e-6), although the two contexts put the requests in different blocks and slots, and a decode
step from the received cache must give the logits of a decode step from its own. Also: a rank that is its
own peer copies locally (CPU fp32 here, CUDA bf16 with the paged decode path in the GPU test), and a rank the
plan gives a role must bring its cache.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist_harness import run_on_ranks

WORLD = 3
PROMPT_LENGTHS = (5, 7)
LAYOUTS = ["tp=2,role=prefill+tp=1,role=decode", "tp=1,role=prefill+tp=2,role=decode"]


def _gpt_model(tp: int, pg_collection, full: dict) -> torch.nn.Module:
    from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
    from megatron_core.transformer import TransformerConfig
    from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like, shard

    spec = llama_like()
    config = TransformerConfig(**spec["config"], tensor_model_parallel_size=tp)
    model = GPTModel(config, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, pg_collection=pg_collection,
                     **spec["model"]).eval()
    rank = pg_collection.tp.rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full[name], tp, rank, gated=True))
    return model


def _hybrid_model(tp: int, pg_collection, full: dict) -> torch.nn.Module:
    from megatron_core.models.hybrid import HybridModel
    from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
    from tests.inference.hybrid_fixture import MAX_SEQ, VOCAB, hybrid_config
    from tests.models.mamba.test_mamba_tensor_parallel import shard

    model = HybridModel(hybrid_config("M*M-", tensor_model_parallel_size=tp), hybrid_stack_spec, VOCAB, MAX_SEQ,
                        hybrid_layer_pattern="M*M-", position_embedding_type="rope",
                        pg_collection=pg_collection).eval()
    for layer in model.decoder.layers:
        if hasattr(layer, "mixer"):
            layer.mixer.chunk_size = 4
    rank = pg_collection.tp.rank()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(shard(name, full[name], tp, rank))
    return model


def _context(model, pg_collection):
    from megatron_core.inference.config import InferenceConfig, MambaInferenceStateConfig
    from megatron_core.inference.contexts import DynamicInferenceContext

    return DynamicInferenceContext(model.config, InferenceConfig(
        block_size_tokens=4, buffer_size_gb=0.002, max_sequence_length=16, max_requests=4,
        materialize_only_last_token_logits=False, pg_collection=pg_collection,
        mamba_inference_state_config=MambaInferenceStateConfig.from_model(model)))


@torch.no_grad()
def _step(model, context, entries) -> dict:
    """One forward over ``context``; each request's logits rows."""
    for e in entries:
        assert context.grow_request(e.request_id, e.start + len(e.tokens))
    context.initialize_attention_state(entries)
    input_ids, position_ids = context.current_input_and_position_ids()
    logits = model(input_ids, position_ids, None, inference_context=context)[0]
    context.commit_step()
    return {e.request_id: logits[e.logit_rows] for e in context.step_entries}


def _disaggregate(spec: str, kind: str, full: dict, prompts: list[list[int]]) -> dict | None:
    """Prefill on both shards, reshard prefill -> decode, and compare on the decode ranks."""
    from megatron_core.inference.contexts.dynamic_context import StepEntry
    from megatron_core.inference.disaggregation.cache_views import (
        admit_transferred_request,
        attention_layer_numbers,
        context_kv_cache,
        context_mamba_states,
        kv_shard_layout,
        mamba_layer_numbers,
        mamba_shard_layout,
    )
    from megatron_core.inference.disaggregation.execute import (
        exchange_layouts,
        execute_kv_reshard,
        execute_mamba_reshard,
    )
    from megatron_core.inference.disaggregation.kv_reshard import plan_kv_reshard
    from megatron_core.inference.disaggregation.mamba_reshard import plan_mamba_reshard
    from megatron_core.inference.shards import build_inference_pg_collections_for_shards

    shard = next(s for s in build_inference_pg_collections_for_shards(WORLD, spec) if s.pg_collection is not None)
    pgs, decoding = shard.pg_collection, shard.spec.role == "decode"
    model = (_gpt_model if kind == "gpt" else _hybrid_model)(shard.spec.tp, pgs, full)
    own = _context(model, pgs)
    ids = list(range(len(prompts)))
    for rid in ids:
        own.add_request(rid)
    _step(model, own, [StepEntry(rid, p, 0) for rid, p in zip(ids, prompts)])

    attention, mamba = attention_layer_numbers(model), mamba_layer_numbers(model)
    kv_layout = kv_shard_layout(model, pgs)
    srcs, dsts = exchange_layouts(None if decoding else kv_layout, kv_layout if decoding else None)
    kv_plan = plan_kv_reshard(srcs, dsts)
    mamba_plan = []
    if mamba:
        m_layout = mamba_shard_layout(model, pgs)
        m_srcs, m_dsts = exchange_layouts(None if decoding else m_layout, m_layout if decoding else None)
        mamba_plan = plan_mamba_reshard(m_srcs, m_dsts)
    if not decoding:
        execute_kv_reshard(kv_plan, src=(kv_layout, context_kv_cache(own, attention, ids)))
        if mamba:
            execute_mamba_reshard(mamba_plan, src=context_mamba_states(own, mamba, ids))
        return None

    received = _context(model, pgs)
    received.add_request("other")  # so the transferred requests get other blocks and slots than in `own`
    assert received.grow_request("other", 6)
    for rid in reversed(ids):
        admit_transferred_request(received, rid, len(prompts[rid]))
    target = context_kv_cache(received, attention, ids)
    execute_kv_reshard(kv_plan, dst=(kv_layout, target))
    if mamba:
        execute_mamba_reshard(mamba_plan, dst=context_mamba_states(received, mamba, ids))

    mine, got = context_kv_cache(own, attention, ids), target
    assert not torch.equal(mine.slots, got.slots)
    kv_diff = max(float((a[mine.slots] - b[got.slots]).abs().max())
                  for a, b in zip([*mine.keys, *mine.values], [*got.keys, *got.values]))
    mamba_diff, mamba_norm = 0.0, 0.0
    if mamba:
        m_mine, m_got = context_mamba_states(own, mamba, ids), context_mamba_states(received, mamba, ids)
        assert not torch.equal(m_mine.slots, m_got.slots)
        mamba_diff = max(float((a[m_mine.slots] - b[m_got.slots]).abs().max())
                         for a, b in zip([*m_mine.conv, *m_mine.ssm], [*m_got.conv, *m_got.ssm]))
        mamba_norm = float(sum(s[m_mine.slots].abs().sum() for s in [*m_mine.conv, *m_mine.ssm]))
    entries = [StepEntry(rid, [3 + rid], len(p)) for rid, p in zip(ids, prompts)]
    own_logits = _step(model, own, entries)
    received_logits = _step(model, received, [StepEntry(e.request_id, e.tokens, e.start) for e in entries])
    logits_diff = max(float((own_logits[r] - received_logits[r]).abs().max()) for r in ids)
    return {"layouts": (len(srcs), len(dsts), len(kv_plan), len(mamba_plan)), "kv": kv_diff, "mamba": mamba_diff,
            "logits": logits_diff, "kv_norm": float(sum(k[mine.slots].abs().sum() for k in mine.keys)),
            "mamba_norm": mamba_norm}


def _full_gpt() -> dict:
    from tests.models.gpt_test_utils import build, llama_like

    torch.manual_seed(0)
    return {n: p.detach().clone() for n, p in build(llama_like()).named_parameters()}


def _full_hybrid() -> dict:
    from tests.inference.hybrid_fixture import build_hybrid

    return {n: p.detach().clone() for n, p in build_hybrid("M*M-", seed=5, chunk_size=4).named_parameters()}


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 64, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


# The KV transfers are point-to-point on the world group (different counts per rank), then the Mamba layouts are
# all-gathered on it: TORCH_DISTRIBUTED_DEBUG=DETAIL's per-group sequence numbers would call that a desync.
@pytest.mark.distributed_debug_off
@pytest.mark.parametrize("kind", ["gpt", "hybrid"])
@pytest.mark.parametrize("spec", LAYOUTS, ids=["tp2_to_tp1", "tp1_to_tp2"])
def test_resharded_cache_equals_the_decode_shards_own_prefill(spec, kind):
    full = _full_gpt() if kind == "gpt" else _full_hybrid()
    results = run_on_ranks(WORLD, _disaggregate, spec, kind, full, _prompts())
    decode_ranks = [2] if spec.startswith("tp=2") else [1, 2]
    assert [r is not None for r in results] == [rank in decode_ranks for rank in range(WORLD)]
    for rank in decode_ranks:
        result = results[rank]
        n_src, n_dst = (2, 1) if spec.startswith("tp=2") else (1, 2)
        kv_transfers, mamba_transfers = result["layouts"][2:]
        assert result["layouts"][:2] == (n_src, n_dst)
        assert kv_transfers == 2  # two sources into one destination, or one source into each of two
        assert mamba_transfers == (0 if kind == "gpt" else 2 * 4 * 2)  # pairs x bands x Mamba layers
        assert result["kv_norm"] > 0 and (kind == "gpt" or result["mamba_norm"] > 0)  # not trivially equal
        assert result["kv"] <= 1e-6 and result["mamba"] <= 1e-6, result
        assert result["logits"] <= 1e-6, result


def _missing_cache() -> str:
    import torch.distributed as dist

    from megatron_core.inference.disaggregation.execute import execute_kv_reshard
    from megatron_core.inference.disaggregation.kv_reshard import KVShardLayout, plan_kv_reshard

    layouts = [KVShardLayout(num_layers=2, num_heads=2, tp_size=1, tp_rank=0, pp_size=1, pp_rank=0, global_rank=r)
               for r in range(2)]
    plan = plan_kv_reshard(layouts[:1], layouts[1:])
    try:
        execute_kv_reshard(plan)  # rank 0 sends and rank 1 receives in the plan, but neither brought a cache
    except ValueError as error:
        return str(error)
    return f"rank {dist.get_rank()}: no error"


def test_a_rank_with_a_role_in_the_plan_must_bring_its_cache():
    assert run_on_ranks(2, _missing_cache) == [
        "execute_kv_reshard: the plan has rank 0 send 1 transfers but src is None",
        "execute_kv_reshard: the plan has rank 1 receive 1 transfers but dst is None"]


def _same_rank_reshard(full: dict, prompts: list[list[int]], device: str, dtype: torch.dtype) -> dict:
    """On one rank: reshard a prefilled context into a fresh one (the plan's one transfer is the rank's own, a
    local copy), then decode from both."""
    from megatron_core import parallel_state
    from megatron_core.inference.contexts.dynamic_context import StepEntry
    from megatron_core.inference.disaggregation import cache_views as views
    from megatron_core.inference.disaggregation.execute import execute_kv_reshard
    from megatron_core.inference.disaggregation.kv_reshard import plan_kv_reshard
    from megatron_core.process_groups_config import ProcessGroupCollection

    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    model = _gpt_model(1, pgs, full).to(device=device, dtype=dtype)
    own, received = _context(model, pgs), _context(model, pgs)
    own.device = received.device = torch.device(device)
    ids = list(range(len(prompts)))
    for rid in ids:
        own.add_request(rid)
    _step(model, own, [StepEntry(rid, p, 0) for rid, p in zip(ids, prompts)])
    received.add_request("other")
    assert received.grow_request("other", 6)
    for rid in reversed(ids):
        views.admit_transferred_request(received, rid, len(prompts[rid]))
    layers, layout = views.attention_layer_numbers(model), views.kv_shard_layout(model, pgs)
    mine = views.context_kv_cache(own, layers, ids)
    got = views.context_kv_cache(received, layers, ids, dtype=dtype)
    plan = plan_kv_reshard([layout], [layout])
    execute_kv_reshard(plan, src=(layout, mine), dst=(layout, got))
    equal = all(torch.equal(a[mine.slots], b[got.slots])
                for a, b in zip([*mine.keys, *mine.values], [*got.keys, *got.values]))
    entries = [StepEntry(rid, [3 + rid], len(p)) for rid, p in zip(ids, prompts)]
    own_logits = _step(model, own, entries)
    received_logits = _step(model, received, [StepEntry(e.request_id, e.tokens, e.start) for e in entries])
    return {"plan": len(plan), "equal": equal, "device": got.keys[0].device.type,
            "logits": max(float((own_logits[r] - received_logits[r]).abs().max()) for r in ids)}


@pytest.mark.gpu
def test_gpu_resharded_bf16_cache_decodes_like_its_source():
    """CUDA, bf16: the executor's copy into a receiving context's own blocks, then that context's decode step
    (the paged decode path) reading them, gives the source context's decode logits."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from tests.cuda_process_group import in_fresh_process

    result = in_fresh_process(_same_rank_reshard, _full_gpt(), _prompts(), "cuda", torch.bfloat16)
    assert result["plan"] == 1 and result["equal"] and result["device"] == "cuda", result
    assert result["logits"] <= 1e-6, result


def test_a_rank_that_is_its_own_peer_copies_locally():
    """The same check on one CPU rank in fp32: no message, the local copy path."""
    (result,) = run_on_ranks(1, _same_rank_reshard, _full_gpt(), _prompts(), "cpu", torch.float32)
    assert result == {"plan": 1, "equal": True, "device": "cpu", "logits": 0.0}
