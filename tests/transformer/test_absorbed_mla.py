"""Absorbed multi-latent attention (``AbsorbedMLASelfAttention``) equals standard MLA on the same weights, fp32 CPU.

- Output, input gradient and every parameter gradient equal ``MLASelfAttention``'s (local spec, dense causal
  ``DotProductAttention``) with and without q LoRA, with YaRN and plain RoPE, with ``apply_rope_fusion`` on
  and off, for packed sequences, and under selective recompute (``mla_up_proj``, ``core_attn``).
- Under DeepSeek sparse attention (the ``"dsa"`` spec builds the absorbed layer, as Megatron-Core 0.19 does) it
  equals standard MLA with the same ``DSAttention`` core, indexer loss included.
- Checkpoints: the same state-dict and sharded-state-dict keys as standard MLA, loads both ways, and split
  ``linear_k_up_proj`` / ``linear_v_up_proj`` weights load into the combined matrix.
- Refusals name the field or input. A GPU test runs bf16 against the fp32 CPU result.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.transformer import MLATransformerConfig, TransformerConfig
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    _apply_absorbed_v_up_projection,
)
from megatron_core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from tests.transformer.absorbed_mla_common import (
    HIDDEN,
    SEQ,
    TOL,
    absorbed_attention_spec,
    assert_same_run,
    inputs,
    layer_pair,
    mla_config,
    run_layer,
)
from tests.transformer.experimental_attention_variant.dsa_common import (
    dsa_config,
    dsa_layer,
    reset_dsa_globals,
)

CASES = {
    "yarn_q_lora": dict(),
    "yarn_no_q_lora": dict(q_lora_rank=None, qk_layernorm=False),
    "yarn_q_lora_no_norm": dict(qk_layernorm=False),
    "yarn_rope_fusion": dict(apply_rope_fusion=True),
    "yarn_rope_fusion_no_q_lora": dict(apply_rope_fusion=True, q_lora_rank=None, qk_layernorm=False),
    "plain_rope": dict(rope_type="rope"),
    "wide_values": dict(v_head_dim=16),
}


@pytest.mark.parametrize("overrides", list(CASES.values()), ids=list(CASES))
def test_equals_standard_mla_output_and_every_gradient(overrides: dict):
    standard, absorbed = layer_pair(mla_config(**overrides))
    x, w = inputs()
    want = run_layer(standard, x, w)
    assert_same_run(run_layer(absorbed, x, w), want)


def test_query_key_shapes_and_softmax_scale():
    cfg = mla_config()
    standard, absorbed = layer_pair(cfg)
    x, _ = inputs()
    query, key, q_compressed = absorbed.get_query_key_value_tensors(x)
    heads, c, r = cfg.num_attention_heads, cfg.kv_lora_rank, cfg.qk_pos_emb_head_dim
    assert query.shape == (SEQ, 2, heads, c + r) and key.shape == (SEQ, 2, 1, c + r)
    assert q_compressed.shape == (SEQ, 2, cfg.q_lora_rank)
    assert absorbed.softmax_scale == standard.softmax_scale
    assert absorbed.core_attention.v_channels == c
    # Every head's absorbed logits equal standard MLA's q . k.
    std_query, std_key, *_ = standard.get_query_key_value_tensors(x)
    torch.testing.assert_close(torch.einsum("sbnd,tbd->bnst", query, key[:, :, 0]),
                               torch.einsum("sbnd,tbnd->bnst", std_query, std_key), **TOL)


@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "rope_fusion"])
def test_packed_sequences_equal_standard_mla(fusion: bool):
    standard, absorbed = layer_pair(mla_config(apply_rope_fusion=fusion))
    cu = torch.tensor([0, 4, 9, 14], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=5, max_seqlen_kv=5)
    x, w = inputs(seq=14, batch=1)
    want = run_layer(standard, x, w, packed_seq_params=packed)
    assert_same_run(run_layer(absorbed, x, w, packed_seq_params=packed), want)


@pytest.mark.parametrize("modules", [["mla_up_proj"], ["core_attn"], ["mla_up_proj", "core_attn"]])
def test_selective_recompute_keeps_output_and_gradients(modules: list):
    _, plain = layer_pair(mla_config())
    standard, absorbed = layer_pair(mla_config(recompute_granularity="selective", recompute_modules=modules))
    assert absorbed.recompute_up_proj == ("mla_up_proj" in modules)
    assert absorbed.checkpoint_core_attention == ("core_attn" in modules)
    x, w = inputs()
    want = run_layer(plain.train(), x, w)
    assert_same_run(run_layer(absorbed.train(), x, w), want)
    assert_same_run(run_layer(standard.train(), x, w), want)


# --- DeepSeek sparse attention ------------------------------------------------------------------------------------
def _standard_dsa_layer(cfg: MLATransformerConfig, absorbed: AbsorbedMLASelfAttention) -> MLASelfAttention:
    """Standard MLA around the same DSAttention spec parts, holding ``absorbed``'s weights."""
    from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
        get_dsa_module_spec_for_backend,
    )

    spec = get_dsa_module_spec_for_backend(cfg)
    fields = {f.name: getattr(spec.submodules, f.name) for f in dataclasses.fields(spec.submodules)}
    standard = build_module(ModuleSpec(module=MLASelfAttention, params=spec.params,
                                       submodules=MLASelfAttentionSubmodules(**fields)), config=cfg, layer_number=1)
    standard.load_state_dict(absorbed.state_dict(), strict=True)
    return standard


