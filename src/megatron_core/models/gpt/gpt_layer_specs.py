"""Layer specs for GPT models (Megatron-Core's ``gpt_layer_specs``).

``get_gpt_layer_local_spec()`` is pure PyTorch; ``get_gpt_layer_with_transformer_engine_spec()``
uses Transformer Engine (installed with the ``te`` extra), whose fused norm + QKV linear means the
layer has no separate ``input_layernorm``; ``get_gpt_layer_with_inference_spec()`` is Megatron's
inference-optimized layer on the local modules. The first two take an optional ``backend`` provider (an
extension over Megatron-Core) to swap single parts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron_core.transformer.backend_specs import (
    dense_mlp_spec,
    norm_keys_map,
    pre_norm,
    self_attention_spec,
)
from megatron_core.transformer.backends import fused_norm_keys_map
from megatron_core.transformer.backends import te_spec_provider as _te_spec_provider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron_core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_offset,
    get_mtp_layer_spec_for_backend,
    get_mtp_num_layers_to_build,
)
from megatron_core.transformer.pipeline_layout import get_num_layers_to_build, get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.torch_norm import L2Norm, WrappedTorchNorm
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "get_gpt_decoder_block_spec",
    "get_gpt_decoder_layer_specs",
    "get_gpt_layer_local_spec",
    "get_gpt_layer_local_submodules",
    "get_gpt_layer_with_inference_spec",
    "get_gpt_layer_with_inference_submodules",
    "get_gpt_layer_with_transformer_engine_spec",
    "get_gpt_layer_with_transformer_engine_submodules",
    "get_gpt_mtp_block_spec",
    "get_gpt_mtp_block_spec_for_backend",
    "get_mlp_module_spec",
    "get_mlp_module_spec_for_backend",
]


def _reject_unsupported(**flags: bool) -> None:
    enabled = sorted(name for name, value in flags.items() if value)
    if enabled:
        raise ValueError(f"{enabled} are not supported by this library")


def get_mlp_module_spec_for_backend(backend: BackendSpecProvider, num_experts: int | None = None,
                                    moe_grouped_gemm: bool = False) -> ModuleSpec:
    """The dense MLP spec built from ``backend``'s linear layers, or the MoE spec when ``num_experts`` is set."""
    if num_experts is not None:
        return get_moe_module_spec_for_backend(backend, num_experts, moe_grouped_gemm)
    return dense_mlp_spec(backend)


def get_mlp_module_spec(
    use_te: bool = True, num_experts: int | None = None, moe_grouped_gemm: bool = False, fp8: str | None = None,
    moe_use_legacy_grouped_gemm: bool = False,
) -> ModuleSpec:
    """The dense MLP spec for the Transformer Engine (``use_te``) or local backend."""
    if use_te:
        return get_mlp_module_spec_for_backend(_te_spec_provider(), num_experts, moe_grouped_gemm)
    return get_mlp_module_spec_for_backend(LocalSpecProvider(), num_experts, moe_grouped_gemm)


def _transformer_layer(backend: BackendSpecProvider, input_norm: Any, attention: ModuleSpec, pre_mlp_norm: Any,
                       num_experts: int | None, moe_grouped_gemm: bool, keys_map: dict | None = None) -> ModuleSpec:
    """A GPT ``TransformerLayer`` around ``attention``, with the backend's dense or MoE MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=input_norm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=pre_mlp_norm,
            mlp=get_mlp_module_spec_for_backend(backend, num_experts, moe_grouped_gemm),
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=keys_map or {},
        ),
    )


def _mla_layer_spec(backend: BackendSpecProvider, qk_layernorm: bool, num_experts: int | None = None,
                    moe_grouped_gemm: bool = False) -> ModuleSpec:
    """A GPT layer with multi-latent attention: separate norms (no keys map), as Megatron-Core's local MLA spec."""
    linear = backend.column_parallel_linear()
    qk_norm = backend.layer_norm(rms_norm=True, for_qk=True) if qk_layernorm else IdentityOp
    attention = ModuleSpec(
        module=MLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=linear,
            linear_q_down_proj=linear,
            linear_q_up_proj=linear,
            linear_kv_down_proj=linear,
            linear_kv_up_proj=linear,
            core_attention=backend.core_attention(),
            linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm,
            kv_layernorm=qk_norm,
        ),
    )
    return _transformer_layer(backend, backend.layer_norm(), attention, backend.layer_norm(), num_experts,
                              moe_grouped_gemm)


def _layer_spec(backend: BackendSpecProvider, qk_layernorm: bool, num_experts: int | None = None,
                moe_grouped_gemm: bool = False, multi_latent_attention: bool = False,
                qk_l2_norm: bool = False) -> ModuleSpec:
    """A GPT layer; ``qk_l2_norm`` puts ``L2Norm`` in both q/k norm slots (it wins over ``qk_layernorm``)."""
    if multi_latent_attention:
        if qk_l2_norm:
            raise ValueError("qk_l2_norm=True is not supported with multi_latent_attention=True (as in Megatron-Core)")
        return _mla_layer_spec(backend, qk_layernorm, num_experts, moe_grouped_gemm)
    norm = pre_norm(backend)
    # An MoE layer's experts have no fused norm: it keeps a separate pre-MLP norm.
    pre_mlp_norm = backend.layer_norm() if num_experts is not None else norm
    qk_norm = L2Norm if qk_l2_norm else backend.layer_norm(for_qk=True) if qk_layernorm else None
    attention = self_attention_spec(backend, AttnMaskType.causal, qk_norm)
    return _transformer_layer(backend, norm, attention, pre_mlp_norm, num_experts, moe_grouped_gemm,
                              norm_keys_map(backend))


