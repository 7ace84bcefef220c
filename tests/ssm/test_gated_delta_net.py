"""The gated delta net layer on one process: against Hugging Face's Qwen3-Next layer on identical weights,
packed sequences, the checkpoint layout, and the config checks (``ValueError`` naming the fields)."""

from __future__ import annotations

import pytest
import torch

from megatron_core import tensor_parallel
from megatron_core.packed_seq_params import PackedSeqParams
from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from tests.ssm.gdn_hf import SIZES, gdn_state_from_hf, hf_config, megatron_config

TOL = dict(rtol=1e-5, atol=1e-5)
SUBMODULES = GatedDeltaNetSubmodules(in_proj=tensor_parallel.ColumnParallelLinear, out_norm=WrappedTorchNorm,
                                     out_proj=tensor_parallel.RowParallelLinear)


def build(seed: int = 0, **overrides) -> GatedDeltaNet:
    torch.manual_seed(seed)
    return GatedDeltaNet(megatron_config(**overrides), SUBMODULES, layer_number=1)


def _hidden(s: int = 11, b: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(s, b, 32, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("value_heads", [2, 4], ids=["mha", "grouped"])
def test_layer_matches_hugging_face_qwen3_next(value_heads: int) -> None:
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    torch.manual_seed(0)
    hf = modeling.Qwen3NextGatedDeltaNet(hf_config(linear_num_value_heads=value_heads), layer_idx=0).eval()
    with torch.no_grad():
        hf.norm.weight.uniform_(0.5, 1.5)
        hf.dt_bias.uniform_(-0.5, 0.5)
    ours = build(linear_num_value_heads=value_heads)
    state = gdn_state_from_hf({f"linear_attn.{k}": v for k, v in hf.state_dict().items()}, "",
                              SIZES["linear_num_key_heads"], SIZES["linear_key_head_dim"], SIZES["linear_value_head_dim"])
    assert set(state) == {n for n, _ in ours.named_parameters()}
    ours.load_state_dict(state, strict=False)
    x = _hidden()
    want = hf(x.transpose(0, 1).contiguous())
    out, bias = ours(x, attention_mask=None)
    assert bias is None
    torch.testing.assert_close(out.transpose(0, 1), want, **TOL)
    # The deterministic (always PyTorch) rule gives the same values.
    det = build(linear_num_value_heads=value_heads, deterministic_mode=True)
    det.load_state_dict(state, strict=False)
    torch.testing.assert_close(det(x, None)[0], out, rtol=0, atol=0)
    # Gradients flow to every parameter.
    out.square().sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in ours.parameters())


def test_packed_documents_equal_separate_runs() -> None:
    layer = build(seed=2)
    x = _hidden(s=12, b=1, seed=3)
    cu = torch.tensor([0, 5, 12], dtype=torch.int32)
    packed = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    got, _ = layer(x, None, packed_seq_params=packed)
    want = torch.cat([layer(x[:5], None)[0], layer(x[5:], None)[0]], dim=0)
    torch.testing.assert_close(got, want, **TOL)
    with pytest.raises(ValueError, match="micro-batch size 1"):
        layer(_hidden(s=12, b=2), None, packed_seq_params=packed)


def test_parameters_and_checkpoint_keys() -> None:
    layer = build()
    assert [n for n, _ in layer.named_parameters()] == [
        "dt_bias", "A_log", "in_proj.weight", "conv1d.weight", "out_norm.weight", "out_proj.weight"]
    assert layer.in_proj.weight.shape == (2 * 16 + 2 * 32 + 2 * 4, 32) and layer.conv1d.weight.shape == (64, 1, 4)
    assert layer.A_log.exp().min() >= 1 and layer.A_log.exp().max() <= 16 and torch.equal(layer.dt_bias,
                                                                                         torch.ones(4))
    sharded = layer.sharded_state_dict(prefix="decoder.layers.0.self_attention.")
    built = {sub.key for key in ("in_proj.weight", "conv1d.weight")
             for sub in sharded[f"decoder.layers.0.self_attention.{key}"].build()}
    p = "decoder.layers.0.self_attention."
    assert built == {f"{p}in_proj.weight.{n}" for n in ("query", "key", "value", "z", "beta", "alpha")} | {
        f"{p}conv1d.weight.{n}" for n in ("query", "key", "value")}
    assert {f"{p}A_log", f"{p}dt_bias", f"{p}out_norm.weight", f"{p}out_proj.weight"} <= set(sharded)
    with_bias = GatedDeltaNet(megatron_config(), SUBMODULES, conv_bias=True).sharded_state_dict()
    assert {sub.key for sub in with_bias["conv1d.bias"].build()} == {"conv1d.bias.query", "conv1d.bias.key",
                                                                      "conv1d.bias.value"}


def test_inference_is_refused() -> None:
    with pytest.raises(NotImplementedError, match="inference"):
        build()(_hidden(), None, inference_context=object())


@pytest.mark.parametrize("overrides,match", [
    (dict(linear_num_key_heads=3), r"linear_num_value_heads \(4\) must be a multiple of linear_num_key_heads \(3\)"),
    (dict(linear_key_head_dim=0), r"linear_key_head_dim \(0\) must be a positive integer"),
    (dict(experimental_attention_variant="gated_delta_net"), "needs linear_attention_freq"),
    (dict(experimental_attention_variant="dsa"), r"dsa_indexer_n_heads \(None\) must be a positive integer"),
    (dict(experimental_attention_variant="mamba"), r"experimental_attention_variant \('mamba'\) must be"),
    (dict(linear_attention_freq=0), r"linear_attention_freq \(0\) must be positive"),
    (dict(linear_attention_freq=[1, 0, 1]), r"one 0 \(softmax attention\) or 1"),
    (dict(experimental_attention_variant="gated_delta_net", linear_attention_freq=2, tensor_model_parallel_size=4,
          context_parallel_size=2), r"linear_num_key_heads \(2\) must be divisible by tensor_model_parallel_size "
                                    r"\* context_parallel_size \(4 \* 2 = 8\)"),
])
def test_bad_configs_raise_naming_fields(overrides: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GatedDeltaNet(megatron_config(**overrides), SUBMODULES)


def test_a_init_range_is_checked() -> None:
    with pytest.raises(ValueError, match=r"A_init_range \(\(4, 2\)\)"):
        GatedDeltaNet(megatron_config(), SUBMODULES, A_init_range=(4, 2))