@pytest.mark.parametrize("overrides", [dict(), dict(dsa_indexer_use_sparse_loss=True), dict(dsa_indexer_topk=64)],
                         ids=["sparse", "sparse_loss", "dense_topk"])
def test_dsa_on_absorbed_mla_equals_dsa_on_standard_mla(overrides: dict):
    cfg = dsa_config(**overrides)
    absorbed = dsa_layer(cfg)
    assert isinstance(absorbed, AbsorbedMLASelfAttention)
    assert absorbed.core_attention.consumes_absorbed_v_up_projection
    standard = _standard_dsa_layer(cfg, absorbed)
    gen = torch.Generator().manual_seed(5)
    x, w = torch.randn(16, 2, 32, generator=gen), torch.randn(16, 2, 32, generator=gen)
    try:
        reset_dsa_globals()
        want = run_layer(standard.train(), x, w)
        reset_dsa_globals()
        got = run_layer(absorbed.train(), x, w)
    finally:
        reset_dsa_globals()
    assert any("indexer" in name for name in want[2])  # the indexer loss reached the indexer
    assert_same_run(got, want)


# --- checkpoints --------------------------------------------------------------------------------------------------
def test_checkpoint_keys_and_round_trip_with_standard_mla():
    cfg = mla_config()
    standard, absorbed = layer_pair(cfg)
    assert sorted(standard.state_dict()) == sorted(absorbed.state_dict())
    std_sharded, abs_sharded = standard.sharded_state_dict(prefix="l."), absorbed.sharded_state_dict(prefix="l.")
    assert sorted(std_sharded) == sorted(abs_sharded)
    for key, sh in std_sharded.items():
        if hasattr(sh, "global_shape"):
            assert (sh.key, sh.global_shape, sh.global_offset) == (abs_sharded[key].key, abs_sharded[key].global_shape,
                                                                   abs_sharded[key].global_offset)
    # absorbed -> standard: train the absorbed layer one step, load its weights into a fresh standard layer.
    x, w = inputs()
    run_layer(absorbed, x, w)
    with torch.no_grad():
        for p in absorbed.parameters():
            p.sub_(0.1 * p.grad)
    fresh_standard, _ = layer_pair(cfg, seed=9)
    fresh_standard.load_state_dict(absorbed.state_dict(), strict=True)
    assert_same_run(run_layer(absorbed, x, w), run_layer(fresh_standard, x, w))


def test_split_key_value_up_projection_checkpoints_load():
    cfg = mla_config()
    standard, absorbed = layer_pair(cfg)
    state = standard.state_dict()
    heads, d, v, c = cfg.num_attention_heads, cfg.qk_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
    kv = state.pop("linear_kv_up_proj.weight").view(heads, d + v, c)
    state["linear_k_up_proj.weight"] = kv[:, :d].reshape(heads * d, c).clone()
    state["linear_v_up_proj.weight"] = kv[:, d:].reshape(heads * v, c).clone()
    state["linear_k_up_proj._extra_state"] = state.pop("linear_kv_up_proj._extra_state")
    _, target = layer_pair(cfg, seed=9)
    target.load_state_dict(state, strict=True)
    torch.testing.assert_close(target.linear_kv_up_proj.weight, standard.linear_kv_up_proj.weight, rtol=0, atol=0)
    k_up, v_up = target._get_kv_up_weights()
    assert k_up.shape == (heads, d, c) and v_up.shape == (heads, v, c)
    x, w = inputs()
    assert_same_run(run_layer(target, x, w), run_layer(standard, x, w))