def get_gpt_layer_local_submodules(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    *,
    backend: BackendSpecProvider | None = None,
) -> TransformerLayerSubmodules:
    """The submodules of :func:`get_gpt_layer_local_spec` (Megatron-Core's ``get_gpt_layer_local_submodules``)."""
    return get_gpt_layer_local_spec(
        num_experts, moe_grouped_gemm, qk_layernorm, multi_latent_attention, fp8, normalization, qk_l2_norm,
        use_kitchen, use_kitchen_attention, kitchen_attention_backend, backend=backend,
    ).submodules


def get_gpt_layer_with_transformer_engine_submodules(*args: Any, **kwargs: Any) -> TransformerLayerSubmodules:
    """The submodules of :func:`get_gpt_layer_with_transformer_engine_spec`."""
    return get_gpt_layer_with_transformer_engine_spec(*args, **kwargs).submodules


def get_gpt_layer_local_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    normalization: str | None = None,
    qk_l2_norm: bool = False,
    use_kitchen: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    *,
    backend: BackendSpecProvider | None = None,
) -> ModuleSpec:
    """A GPT layer from PyTorch and this library's TP layers; ``normalization`` is taken from the config.

    ``multi_latent_attention`` builds ``MLASelfAttention`` (its q/kv latent norms only with ``qk_layernorm``);
    ``qk_l2_norm`` puts ``L2Norm`` in the q/k norm slots (not with MLA).
    """
    _reject_unsupported(use_kitchen=use_kitchen, use_kitchen_attention=use_kitchen_attention)
    return _layer_spec(backend or LocalSpecProvider(), qk_layernorm, num_experts, moe_grouped_gemm,
                       multi_latent_attention, qk_l2_norm)


def get_gpt_layer_with_transformer_engine_spec(
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    fp8: str | None = None,
    qk_l2_norm: bool = False,
    use_te_op_fuser: bool = False,
    use_kitchen: bool = False,
    use_te_activation_func: bool = False,
    use_kitchen_attention: bool = False,
    kitchen_attention_backend: str = "sdpa",
    mla_down_proj_fusion: bool = False,
    use_grouped_gemm_for_dense_mlp: bool = False,
) -> ModuleSpec:
    """A GPT layer on Transformer Engine modules (raises ``ImportError`` naming the ``te`` extra when missing)."""
    _reject_unsupported(
        use_te_op_fuser=use_te_op_fuser, use_kitchen=use_kitchen,
        use_te_activation_func=use_te_activation_func, use_kitchen_attention=use_kitchen_attention,
        use_grouped_gemm_for_dense_mlp=use_grouped_gemm_for_dense_mlp,
    )
    return _layer_spec(_te_spec_provider(), qk_layernorm, num_experts, moe_grouped_gemm, multi_latent_attention,
                       qk_l2_norm)


def get_gpt_layer_with_inference_spec(
    qk_layernorm: bool = False,
    multi_latent_attention: bool = False,
    qk_l2_norm: bool = False,
    num_experts: int | None = None,
    moe_grouped_gemm: bool = False,
    moe_use_legacy_grouped_gemm: bool = False,
) -> ModuleSpec:
    """The layer of Megatron-Core's ``transformer_impl="inference_optimized"``, on this library's local modules.

    Megatron builds it from Transformer Engine based inference linears (symmetric-memory collectives, fused
    norms); here the same computation runs on the local layers, as in :func:`get_gpt_layer_local_spec`, and
    ``sharded_state_dict_keys_map`` stores each separate norm under the checkpoint name of the fused module
    it stands for: ``self_attention.linear_qkv.layer_norm_*``, ``mlp.linear_fc1.layer_norm_*`` (a dense MLP;
    an MoE layer keeps ``pre_mlp_layernorm.*``) and, with MLA and ``qk_layernorm``, the ``layer_norm_*`` of
    ``linear_q_up_proj`` / ``linear_kv_up_proj``; an MLA layer keeps ``input_layernorm.*``.
    ``moe_use_legacy_grouped_gemm`` is accepted and unused, as in Megatron-Core.
    """
    spec = _layer_spec(LocalSpecProvider(), qk_layernorm, num_experts, moe_grouped_gemm, multi_latent_attention,
                       qk_l2_norm)
    keys_map = fused_norm_keys_map(attention=not multi_latent_attention, mlp=num_experts is None)
    if multi_latent_attention and qk_layernorm:
        keys_map["self_attention.q_layernorm."] = "self_attention.linear_q_up_proj.layer_norm_"
        keys_map["self_attention.kv_layernorm."] = "self_attention.linear_kv_up_proj.layer_norm_"
    spec.submodules = dataclasses.replace(spec.submodules, sharded_state_dict_keys_map=keys_map)
    return spec


