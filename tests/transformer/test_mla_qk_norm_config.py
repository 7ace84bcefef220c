"""``transformer.mla_qk_norm_config.QKNormConfigResolver``: Megatron-Core 0.19's Q/KV norm rules for MLA and DSA.

Checked against the classes this library's MLA builds from the local spec where both accept the spec, and for
each refusal; a backend with a fused norm + linear class (as Transformer Engine's) checks the fused paths.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_core.models.gpt import gpt_layer_specs
from megatron_core.models.gpt.gpt_model import GPTModel
from megatron_core.tensor_parallel import ColumnParallelLinear
from megatron_core.transformer.backends import LocalSpecProvider
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.mla_qk_norm_config import QKNormConfigResolver
from megatron_core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import WrappedTorchNorm
from tests.transformer.test_multi_latent_attention import SHAPE, YARN, _config


class _FusedNormLinear(ColumnParallelLinear):
    """Stands for a backend's fused norm + column-parallel linear."""


class _FusedBackend(LocalSpecProvider):
    def column_parallel_layer_norm_linear(self) -> type:
        return _FusedNormLinear


def _cfg(**overrides):
    base = dict(q_lora_rank=16, qk_layernorm=True, qk_l2_norm=False, experimental_attention_variant=None,
                normalization="RMSNorm", transformer_impl="local")
    return SimpleNamespace(**{**base, **overrides})


def _subs(**overrides) -> MLASelfAttentionSubmodules:
    linear = ColumnParallelLinear
    base = dict(linear_q_proj=linear, linear_q_down_proj=linear, linear_q_up_proj=linear, linear_kv_down_proj=linear,
                linear_kv_up_proj=linear, q_layernorm=WrappedTorchNorm, kv_layernorm=WrappedTorchNorm)
    return MLASelfAttentionSubmodules(**{**base, **overrides})


def _local_attention_spec(qk_layernorm: bool) -> MLASelfAttentionSubmodules:
    layer = gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=qk_layernorm)
    return layer.submodules.self_attention.submodules


@pytest.mark.parametrize("overrides", [dict(), dict(qk_layernorm=False), dict(qk_layernorm=False, q_lora_rank=None)],
                         ids=["norms", "no_norms", "no_norms_no_q_lora"])
def test_resolution_matches_what_our_mla_builds(overrides):
    cfg = _config(**overrides)
    submodules = _local_attention_spec(cfg.qk_layernorm)
    resolved = QKNormConfigResolver(cfg, submodules).resolve()
    model = GPTModel(cfg, gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True,
                                                                   qk_layernorm=cfg.qk_layernorm), 64, 32)
    attention = model.decoder.layers[0].self_attention
    for name in ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm"):
        built = getattr(attention, name, None)
        if resolved[name] is IdentityOp and built is None:
            continue  # neither builds it (the query projection not used with/without a q latent)
        if name.endswith("layernorm") and resolved[name] is not IdentityOp:  # a norm builder: what it builds
            width = cfg.q_lora_rank if name == "q_layernorm" else cfg.kv_lora_rank
            expected = type(resolved[name](hidden_size=width, config=cfg, eps=cfg.layernorm_epsilon))
        else:
            expected = resolved[name]
        assert type(built) is expected, name


def test_our_mla_accepts_an_unused_q_norm_that_the_resolver_refuses():
    """Why MLASelfAttention does not build through the resolver: the local spec sets q_layernorm with
    qk_layernorm, and our MLA (as the DeepSeek-V2-Lite bridge) runs it with q_lora_rank=None."""
    cfg = _config(q_lora_rank=None)
    submodules = _local_attention_spec(qk_layernorm=True)
    GPTModel(cfg, gpt_layer_specs.get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True), 64, 32)
    with pytest.raises(ValueError, match="q_lora_rank is None`, meaning it will not be used"):
        QKNormConfigResolver(cfg, submodules).resolve()


def test_default_backend_follows_transformer_impl():
    resolver = QKNormConfigResolver(_config(), _local_attention_spec(True))
    assert (resolver.linear_impl, resolver.fused_norm_linear_impl, resolver.qk_norm_impl) == (
        ColumnParallelLinear, None, WrappedTorchNorm)
    assert resolver.variant_str == "MLA" and SHAPE["q_lora_rank"] and YARN


