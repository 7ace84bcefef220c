"""Fine-grained activation offloading on CPU: offloading changes no number, and it really moves activations.

Each run trains three iterations of two micro-batches (the first is the manager's warmup, the later ones run
the fixed policy) through ``forward_backward_no_pipelining`` and compares every loss and every gradient with
the same model without offloading, bit for bit (host copies are exact). The manager's summary says how many
bytes each group moved.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.pipeline_parallel.fine_grained_activation_offload import (
    ChunkOffloadHandler,
    FineGrainedActivationOffloadingInterface,
    OffloadTensorPool,
    PipelineOffloadManager,
)
from megatron_core.pipeline_parallel.schedules import forward_backward_no_pipelining
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from tests.models.gpt_test_utils import MAX_SEQ, VOCAB, llama_like
from tests.pipeline_parallel.gpt_stages import MBS, SEQ, gpt_forward_step, make_batches

DENSE = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm")
MOE = ("expert_fc1", "moe_act")
MOE_CONFIG = dict(num_moe_experts=4, moe_router_topk=2, moe_grouped_gemm=True, moe_ffn_hidden_size=32,
                  moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=0.0)
MLA_CONFIG = dict(q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
                  rope_type="rope")


@pytest.fixture(autouse=True)
def _fresh_manager():
    PipelineOffloadManager.reset_instance()
    yield
    PipelineOffloadManager.reset_instance()


def _train(modules=None, moe=False, mla=False, iterations=3, **extra):
    """Losses and gradients of ``iterations`` steps, and the manager that ran them."""
    PipelineOffloadManager.reset_instance()
    cfg = dict(llama_like()["config"], **(MOE_CONFIG if moe else {}))
    if modules:
        cfg.update(fine_grained_activation_offloading=True, offload_modules=list(modules), min_offloaded_tensor_size=8)
    cfg.update(extra)
    if mla:
        cfg.pop("num_query_groups")
        config = MLATransformerConfig(**cfg, **MLA_CONFIG)
    else:
        config = TransformerConfig(**cfg)
    torch.manual_seed(0)
    spec = get_gpt_layer_local_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=moe,
                                    multi_latent_attention=mla)
    model = GPTModel(config, spec, VOCAB, MAX_SEQ, position_embedding_type="rope")
    steps = []
    for it in range(iterations):
        model.zero_grad()
        losses = forward_backward_no_pipelining(
            forward_step_func=gpt_forward_step, data_iterator=iter(make_batches(2, seed=it)), model=model,
            num_microbatches=2, seq_length=SEQ, micro_batch_size=MBS)
        steps.append(([d["lm loss"] for d in losses],
                      {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}))
    return steps, PipelineOffloadManager.get_instance()


def _assert_same(ref, got):
    assert len(ref) == len(got)
    for (ref_losses, ref_grads), (losses, grads) in zip(ref, got):
        torch.testing.assert_close(torch.stack(losses), torch.stack(ref_losses), rtol=0, atol=0)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


_REFS: dict = {}


def _reference(moe=False, mla=False, **extra):
    key = (moe, mla, repr(sorted(extra.items())))
    if key not in _REFS:
        _REFS[key] = _train(None, moe=moe, mla=mla, **extra)[0]
    return _REFS[key]


@pytest.mark.parametrize("modules", [("attn_norm",), ("qkv_linear",), ("core_attn",), ("core_attn", "attn_proj"),
                                     ("mlp_norm",), DENSE])
def test_dense_gpt_offload_matches_no_offload(modules):
    steps, manager = _train(modules)
    _assert_same(_reference(), steps)
    assert set(manager.offload_summary_bytes) == set(modules)
    assert all(b > 0 for b in manager.offload_summary_bytes.values()), manager.offload_summary_bytes


@pytest.mark.parametrize("modules", [("expert_fc1",), ("moe_act",), DENSE + MOE])
def test_moe_gpt_offload_matches_no_offload(modules):
    steps, manager = _train(modules, moe=True)
    _assert_same(_reference(moe=True), steps)
    assert set(manager.offload_summary_bytes) == set(modules)
    assert all(b > 0 for b in manager.offload_summary_bytes.values()), manager.offload_summary_bytes


def test_mla_offload_matches_no_offload():
    steps, manager = _train(("qkv_linear", "core_attn", "attn_proj"), mla=True)
    _assert_same(_reference(mla=True), steps)
    assert set(manager.offload_summary_bytes) == {"qkv_linear", "core_attn", "attn_proj"}


@pytest.mark.parametrize("moe,recompute,modules,offloaded", [
    (True, ["moe_act"], DENSE + MOE, set(DENSE + MOE)),
    (False, ["mlp", "core_attn"], DENSE, set(DENSE) - {"core_attn"}),  # recomputed core attention is not offloaded
])
def test_offload_with_selective_recompute(moe, recompute, modules, offloaded):
    extra = dict(recompute_granularity="selective", recompute_modules=recompute)
    steps, manager = _train(modules, moe=moe, **extra)
    _assert_same(_reference(moe=moe, **extra), steps)
    assert set(manager.offload_summary_bytes) == offloaded


def test_mla_offload_with_up_projection_recompute():
    extra = dict(recompute_granularity="selective", recompute_modules=["mla_up_proj"])
    steps, _ = _train(("qkv_linear", "core_attn", "attn_proj"), mla=True, **extra)
    _assert_same(_reference(mla=True, **extra), steps)


def _groups(manager):
    return [g for chunk in manager._cached_chunks_forward for g in chunk.offload_groups]


def test_groups_record_bytes_and_small_tensors_stay():
    _, manager = _train(DENSE, iterations=1)
    manager.reset()  # what the second iteration would find: the warmup's record is final
    groups = _groups(manager)
    assert len(groups) == 2 * 2 * len(DENSE)  # micro-batches x layers x modules
    assert all(g.total_tensor_count > 0 and g.total_offload_bytes > 0 for g in groups)
    # One micro-batch's first layer is summarised (the second layer's groups stay on the device: margin).
    assert manager.offload_summary_total_bytes == sum(g.total_offload_bytes for g in groups[:len(DENSE)])

    _, manager = _train(DENSE, iterations=1, min_offloaded_tensor_size=10**9)
    assert all(g.total_offload_bytes == 0 for g in _groups(manager))
    assert manager.offload_summary_total_bytes == 0


def test_policy_margin_fraction_and_pipeline_delta():
    _, manager = _train(DENSE, iterations=1, activation_offload_fraction=0.5)
    for chunk in manager._cached_chunks_forward:
        flags = [g.offload for g in chunk.offload_groups]
        assert chunk.offload_groups[0]._name == "attn_norm"
        if chunk is manager._cached_chunks_backward[0]:
            # Last layer kept for the margin; of the first layer's 5 groups the first int(5 * 0.5) = 2 move.
            assert flags == [True, True, True, False, False] + [False] * 5
        else:
            assert flags == [True] * 5 + [False] * 5  # 10 groups: the first half moves

    PipelineOffloadManager.reset_instance()
    manager = PipelineOffloadManager.get_instance()
    for _ in range(2):
        manager.init_model_chunk_offload_handler(pp_rank=1, vp_size=None, vp_stage=None, min_offloaded_tensor_size=0,
                                                 delta_offload_bytes_across_pp_ranks=100)
        for name, size in (("a", 80), ("b", 80), ("a", 80), ("b", 80)):
            chunk = manager.cur_forward_chunk()
            chunk.on_group_start_forward(name, "cpu")
            chunk.tensor_push(torch.zeros(size // 4))
            chunk.on_group_commit_forward(name, [])
    manager.reset()
    first, second = manager._cached_chunks_backward
    # pp rank 1 keeps 1 * 100 bytes on the device, earliest groups first (a1, b1: 160 bytes); the margin keeps
    # the first backward chunk's last group of each name; the next chunk offloads everything.
    assert [g.offload for g in first.offload_groups] == [False, False, False, False]
    assert [g.offload for g in second.offload_groups] == [True, True, True, True]


def test_saved_tensors_come_back_from_their_own_chunk():
    """Two chunks' groups are popped in the opposite order of the recorded backward order."""
    pool = OffloadTensorPool()
    a, b = (ChunkOffloadHandler(0, pool) for _ in range(2))
    tensors, tags = {}, {}
    for chunk, label in ((a, "a"), (b, "b")):
        chunk.on_group_start_forward("core_attn", "cpu")
        tensors[label] = torch.randn(4, 4)
        tags[label] = chunk.tensor_push(tensors[label])
        chunk.on_group_commit_forward("core_attn", [])
    for label in ("a", "b"):
        assert isinstance(tags[label][0].offload_groups[0]._tensors[tags[label]], tuple)  # moved to a host buffer
    manager = PipelineOffloadManager.get_instance()
    assert torch.equal(manager.on_get_saved_tensor(tags["a"]), tensors["a"])
    assert torch.equal(manager.on_get_saved_tensor(tags["b"]), tensors["b"])


