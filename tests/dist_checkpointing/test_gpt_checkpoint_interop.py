"""A GPTModel checkpoint loads into a hybrid MambaModel through ``gpt_checkpoint_interop``.

A hybrid ``*-*-`` model computes exactly what a 2-layer GPT does, so after loading the GPT
checkpoint (saved at one TP size, loaded at another) its logits must equal the GPT's. In
``M*-M*-`` the Mamba layers must keep their values and the attention / MLP layers must equal the
``*-*-`` model's. The FSDP variant does the same with ``torch.distributed.checkpoint`` and
``DTensor`` state dicts of ``TorchFullyShardedDataParallel`` models.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from megatron_core.dist_checkpointing.gpt_checkpoint_interop import (
    gpt_compatible_layer_maps,
    retarget_fsdp_state_dict_to_gpt_checkpoint,
    retarget_sharded_state_dict_to_gpt_checkpoint,
)
from megatron_core.dist_checkpointing.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from megatron_core.models.gpt import GPTModel, get_gpt_layer_local_spec
from megatron_core.models.mamba import MambaModel
from megatron_core.models.mamba.mamba_layer_specs import mamba_stack_spec
from megatron_core.transformer import TransformerConfig
from tests.dist_harness import run_on_ranks

VOCAB, MAX_SEQ, SEQ, BATCH = 64, 16, 8, 2
_CFG = dict(hidden_size=32, num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64, normalization="RMSNorm",
            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False, hidden_dropout=0.0,
            attention_dropout=0.0, use_cpu_initialization=True, mamba_state_dim=8, mamba_head_dim=8,
            mamba_num_groups=2, layernorm_epsilon=1e-5)


def _gpt(tp: int, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=2, tensor_model_parallel_size=tp, **_CFG)
    return GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, MAX_SEQ, position_embedding_type="rope")


def _hybrid(pattern: str, tp: int, seed: int) -> MambaModel:
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    cfg = TransformerConfig(num_layers=len(pattern), tensor_model_parallel_size=tp, **_CFG)
    return MambaModel(cfg, mamba_stack_spec, VOCAB, MAX_SEQ, hybrid_layer_pattern=pattern,
                      position_embedding_type="rope")


def _logits(model: torch.nn.Module) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    pos = torch.arange(SEQ).unsqueeze(0).expand(BATCH, SEQ)
    with torch.no_grad():
        return model(ids, pos, None, runtime_gather_output=True).detach().clone()


def _save_gpt(ckpt: str, tp: int) -> torch.Tensor:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        model = _gpt(tp, seed=11)
        dist_checkpointing.save(model.sharded_state_dict(), ckpt)
        return _logits(model)
    finally:
        parallel_state.destroy_model_parallel()


def _load_into_hybrid(model: MambaModel, ckpt: str) -> None:
    sharded = model.sharded_state_dict()
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded, gpt_compatible_layer_maps(model.hybrid_layer_pattern))
    model.load_state_dict(dist_checkpointing.load(sharded, ckpt, strict="raise_all"))


def _load_hybrids(ckpt: str, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        plain = _hybrid("*-*-", tp, seed=99)
        before_plain = _logits(plain)
        _load_into_hybrid(plain, ckpt)
        mixed = _hybrid("M*-M*-", tp, seed=98)
        fresh = {k: v.detach().clone() for k, v in mixed.named_parameters()}
        _load_into_hybrid(mixed, ckpt)
        plain_params = dict(plain.named_parameters())
        to_plain = {1: 0, 2: 1, 4: 2, 5: 3}  # M*-M*- layer -> *-*- layer
        for name, param in mixed.named_parameters():
            parts = name.split(".")
            if parts[:2] == ["decoder", "layers"] and int(parts[2]) not in to_plain:
                assert torch.equal(param, fresh[name]), f"{name}: a Mamba layer changed"
                continue
            if parts[:2] == ["decoder", "layers"]:
                parts[2] = str(to_plain[int(parts[2])])
            assert torch.equal(param, plain_params[".".join(parts)]), name
        logits = _logits(plain)
        assert not torch.equal(logits, before_plain)
        return logits, _logits(mixed)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize(("save_tp", "load_tp"), [(2, 1), (1, 2)], ids=["tp2_to_tp1", "tp1_to_tp2"])
def test_gpt_checkpoint_loads_into_hybrid_model(tmp_path, save_tp, load_tp):
    ckpt = str(tmp_path / "gpt")
    reference = run_on_ranks(save_tp, _save_gpt, ckpt, save_tp)
    for r in reference[1:]:
        assert torch.equal(r, reference[0])
    loaded = run_on_ranks(load_tp, _load_hybrids, ckpt, load_tp)
    for logits, mixed_logits in loaded:
        torch.testing.assert_close(logits, reference[0], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(mixed_logits).all()


def test_layer_maps_from_pattern():
    maps = gpt_compatible_layer_maps("M*-|M*E".replace("E", "-"))
    assert dict(maps.attention_to_gpt) == {1: 0, 4: 1}
    assert dict(maps.mlp_to_gpt) == {2: 0, 5: 1}
    assert maps.fresh_init == frozenset({0, 3}) and maps.num_gpt_layers == 2
    moe = gpt_compatible_layer_maps("*E*E")
    assert dict(moe.mlp_to_gpt) == {1: 0, 3: 1}
    for bad, words in [("M*-*", "counts"), ("*-*E", "mixes"), ("*-G", "cannot be loaded"), ("*-/*-", "multi-token"),
                       ("MM", "counts")]:
        with pytest.raises(ValueError, match=words):
            gpt_compatible_layer_maps(bad)


def test_optimizer_keys_and_fresh_layers_are_retargeted():
    maps = gpt_compatible_layer_maps("M*-")
    w = torch.randn(4, 3)
    sharded = {
        "exp_avg": ShardedTensor.from_rank_offsets("optimizer.state.exp_avg.decoder.layers.2.mlp.linear_fc2.weight",
                                                   w, (1, 0, 2)),
        "mamba": ShardedTensor.from_rank_offsets("decoder.layers.0.mixer.D", torch.ones(2)),
        "extra": ShardedObject("decoder.layers.1.self_attention.linear_qkv._extra_state", None, (1,), (0,)),
        "out_extra": ShardedObject("output_layer._extra_state", b"", (1,), (0,)),
        "norm": [ShardedTensor.from_rank_offsets("decoder.final_norm.weight", torch.ones(3))],
    }
    retarget_sharded_state_dict_to_gpt_checkpoint(sharded, maps)
    st = sharded["exp_avg"]
    assert st.key == "optimizer.state.exp_avg.decoder.layers.mlp.linear_fc2.weight"
    assert (st.global_shape, st.global_offset, st.prepend_axis_num) == ((1, 4, 6), (0, 0, 0), 1)
    assert st.axis_fragmentations == (1, 1, 2)
    assert isinstance(sharded["mamba"], LocalNonpersistentObject) and torch.equal(sharded["mamba"].obj, torch.ones(2))
    assert sharded["extra"].key == "decoder.layers.self_attention.linear_qkv._extra_state"
    assert (sharded["extra"].global_shape, sharded["extra"].global_offset) == ((1,), (0,))
    assert isinstance(sharded["out_extra"], LocalNonpersistentObject)
    assert sharded["norm"][0].key == "decoder.final_layernorm.weight"
    with pytest.raises(ValueError, match="hybrid layer 7"):
        retarget_sharded_state_dict_to_gpt_checkpoint(
            {"x": ShardedTensor.from_rank_offsets("decoder.layers.7.mlp.w", torch.ones(1))}, maps)


def test_fsdp_state_dict_names():
    maps = gpt_compatible_layer_maps("M*-*-")
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    model = {"decoder.layers.0.mixer.D": a, "decoder.layers.3.self_attention.linear_qkv.weight": b,
             "decoder.layers.4.mlp.linear_fc1.weight": c, "decoder.final_norm.weight": d,
             "output_layer._extra_state": None}
    out = retarget_fsdp_state_dict_to_gpt_checkpoint(model, maps)
    assert out == {"decoder.layers.1.self_attention.linear_qkv.weight": b, "decoder.layers.1.mlp.linear_fc1.weight": c,
                   "decoder.final_layernorm.weight": d}
    optimizer = {"state": {"decoder.layers.4.mlp.linear_fc1.weight": {"exp_avg": c, "step": a},
                           "decoder.layers.0.mixer.D": {"exp_avg": a}},
                 "param_groups": [{"params": ["decoder.layers.1.self_attention.linear_qkv.weight"], "lr": 0.1}]}
    keys = ["optimizer.state.module.decoder.layers.1.mlp.linear_fc1.weight.exp_avg",
            "optimizer.state.module.decoder.layers.1.mlp.linear_fc1.weight.step"]
    out = retarget_fsdp_state_dict_to_gpt_checkpoint(optimizer, maps, keys, checkpoint_prefix="optimizer")
    assert out["state"] == {"module.decoder.layers.1.mlp.linear_fc1.weight": {"exp_avg": c, "step": a}}
    assert out["param_groups"] == [{"params": ["decoder.layers.1.self_attention.linear_qkv.weight"]}]


def _fsdp_round_trip(ckpt: str) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.distributed.checkpoint as dcp

    from megatron_core.distributed import TorchFullyShardedDataParallel, TorchFullyShardedDataParallelConfig

    parallel_state.initialize_model_parallel()
    try:
        gpt = _gpt(1, seed=11)
        reference = _logits(gpt)
        gpt = TorchFullyShardedDataParallel(gpt.config, TorchFullyShardedDataParallelConfig(), gpt)
        dcp.save({"model": gpt.state_dict()}, checkpoint_id=ckpt)
        dist.barrier()
        hybrid = _hybrid("*-*-", 1, seed=99)
        hybrid = TorchFullyShardedDataParallel(hybrid.config, TorchFullyShardedDataParallelConfig(), hybrid)
        keys = dcp.FileSystemReader(ckpt).read_metadata().state_dict_metadata
        model_sd = retarget_fsdp_state_dict_to_gpt_checkpoint(
            hybrid.state_dict(), gpt_compatible_layer_maps("*-*-"),
            tuple(k for k in keys if k.startswith("model.")), checkpoint_prefix="model")
        saved = {k for k in keys if k.startswith("model.")} - {"model.output_layer._extra_state"}
        assert {f"model.{k}" for k in model_sd} == saved, sorted({f"model.{k}" for k in model_sd} ^ saved)
        dcp.load({"model": model_sd}, checkpoint_id=ckpt)
        return _logits(hybrid), reference
    finally:
        parallel_state.destroy_model_parallel()


def test_fsdp_dtensor_gpt_checkpoint_loads_into_hybrid(tmp_path):
    ckpt = str(tmp_path / "fsdp_gpt")
    for logits, reference in run_on_ranks(2, _fsdp_round_trip, ckpt):
        torch.testing.assert_close(logits, reference, rtol=1e-5, atol=1e-5)
