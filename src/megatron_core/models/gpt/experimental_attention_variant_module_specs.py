"""GPT decoders mixing experimental attention layers with softmax attention (Megatron-Core's
``models.gpt.experimental_attention_variant_module_specs``).

With ``experimental_attention_variant="gated_delta_net"`` (Qwen3-Next style), ``linear_attention_freq`` decides
per layer between a gated delta net (:class:`~megatron_core.ssm.gated_delta_net.GatedDeltaNet`, pattern value 1)
and causal softmax attention (0); ``moe_layer_freq`` independently decides between MoE and dense MLPs. Megatron-Core
builds these specs from Transformer Engine only; here ``transformer_impl="local"`` takes the local layers
(separate norms stored under TE's fused checkpoint names), ``"transformer_engine"`` asks for the TE provider.

With ``"dsa"`` (DeepSeek-V3.2) every layer is MLA self-attention whose core attention is
:class:`~megatron_core.transformer.experimental_attention_variant.dsa.DSAttention`, built, as Megatron-Core does, on
:class:`~megatron_core.transformer.experimental_attention_variant.absorbed_mla.AbsorbedMLASelfAttention` (the key
up projection folded into the query, one shared latent key head; the same function, parameters and checkpoint keys
as ``MLASelfAttention``). The input norm and the q/kv latent norms are separate modules (the indexer reads
the normed query latent), the down projections column-parallel as in the local MLA spec, and the indexer's
projections :class:`~megatron_core.tensor_parallel.duplicated_linear.DuplicatedLinear` (whole on every TP rank).
"""

from __future__ import annotations

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.gpt.moe_module_specs import get_moe_module_spec_for_backend
from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_core.tensor_parallel.duplicated_linear import DuplicatedLinear
from megatron_core.transformer.backend_specs import (
    dense_mlp_spec,
    norm_keys_map,
    norm_linear,
    pre_norm,
    self_attention_spec,
)
from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider, te_spec_provider
from megatron_core.transformer.enums import AttnMaskType, LayerType
from megatron_core.transformer.experimental_attention_variant.absorbed_mla import (
    AbsorbedMLASelfAttention,
    AbsorbedMLASelfAttentionSubmodules,
)
from megatron_core.transformer.experimental_attention_variant.dsa import (
    DSAIndexer,
    DSAIndexerSubmodules,
    DSAttention,
    DSAttentionSubmodules,
    is_dsa_skip_topk_layer,
    source_dsa_compute_layer,
)
from megatron_core.transformer.identity_op import IdentityOp
from megatron_core.transformer.pipeline_layout import get_num_layers_to_build, get_transformer_layer_offset
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_block import TransformerBlockSubmodules
from megatron_core.transformer.transformer_config import TransformerConfig
from megatron_core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

__all__ = [
    "get_dsa_module_spec_for_backend",
    "get_experimental_attention_variant_module_spec",
    "get_gated_delta_net_module_spec",
    "get_linear_attention_pattern",
    "get_moe_layer_pattern",
    "get_transformer_block_with_experimental_attention_variant_spec",
    "get_transformer_layer_with_experimental_attention_variant_spec",
    "is_linear_attention_variant",
]

