"""The GPT block spec for Model Optimizer (Megatron-Core's ``post_training.modelopt.gpt.model_specs``).

:func:`get_gpt_modelopt_spec` builds every layer from separate parts that Model Optimizer can
quantize one by one: a separate norm (:class:`~..layers.Norm`) before plain column- and row-parallel
linear layers (no fused norm + linear), dot-product attention, and the dense or MoE MLP
(``SequentialMLP`` experts, one linear per expert). Megatron-Core takes its norm and, by default,
its core attention from Transformer Engine; this library uses its own norm, and its own
``DotProductAttention`` unless Transformer Engine is installed and ``local_core_attention=False``.
"""

from __future__ import annotations

from megatron_core.extensions._te_loader import HAVE_TE
from megatron_core.extensions.transformer_engine import TEDotProductAttention
from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.gpt.gpt_layer_specs import get_mlp_module_spec
from megatron_core.post_training.modelopt.layers import (
    BlockwiseFP8WeightTransformerLayer,
    FP8WeightTransformerLayer,
    Linear,
    Norm,
)
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.backends import fused_norm_keys_map
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron_core.transformer.pipeline_layout import get_num_layers_to_build, get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import L2Norm
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["get_gpt_modelopt_spec"]

_LAYER_CLASSES = {
    "None": TransformerLayer,
    "fp8_real_quant": FP8WeightTransformerLayer,
    "fp8_blockwise_real_quant": BlockwiseFP8WeightTransformerLayer,
}

# Where a Transformer Engine layer stores the MLA latent norms (fused into the up projections).
_MLA_NORM_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}


def _keys_maps(config: TransformerConfig, remap_te_layernorm: bool) -> tuple[dict[str, str], dict[str, str]]:
    """``(dense, moe)`` layers' ``sharded_state_dict_keys_map``: the norms under the names a TE checkpoint uses."""
    if not remap_te_layernorm:
        return {}, {}
    if config.multi_latent_attention:
        attention = dict(_MLA_NORM_KEYS) if config.qk_layernorm else {}
    else:
        attention = fused_norm_keys_map(attention=True, mlp=False)
    return {**attention, **fused_norm_keys_map(attention=False, mlp=True)}, dict(attention)


def _attention_spec(config: TransformerConfig, core_attention: type, attn_mask_type: AttnMaskType,
                    qk_l2_norm: bool = False) -> ModuleSpec:
    if config.multi_latent_attention:
        # This library's MLA takes the latent norms exactly when qk_layernorm is set.
        latent_norm = Norm if config.qk_layernorm else IdentityOp
        return ModuleSpec(
            module=MLASelfAttention,
            params={"attn_mask_type": attn_mask_type},
            submodules=MLASelfAttentionSubmodules(
                linear_q_proj=ColumnParallelLinear, linear_q_down_proj=Linear, q_layernorm=latent_norm,
                linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=Linear, kv_layernorm=latent_norm,
                linear_kv_up_proj=ColumnParallelLinear, core_attention=core_attention, linear_proj=RowParallelLinear,
            ),
        )
    qk_norm = L2Norm if qk_l2_norm else Norm if config.qk_layernorm else IdentityOp
    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": attn_mask_type},
        submodules=SelfAttentionSubmodules(linear_qkv=ColumnParallelLinear, core_attention=core_attention,
                                           linear_proj=RowParallelLinear, q_layernorm=qk_norm, k_layernorm=qk_norm),
    )


def _layer_spec(layer: type, attention: ModuleSpec, mlp: ModuleSpec, keys_map: dict[str, str]) -> ModuleSpec:
    return ModuleSpec(
        module=layer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=Norm, self_attention=attention, self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=Norm, mlp=mlp, mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys_map,
        ),
    )


