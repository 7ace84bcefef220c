"""The hybrid (Mamba) stack spec for Model Optimizer (Megatron-Core's ``post_training.modelopt.hybrid.model_specs``).

:func:`get_hybrid_stack_modelopt_spec` builds every layer kind of a hybrid stack (Mamba, gated delta net,
attention, MLP, MoE) from parts Model Optimizer can quantize one by one: a separate :class:`~..layers.Norm`
before plain column- and row-parallel linears, dot-product attention and ``SequentialMLP`` experts. Megatron-Core
takes the norm and, by default, the core attention from Transformer Engine; here the norm is this library's and
the core attention Transformer Engine's only where it is installed and ``local_core_attention`` is False.
With ``use_default_te_spec=True`` the model's standard spec is returned (this library's ``hybrid_stack_spec``,
or :data:`hybrid_stack_spec_no_moe_grouped_gemm`).
"""

from __future__ import annotations

from megatron_core.extensions._te_loader import HAVE_TE
from megatron_core.extensions.transformer_engine import TEDotProductAttention
from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.post_training.modelopt.layers import Norm
from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron_core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron_core.ssm.mlp_layer import MLPLayer
from megatron_core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron_core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron_core.transformer.dot_product_attention import DotProductAttention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_core.transformer.mlp import MLP, MLPSubmodules
from megatron_core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    MultiTokenPredictionLayer,
    MultiTokenPredictionLayerSubmodules,
)
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = ["get_hybrid_stack_modelopt_spec", "get_mamba_stack_modelopt_spec", "hybrid_stack_spec_no_moe_grouped_gemm"]

# Where Transformer Engine's fused layers keep the norms that are separate here (remap_te_layernorm).
_MAMBA_TE_KEYS = {"norm.": "mixer.in_proj.layer_norm_"}
_GDN_TE_KEYS = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}
_TRANSFORMER_TE_KEYS = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_",
                        "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}


def _sequential_moe_layer() -> ModuleSpec:
    """An MoE layer whose experts are ``SequentialMLP`` (one linear pair per expert), the norm kept separate."""
    # num_experts only selects the MoE block here: the config's MoE fields decide the rest.
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=Norm, mlp=get_moe_module_spec(use_te=False, num_experts=8, moe_grouped_gemm=False),
        mlp_bda=get_bias_dropout_add))


hybrid_stack_spec_no_moe_grouped_gemm = ModuleSpec(
    module=hybrid_stack_spec.module,
    submodules=HybridStackSubmodules(**{**vars(hybrid_stack_spec.submodules), "moe_layer": _sequential_moe_layer()}),
)
"""The standard hybrid stack spec with ``SequentialMLP`` experts (Model Optimizer's per-expert flows, e.g. pruning).
This library's ``hybrid_stack_spec`` has no grouped GEMM in its MoE layers either; the two build the same model."""


def _local_spec(local_core_attention: bool, remap_te_layernorm: bool) -> ModuleSpec:
    """Every layer kind built from separate norms and plain parallel linears."""
    def keys(te_keys: dict[str, str]) -> dict[str, str]:
        return dict(te_keys) if remap_te_layernorm else {}

    core_attention = TEDotProductAttention if HAVE_TE and not local_core_attention else DotProductAttention
    mamba_layer = ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(
        norm=Norm,
        mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
            in_proj=ColumnParallelLinear, out_proj=RowParallelLinear)),
        mamba_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys(_MAMBA_TE_KEYS)))
    gdn_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=Norm,
        self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
            in_proj=ColumnParallelLinear, out_norm=Norm, out_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys(_GDN_TE_KEYS)))
    attention_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=Norm,
        self_attention=ModuleSpec(module=SelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                                  submodules=SelfAttentionSubmodules(
                                      linear_qkv=ColumnParallelLinear, core_attention=core_attention,
                                      linear_proj=RowParallelLinear)),
        self_attn_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys(_TRANSFORMER_TE_KEYS)))
    mlp_layer = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=Norm,
        mlp=ModuleSpec(module=MLP, submodules=MLPSubmodules(linear_fc1=ColumnParallelLinear,
                                                            linear_fc2=RowParallelLinear)),
        mlp_bda=get_bias_dropout_add, sharded_state_dict_keys_map=keys(_TRANSFORMER_TE_KEYS)))
    # The MTP depths' own parts; each depth builds its layers from the pattern with the layer specs above.
    mtp_layer = ModuleSpec(module=MultiTokenPredictionLayer, submodules=MultiTokenPredictionLayerSubmodules(
        enorm=Norm, hnorm=Norm, eh_proj=ColumnParallelLinear, mtp_model_layer=None, layer_norm=Norm))
    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        mamba_layer=mamba_layer, gdn_layer=gdn_layer, attention_layer=attention_layer, mlp_layer=mlp_layer,
        moe_layer=_sequential_moe_layer(), mtp_block_spec=ModuleSpec(
            module=MultiTokenPredictionBlock,
            submodules=MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer]))))


def get_hybrid_stack_modelopt_spec(local_core_attention: bool = False, remap_te_layernorm: bool = False,
                                   use_default_te_spec: bool = False, moe_grouped_gemm: bool = True) -> ModuleSpec:
    """The hybrid stack spec for Model Optimizer's quantization, pruning and export.

    Args:
        local_core_attention: use this library's ``DotProductAttention`` (else Transformer Engine's where it is
            installed).
        remap_te_layernorm: store the separate norms in checkpoints under the names of Transformer Engine's fused
            modules (``mixer.in_proj.layer_norm_*``, ``self_attention.linear_qkv.layer_norm_*``,
            ``mlp.linear_fc1.layer_norm_*``, ``self_attention.in_proj.layer_norm_*``), so that checkpoints of the
            standard spec load.
        use_default_te_spec: return the model's standard spec instead (the two flags above do not apply).
        moe_grouped_gemm: with ``use_default_te_spec``, False gives
            :data:`hybrid_stack_spec_no_moe_grouped_gemm`.

    Also registers this library's layers with Model Optimizer's quantization, which needs it installed.
    """
    if use_default_te_spec:
        return hybrid_stack_spec if moe_grouped_gemm else hybrid_stack_spec_no_moe_grouped_gemm
    from megatron_core.post_training.modelopt import register_quant_modules

    register_quant_modules()
    return _local_spec(local_core_attention, remap_te_layernorm)


get_mamba_stack_modelopt_spec = get_hybrid_stack_modelopt_spec
"""Megatron-Core's earlier name of :func:`get_hybrid_stack_modelopt_spec`."""