def test_forced_release_frees_only_what_the_group_moved():
    chunk = ChunkOffloadHandler(0, OffloadTensorPool())
    saved, other = torch.randn(8), torch.randn(8)
    chunk.on_group_start_forward("attn_proj", "cpu")
    tag = chunk.tensor_push(saved)
    chunk.on_group_commit_forward("attn_proj", [saved, other])
    assert saved.untyped_storage().size() == 0 and other.untyped_storage().size() > 0
    assert chunk.tensor_pop(tag).untyped_storage().size() > 0

    chunk = ChunkOffloadHandler(0, OffloadTensorPool())
    chunk.on_group_start_forward("core_attn", "cpu")
    chunk.tensor_push(saved := torch.randn(8))
    chunk.on_group_start_forward("attn_proj", "cpu")
    chunk.tensor_push(saved)
    chunk.on_group_commit_forward("attn_proj", [saved])  # core_attn (still open) holds it on the device
    assert saved.untyped_storage().size() > 0


def test_no_offload_flag_installs_nothing():
    x = torch.randn(4, requires_grad=True)
    manager = FineGrainedActivationOffloadingInterface(False, x, "core_attn")
    with manager as y:
        z = (y * y).sum()
    assert y is x and manager.group_offload(z) is z
    assert PipelineOffloadManager.get_instance()._cached_chunks_forward == []
    model_cfg = TransformerConfig(**llama_like()["config"])
    layer = GPTModel(model_cfg, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ).decoder.layers[0]
    assert not layer.offload_attn_norm and not layer.self_attention.offload_core_attention