def _moe_pattern(config: TransformerConfig) -> list[int]:
    """1 (MoE) or 0 (dense) per layer from ``config.moe_layer_freq``: every N-th layer, or an explicit list."""
    freq = config.moe_layer_freq
    if isinstance(freq, int):
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list):
        if len(freq) != config.num_layers or any(flag not in (0, 1) for flag in freq):
            raise ValueError(f"moe_layer_freq ({freq}) must hold num_layers ({config.num_layers}) entries of 0 or 1")
        return list(freq)
    raise ValueError(f"moe_layer_freq ({freq!r}) must be an int or a list of 0/1 per layer")


def get_gpt_modelopt_spec(
    config: TransformerConfig,
    local_core_attention: bool = False,
    remap_te_layernorm: bool = False,
    real_quant_cfg: str = "None",
    qk_l2_norm: bool = False,
    use_arbitrary_attention_mask: bool = False,
) -> TransformerBlockSubmodules:
    """The decoder block spec of a GPT model for Model Optimizer: this pipeline stage's layers and the final norm.

    Args:
        config: the model's transformer config (MoE layers where ``num_moe_experts`` and
            ``moe_layer_freq`` say so; MLA with ``multi_latent_attention``).
        local_core_attention: use this library's ``DotProductAttention``; without it Transformer
            Engine's attention is used where Transformer Engine is installed (else the local one).
        remap_te_layernorm: store the separate norms in checkpoints under the names of the fused
            Transformer Engine modules (``self_attention.linear_qkv.layer_norm_*``,
            ``mlp.linear_fc1.layer_norm_*``), so checkpoints of the TE layer spec load.
        real_quant_cfg: ``"None"``, or ``"fp8_real_quant"`` / ``"fp8_blockwise_real_quant"`` for
            layers whose linear weights are stored in FP8 (:mod:`..layers`).
        qk_l2_norm: Llama 4's L2 norm of queries and keys (``L2Norm`` in both q/k norm slots;
            ``config.qk_l2_norm`` wins where set, as in Megatron-Core); not with MLA (``ValueError``).
        use_arbitrary_attention_mask: attend by the given mask instead of the causal one.

    Also registers this library's layers with Model Optimizer's quantization
    (:func:`~megatron_core.post_training.modelopt.register_quant_modules`), which needs it installed.
    """
    from megatron_core.post_training.modelopt import register_quant_modules

    if real_quant_cfg not in _LAYER_CLASSES:
        raise ValueError(f"real_quant_cfg ({real_quant_cfg!r}) must be one of {sorted(_LAYER_CLASSES)}")
    qk_l2_norm = getattr(config, "qk_l2_norm", qk_l2_norm)
    if qk_l2_norm and config.multi_latent_attention:
        raise ValueError("qk_l2_norm=True is not supported with multi_latent_attention=True (as in Megatron-Core)")
    register_quant_modules()
    attn_mask_type = AttnMaskType.arbitrary if use_arbitrary_attention_mask else AttnMaskType.causal
    core_attention = TEDotProductAttention if HAVE_TE and not local_core_attention else DotProductAttention
    attention = _attention_spec(config, core_attention, attn_mask_type, qk_l2_norm)
    layer = _LAYER_CLASSES[real_quant_cfg]
    dense_keys, moe_keys = _keys_maps(config, remap_te_layernorm)
    dense = _layer_spec(layer, attention, get_mlp_module_spec(use_te=False), dense_keys)
    if config.num_moe_experts is None:
        layer_specs = [dense] * config.num_layers
    else:
        moe_mlp = get_mlp_module_spec(use_te=False, num_experts=config.num_moe_experts, moe_grouped_gemm=False)
        moe = _layer_spec(layer, attention, moe_mlp, moe_keys)
        layer_specs = [moe if flag else dense for flag in _moe_pattern(config)]
    offset = get_transformer_layer_offset(config)
    layer_specs = layer_specs[offset:offset + get_num_layers_to_build(config)]
    return TransformerBlockSubmodules(layer_specs=layer_specs, layer_norm=Norm)