# --- refusals -----------------------------------------------------------------------------------------------------
def _build(cfg: TransformerConfig, **spec_overrides) -> AbsorbedMLASelfAttention:
    return build_module(absorbed_attention_spec(cfg.qk_layernorm, **spec_overrides), config=cfg, layer_number=1)


def test_config_refusals_name_the_fields():
    with pytest.raises(ValueError, match="add_bias_linear=False"):
        _build(mla_config(add_bias_linear=True))
    with pytest.raises(ValueError, match=r"'mla_up_proj' with fp8 \('hybrid'\)"):
        _build(mla_config(fp8="hybrid", recompute_granularity="selective", recompute_modules=["mla_up_proj"]))
    plain = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, qk_layernorm=True)
    with pytest.raises(ValueError, match="needs an MLATransformerConfig, got TransformerConfig"):
        _build(plain)
    cfg = dataclasses.replace(mla_config(), qk_layernorm=False)
    spec = absorbed_attention_spec(qk_layernorm=True)
    with pytest.raises(ValueError, match="qk_layernorm is False"):
        build_module(spec, config=cfg, layer_number=1)


def test_input_refusals():
    _, absorbed = layer_pair(mla_config())
    x, _ = inputs()
    with pytest.raises(NotImplementedError, match="inference_context"):
        absorbed(x, None, inference_context=object())
    with pytest.raises(ValueError, match="rotary_pos_emb"):
        absorbed(x, None, rotary_pos_emb=torch.zeros(SEQ, 1, 1, 4))
    with pytest.raises(ValueError, match="attention_bias"):
        absorbed(x, None, attention_bias=torch.zeros(1))
    with pytest.raises(ValueError, match="key_value_states"):
        absorbed(x, None, key_value_states=x)
    cu = torch.tensor([0, SEQ], dtype=torch.int32)
    dynamic = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, local_cp_size=2)
    with pytest.raises(ValueError, match=r"local_cp_size \(2\) must be None"):
        absorbed(x[:, :1], None, packed_seq_params=dynamic)
    with pytest.raises(NotImplementedError, match="clip_qk"):
        absorbed.clip_qk()


def test_v_up_projection_checks_the_core_attention_width():
    v_up = torch.randn(2, 3, 5)
    latent = torch.randn(4, 1, 2 * 5)
    out = _apply_absorbed_v_up_projection(latent, v_up, 2, 5, 3, core_consumed_v_up_projection=False)
    torch.testing.assert_close(out.view(4, 1, 2, 3), torch.einsum("sbnc,ndc->sbnd", latent.view(4, 1, 2, 5), v_up))
    assert _apply_absorbed_v_up_projection(out, v_up, 2, 5, 3, True) is out
    with pytest.raises(RuntimeError, match="expected the latent"):
        _apply_absorbed_v_up_projection(out, v_up, 2, 5, 3, False)
    with pytest.raises(RuntimeError, match="expected the projected"):
        _apply_absorbed_v_up_projection(latent, v_up, 2, 5, 3, True)


def test_layer_defaults_follow_megatron_core():
    _, absorbed = layer_pair(mla_config())
    assert absorbed.attn_mask_type == AttnMaskType.causal
    assert absorbed.key_hidden_size is None and absorbed.val_hidden_size is None
    assert absorbed.query_projection_size == 6 * 4 and absorbed.q_head_dim == 8 + 4
    assert not isinstance(absorbed, MLASelfAttention)


# --- GPU ----------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("fusion", [False, True], ids=["unfused", "rope_fusion"])
def test_bf16_on_gpu_matches_fp32_cpu(fusion: bool):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    standard, absorbed = layer_pair(mla_config(apply_rope_fusion=fusion))
    x, w = inputs(seq=64, batch=2)
    want = run_layer(standard, x, w)
    gpu = absorbed.to(device="cuda", dtype=torch.bfloat16)
    got = run_layer(gpu, x.to("cuda", torch.bfloat16), w.to("cuda", torch.bfloat16))
    got = tuple(t.float().cpu() for t in got[:2]) + ({k: g.float().cpu() for k, g in got[2].items()},)
    scale = max(want[0].abs().max().item(), 1.0)
    torch.testing.assert_close(got[0], want[0], rtol=3e-2, atol=3e-2 * scale)
    torch.testing.assert_close(got[1], want[1], rtol=5e-2, atol=5e-2 * max(want[1].abs().max().item(), 1.0))
    for name, grad in want[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=5e-2, atol=5e-2 * max(grad.abs().max().item(), 1e-3),
                                   msg=lambda m, n=name: f"{n}: {m}")