def test_summary_table_single_process(capsys):
    from megatron_core._activation_offload.summary import print_offload_summary_table

    print_offload_summary_table({"core_attn": 3 * 1024 * 1024, "attn_norm": 1024 * 1024})
    out = capsys.readouterr().out
    assert "Activation Offload Summary (MB)" in out
    assert "Rank 0" in out and "3.00" in out and "4.00" in out


def test_pool_reuses_buffers_by_shape_and_stride():
    pool = OffloadTensorPool()
    a = pool.allocate((2, 3), torch.float32)
    t = pool.allocate((2, 3), torch.float32, stride=(1, 2))
    assert t.stride() == (1, 2) and a.is_contiguous()
    pool.free(a)
    assert pool.allocate((2, 3)) is a
    with pytest.raises(ValueError, match="not allocated by this pool"):
        pool.free(torch.empty(2, 3))
    pool.reset()
    assert pool.get_pool_status((2, 3), torch.float32)["free_count"] == 1


def test_gelu_gpt2_style_layer_offloads_exactly():
    extra = dict(normalization="LayerNorm", gated_linear_unit=False, activation_func=F.gelu, add_bias_linear=True)
    steps, _ = _train(DENSE, **extra)
    _assert_same(_reference(**extra), steps)


def _hybrid_grads(offload: bool) -> tuple[torch.Tensor, dict, PipelineOffloadManager]:
    from megatron_core.models.hybrid import HybridModel, hybrid_layer_specs
    from tests.models.mamba.mamba_test_utils import VOCAB as HYBRID_VOCAB
    from tests.models.mamba.mamba_test_utils import batch as hybrid_batch
    from tests.models.mamba.mamba_test_utils import config as hybrid_config

    PipelineOffloadManager.reset_instance()
    extra = dict(fine_grained_activation_offloading=True, offload_modules=list(DENSE),
                 min_offloaded_tensor_size=8) if offload else {}
    torch.manual_seed(7)
    model = HybridModel(hybrid_config("M*M-", **extra), hybrid_layer_specs.hybrid_stack_spec, HYBRID_VOCAB, 32,
                        hybrid_layer_pattern="M*M-")
    ids, pos, labels = hybrid_batch()
    loss = model(ids, pos, None, labels=labels).sum()
    loss.backward()
    manager = PipelineOffloadManager.get_instance()
    manager.reset()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}, manager


def test_hybrid_model_attention_layers_offload():
    ref_loss, ref_grads, _ = _hybrid_grads(offload=False)
    loss, grads, manager = _hybrid_grads(offload=True)
    torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    # The attention layer ("*") and the MLP layer ("-") open the groups; the Mamba layers have none.
    assert {g._name for g in _groups(manager)} == set(DENSE)