def get_gpt_layer_with_inference_submodules(*args: Any, **kwargs: Any) -> TransformerLayerSubmodules:
    """The submodules of :func:`get_gpt_layer_with_inference_spec`."""
    return get_gpt_layer_with_inference_spec(*args, **kwargs).submodules


def get_gpt_decoder_layer_specs(config: TransformerConfig, use_transformer_engine: bool,
                                normalization: str | None = None, qk_l2_norm: bool | None = False,
                                **kwargs: Any) -> list[ModuleSpec]:
    """One spec per layer of the whole model: MoE where ``config.moe_layer_freq`` says so, dense elsewhere.

    ``moe_layer_freq`` N means layers 0, N, 2N, ... are MoE; a list gives 1 (MoE) or 0 (dense) per layer. With
    ``use_transformer_engine`` the Transformer Engine layers, else with ``config.transformer_impl ==
    "inference_optimized"`` :func:`get_gpt_layer_with_inference_spec`'s, else the local ones (Megatron-Core's choice).
    """
    if use_transformer_engine:
        get_spec = get_gpt_layer_with_transformer_engine_spec
    elif getattr(config, "transformer_impl", "local") == "inference_optimized":
        get_spec = get_gpt_layer_with_inference_spec
    else:
        get_spec = get_gpt_layer_local_spec
    common = dict(qk_layernorm=config.qk_layernorm, multi_latent_attention=config.multi_latent_attention,
                  qk_l2_norm=bool(qk_l2_norm))
    dense = get_spec(num_experts=None, **common)
    if config.num_moe_experts is None:
        return [dense] * config.num_layers
    moe = get_spec(num_experts=config.num_moe_experts, moe_grouped_gemm=config.moe_grouped_gemm, **common)
    freq = config.moe_layer_freq
    pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    if len(pattern) != config.num_layers:
        raise ValueError(f"moe_layer_freq has {len(pattern)} entries but num_layers is {config.num_layers}")
    return [moe if flag else dense for flag in pattern]


def get_gpt_decoder_block_spec(
    config: TransformerConfig,
    use_transformer_engine: bool,
    normalization: str | None = None,
    qk_l2_norm: bool | None = False,
    vp_stage: int | None = None,
    pp_rank: int | None = None,
    **kwargs: Any,
) -> TransformerBlockSubmodules:
    """Per-layer specs of this pipeline chunk (dense and MoE layers per ``moe_layer_freq``) and the final norm."""
    layer_specs = get_gpt_decoder_layer_specs(config, use_transformer_engine, normalization, qk_l2_norm)
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=layer_specs[offset:offset + num_layers], layer_norm=WrappedTorchNorm)


def get_gpt_mtp_block_spec_for_backend(config: TransformerConfig, spec: ModuleSpec | TransformerBlockSubmodules,
                                       backend: BackendSpecProvider, vp_stage: int | None = None,
                                       pp_rank: int | None = None) -> MultiTokenPredictionBlockSubmodules | None:
    """The MTP block spec of this pipeline chunk (None where it holds no MTP layer): one MTP layer per depth
    around ``spec``'s transformer layer (the last one of a block spec), with ``backend``'s norm and projection."""
    num_layers = get_mtp_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    if num_layers == 0:
        return None
    if isinstance(spec, TransformerBlockSubmodules):
        layer_spec = spec.layer_specs[-1]
    elif isinstance(spec, ModuleSpec) and spec.module is TransformerLayer:
        layer_spec = spec
    else:
        raise ValueError(f"get_gpt_mtp_block_spec needs a TransformerBlockSubmodules or a TransformerLayer spec, "
                         f"got {type(spec).__name__}")
    mtp_layer = get_mtp_layer_spec_for_backend(layer_spec, backend)
    if config.mtp_use_repeated_layer:
        return MultiTokenPredictionBlockSubmodules(layer_specs=[mtp_layer])
    offset = get_mtp_layer_offset(config, vp_stage=vp_stage)
    specs = ([mtp_layer] * (config.mtp_num_layers or 0))[offset:offset + num_layers]
    if specs and len(specs) != config.mtp_num_layers:
        raise ValueError("all MTP layers must be on the same pipeline stage")
    return MultiTokenPredictionBlockSubmodules(layer_specs=specs) if specs else None


def get_gpt_mtp_block_spec(config: TransformerConfig, spec: ModuleSpec | TransformerBlockSubmodules,
                           use_transformer_engine: bool, vp_stage: int | None = None,
                           pp_rank: int | None = None) -> MultiTokenPredictionBlockSubmodules | None:
    """The MTP block spec (see :func:`get_gpt_mtp_block_spec_for_backend`) with Transformer Engine's or the local
    layers."""
    backend = _te_spec_provider() if use_transformer_engine else LocalSpecProvider()
    return get_gpt_mtp_block_spec_for_backend(config, spec, backend, vp_stage=vp_stage, pp_rank=pp_rank)