_LINEAR_ATTENTION_VARIANTS = ("gated_delta_net",)
# Checkpoint names of each separate norm where Transformer Engine fuses it into the next linear layer (DSA keeps its
# input norm separate, as Megatron-Core does).
_NORM_KEYS = {"gdn": {"input_layernorm.": "self_attention.in_proj.layer_norm_"}, "dsa": {},
              "attention": {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"},
              "dense": {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}, "moe": {}}


def _get_backend_spec_provider(config: TransformerConfig) -> BackendSpecProvider:
    """The local layers, or Transformer Engine's with ``transformer_impl="transformer_engine"``."""
    return te_spec_provider() if config.transformer_impl == "transformer_engine" else LocalSpecProvider()


def get_gated_delta_net_module_spec(config: TransformerConfig, backend: BackendSpecProvider | None = None
                                    ) -> ModuleSpec:
    """The :class:`GatedDeltaNet` spec: ``in_proj`` after the input norm (fused where ``backend`` fuses), an RMS
    ``out_norm`` per head and a row-parallel ``out_proj``; ``metainfo["fuse_input_layernorm"]`` says whether the
    layer's input norm lives in ``in_proj``."""
    backend = backend or _get_backend_spec_provider(config)
    return ModuleSpec(
        module=GatedDeltaNet,
        submodules=GatedDeltaNetSubmodules(in_proj=norm_linear(backend),
                                           out_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"),
                                           out_proj=backend.row_parallel_linear()),
        metainfo={"fuse_input_layernorm": backend.fuse_layernorm_and_linear()},
    )


def get_dsa_module_spec_for_backend(config: TransformerConfig, backend: BackendSpecProvider | None = None
                                    ) -> ModuleSpec:
    """DeepSeek sparse attention: causal absorbed MLA self-attention whose core attention is ``DSAttention`` with a
    ``DSAIndexer`` (see the module docstring); ``metainfo["fuse_input_layernorm"]`` is False."""
    if not config.multi_latent_attention:
        raise ValueError("experimental_attention_variant='dsa' needs multi_latent_attention=True (an "
                         "MLATransformerConfig): DSA is the core attention of multi-latent attention")
    if config.qk_l2_norm:
        raise ValueError("qk_l2_norm=True is not supported with experimental_attention_variant='dsa' (MLA)")
    backend = backend or _get_backend_spec_provider(config)
    qk_norm = backend.layer_norm(rms_norm=config.normalization == "RMSNorm", for_qk=True) if config.qk_layernorm \
        else IdentityOp
    return _dsa_attention_spec(backend, qk_norm)


def _dsa_attention_spec(backend: BackendSpecProvider, qk_norm: type) -> ModuleSpec:
    """Causal ``AbsorbedMLASelfAttention`` over ``DSAttention`` from ``backend``'s parts, ``qk_norm`` the q/kv latent
    norms (also the hybrid specs' ``dsa_layer`` attention)."""
    indexer = ModuleSpec(module=DSAIndexer, submodules=DSAIndexerSubmodules(
        linear_wq_b=DuplicatedLinear, linear_wk=DuplicatedLinear,
        k_norm=backend.layer_norm(rms_norm=False, for_qk=True), linear_weights_proj=DuplicatedLinear))
    core_attention = ModuleSpec(module=DSAttention, submodules=DSAttentionSubmodules(indexer=indexer))
    column = backend.column_parallel_linear()
    return ModuleSpec(
        module=AbsorbedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=AbsorbedMLASelfAttentionSubmodules(
            linear_q_proj=column, linear_q_down_proj=column, linear_q_up_proj=column, linear_kv_down_proj=column,
            linear_kv_up_proj=column, core_attention=core_attention, linear_proj=backend.row_parallel_linear(),
            q_layernorm=qk_norm, kv_layernorm=qk_norm),
        metainfo={"fuse_input_layernorm": False},
    )


def _check_dsa_topk_sharing_split(config: TransformerConfig, local_ids: list[int]) -> None:
    """Each DSA layer that reuses another's top-k finds its source layer earlier in the same pipeline chunk."""
    if config.experimental_attention_variant != "dsa" or config.dsa_indexer_topk_freq <= 1:
        return
    position = {layer_id: i for i, layer_id in enumerate(local_ids)}
    freq, offset = config.dsa_indexer_topk_freq, config.dsa_indexer_skip_topk_offset
    for i, layer_id in enumerate(local_ids):
        if not is_dsa_skip_topk_layer(layer_id + 1, offset, freq):
            continue
        source = source_dsa_compute_layer(layer_id + 1, offset, freq)
        if position.get(source - 1, len(local_ids)) > i:
            raise ValueError(f"DSA layer {layer_id + 1} reuses the top-k of layer {source}, which is not earlier in "
                             f"its pipeline chunk (dsa_indexer_topk_freq={freq}, dsa_indexer_skip_topk_offset="
                             f"{offset}): split the pipeline so that each chunk starts on a computing layer")


def get_experimental_attention_variant_module_spec(config: TransformerConfig,
                                                   backend: BackendSpecProvider | None = None) -> ModuleSpec:
    """The spec of ``config.experimental_attention_variant``'s attention module."""
    variant = config.experimental_attention_variant
    if variant == "gated_delta_net":
        return get_gated_delta_net_module_spec(config, backend)
    if variant == "dsa":
        return get_dsa_module_spec_for_backend(config, backend)
    raise ValueError(f"experimental_attention_variant ({variant!r}) must be 'gated_delta_net' or 'dsa'")


def is_linear_attention_variant(experimental_attention_variant: str | None) -> bool:
    """Whether the variant is a linear attention (its layers mix with softmax attention by
    ``linear_attention_freq``)."""
    return experimental_attention_variant in _LINEAR_ATTENTION_VARIANTS


def get_moe_layer_pattern(config: TransformerConfig) -> list[int]:
    """1 (MoE) or 0 (dense) per layer from ``moe_layer_freq``: an int N makes layers 0, N, 2N, ... MoE."""
    freq = config.moe_layer_freq
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
    if isinstance(freq, list):
        if len(freq) != config.num_layers:
            raise ValueError(f"moe_layer_freq has {len(freq)} entries but num_layers is {config.num_layers}")
        return list(freq)
    raise ValueError(f"moe_layer_freq ({freq!r}) must be a positive int or a list of 0/1 per layer")


def get_linear_attention_pattern(config: TransformerConfig) -> list[int]:
    """1 (linear attention) or 0 (softmax attention) per layer from ``linear_attention_freq``: an int N makes every
    N-th layer (N-1, 2N-1, ...) softmax attention; a list is the pattern itself."""
    freq = config.linear_attention_freq
    if freq is None:
        if is_linear_attention_variant(config.experimental_attention_variant):
            raise ValueError(f"experimental_attention_variant ({config.experimental_attention_variant!r}) needs "
                             "linear_attention_freq, got None")
        return [0] * config.num_layers
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [0 if (i + 1) % freq == 0 else 1 for i in range(config.num_layers)]
    if isinstance(freq, list):
        if len(freq) != config.num_layers:
            raise ValueError(f"linear_attention_freq has {len(freq)} entries but num_layers is {config.num_layers}")
        return list(freq)
    raise ValueError(f"linear_attention_freq ({freq!r}) must be a positive int or a list of 0/1 per layer")


def get_transformer_layer_with_experimental_attention_variant_spec(
    config: TransformerConfig, backend: BackendSpecProvider | None = None
) -> list[ModuleSpec]:
    """One ``TransformerLayer`` spec per layer of the whole model: the experimental or softmax attention by
    :func:`get_linear_attention_pattern` (every layer experimental for a non-linear variant), MoE or dense MLP by
    :func:`get_moe_layer_pattern`."""
    backend = backend or _get_backend_spec_provider(config)
    if is_linear_attention_variant(config.experimental_attention_variant):
        attention_pattern = get_linear_attention_pattern(config)
    elif config.experimental_attention_variant is not None:
        attention_pattern = [1] * config.num_layers
    else:
        attention_pattern = [0] * config.num_layers
    if config.num_moe_experts is not None:
        mlp_pattern = get_moe_layer_pattern(config)
    else:
        mlp_pattern = [0] * config.num_layers
    experimental = (get_experimental_attention_variant_module_spec(config, backend)
                    if 1 in attention_pattern else None)
    qk_norm = backend.layer_norm(for_qk=True) if config.qk_layernorm else None
    softmax = self_attention_spec(backend, AttnMaskType.causal, qk_norm) if 0 in attention_pattern else None
    moe = (get_moe_module_spec_for_backend(backend, config.num_moe_experts, config.moe_grouped_gemm)
           if 1 in mlp_pattern else None)
    dense = dense_mlp_spec(backend) if 0 in mlp_pattern else None
    specs = []
    variant_keys = "dsa" if config.experimental_attention_variant == "dsa" else "gdn"
    for attention_flag, moe_flag in zip(attention_pattern, mlp_pattern):
        keys = {**_NORM_KEYS[variant_keys if attention_flag else "attention"],
                **_NORM_KEYS["moe" if moe_flag else "dense"]}
        unfused_input_norm = attention_flag and experimental.metainfo.get("fuse_input_layernorm") is False
        specs.append(ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
            input_layernorm=backend.layer_norm() if unfused_input_norm else pre_norm(backend),
            self_attention=experimental if attention_flag else softmax,
            self_attn_bda=get_bias_dropout_add,
            # Routed experts have no fused norm: an MoE layer keeps its own pre-MLP norm and its name.
            pre_mlp_layernorm=backend.layer_norm() if moe_flag else pre_norm(backend),
            mlp=moe if moe_flag else dense,
            mlp_bda=get_bias_dropout_add,
            sharded_state_dict_keys_map=norm_keys_map(backend, keys),
        )))
    return specs


def get_transformer_block_with_experimental_attention_variant_spec(
    config: TransformerConfig, vp_stage: int | None = None, pp_rank: int | None = None
) -> TransformerBlockSubmodules:
    """This pipeline chunk's layer specs (see :func:`get_transformer_layer_with_experimental_attention_variant_spec`)
    and the final norm, for ``GPTModel(transformer_layer_spec=...)``."""
    backend = _get_backend_spec_provider(config)
    layer_specs = get_transformer_layer_with_experimental_attention_variant_spec(config, backend)
    layout = config.pipeline_model_parallel_layout
    if layout is not None and hasattr(layout, "get_layer_id_list"):
        local_ids = layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage, pp_rank=pp_rank)
    else:
        offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
        local_ids = range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
    _check_dsa_topk_sharing_split(config, list(local_ids))
    return TransformerBlockSubmodules(layer_specs=[layer_specs[i] for i in local_ids],
                                      layer_norm=backend.layer_norm(rms_norm=config.normalization == "RMSNorm"))