def test_local_backend_cannot_fuse_an_unset_norm():
    with pytest.raises(RuntimeError, match="requires TransformerEngine or q_layernorm/kv_layernorm.*linear_q_up_proj"):
        QKNormConfigResolver(_cfg(), _subs(q_layernorm=None)).resolve()


def test_fused_backend_paths():
    backend = _FusedBackend()
    fused = QKNormConfigResolver(_cfg(), _subs(q_layernorm=IdentityOp, kv_layernorm=None), backend).resolve()
    assert fused == dict(linear_q_proj=IdentityOp, linear_q_up_proj=_FusedNormLinear,
                         linear_kv_up_proj=_FusedNormLinear, q_layernorm=IdentityOp, kv_layernorm=IdentityOp)
    no_q_lora = QKNormConfigResolver(_cfg(q_lora_rank=None), _subs(q_layernorm=None, kv_layernorm=None),
                                     backend).resolve()
    assert no_q_lora["linear_q_proj"] is _FusedNormLinear and no_q_lora["linear_q_up_proj"] is IdentityOp
    spec = ModuleSpec(module=_FusedNormLinear)
    kept = QKNormConfigResolver(_cfg(), _subs(q_layernorm=None, linear_q_up_proj=spec), backend).resolve()
    assert kept["linear_q_up_proj"] is spec and kept["kv_layernorm"] is WrappedTorchNorm
    assert kept["linear_kv_up_proj"] is ColumnParallelLinear
    with pytest.raises(ValueError, match="`q_layernorm=.*` is non-trivial and `linear_q_up_proj=.*` is a fused"):
        QKNormConfigResolver(_cfg(), _subs(linear_q_up_proj=_FusedNormLinear), backend).resolve()
    with pytest.raises(ValueError, match="linear_kv_up_proj=.*qk_layernorm/qk_l2_norm are supposed to be disabled"):
        QKNormConfigResolver(_cfg(qk_layernorm=False), _subs(q_layernorm=None, kv_layernorm=None,
                                                             linear_kv_up_proj=_FusedNormLinear), backend).resolve()
    with pytest.raises(ValueError, match="linear_q_proj=.*supposed to be disabled"):
        QKNormConfigResolver(_cfg(qk_layernorm=False, q_lora_rank=None),
                             _subs(q_layernorm=None, kv_layernorm=None, linear_q_proj=_FusedNormLinear),
                             backend).resolve()
    with pytest.raises(ValueError, match="is fused norm\\+linear, which is not supported for DSA"):
        QKNormConfigResolver(_cfg(experimental_attention_variant="dsa"),
                             _subs(q_layernorm=None, linear_q_up_proj=_FusedNormLinear), backend).resolve()


def test_disabled_norms_refuse_explicit_norms():
    with pytest.raises(ValueError, match="kv_layernorm=.*supposed to be disabled"):
        QKNormConfigResolver(_cfg(qk_layernorm=False), _subs(q_layernorm=None)).resolve()
    resolved = QKNormConfigResolver(_cfg(qk_layernorm=False), _subs(q_layernorm=None, kv_layernorm=IdentityOp,
                                                                     linear_kv_up_proj=None)).resolve()
    assert resolved["linear_kv_up_proj"] is ColumnParallelLinear and resolved["kv_layernorm"] is IdentityOp


def test_dsa_rules():
    dsa = _cfg(experimental_attention_variant="dsa")
    resolved = QKNormConfigResolver(dsa, _subs(q_layernorm=None, kv_layernorm=IdentityOp)).resolve()
    assert resolved == dict(linear_q_proj=IdentityOp, linear_q_up_proj=ColumnParallelLinear,
                            linear_kv_up_proj=ColumnParallelLinear, q_layernorm=WrappedTorchNorm,
                            kv_layernorm=WrappedTorchNorm)
    with pytest.raises(ValueError, match="not supported for DSA because DSA cannot fuse Q norm"):
        QKNormConfigResolver(_cfg(experimental_attention_variant="dsa", q_lora_rank=None),
                             _subs(q_layernorm=None)).resolve()


def test_qk_l2_norm_is_refused():
    with pytest.raises(ValueError, match="qk_l2_norm is not supported with DSA"):
        QKNormConfigResolver(_cfg(qk_l2_norm=True, experimental_attention_variant="dsa"), _subs()).resolve()
    with pytest.raises(ValueError, match="qk_l2_norm is not supported with MLA"):
        QKNormConfigResolver(_cfg(qk_l2_norm=True), _subs()).resolve()
