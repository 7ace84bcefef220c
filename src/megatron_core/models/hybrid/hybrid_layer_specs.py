"""Layer specs of hybrid models (Megatron-Core's ``models.hybrid.hybrid_layer_specs``) on local modules.

Megatron-Core's specs use Transformer Engine (fused norm + linear); here they are built from
``LocalSpecProvider``, as ``get_gpt_layer_local_spec`` is: each fused ``TELayerNormColumnParallelLinear``
becomes a separate norm plus a ``ColumnParallelLinear``, and ``sharded_state_dict_keys_map`` stores the
norm under TE's fused checkpoint name. ``mamba_stack_spec`` and ``hybrid_stack_spec`` are the same spec.

The ``D`` (DeepSeek sparse attention) layers are ``AbsorbedMLASelfAttention`` over ``DSAttention`` and the ``+``
(multi-latent attention) layers ``MLASelfAttention``, each after a separate input norm, as in Megatron-Core. Their
q / kv latent norms are RMS/LayerNorm modules (Megatron-Core fills IdentityOp slots from the config), so these
layers need ``qk_layernorm=True`` (a ``ValueError`` names it otherwise).

Its ``mtp_block_spec`` holds the multi-token prediction depths' own parts (the embedding and hidden norms, the
``2h -> h`` projection and the final norm); ``mtp_model_layer`` is None because each depth builds its layers from the
MTP part of the hybrid layer pattern with these same layer specs.

The ``E`` layers of ``hybrid_stack_spec`` are ``MoETransformerLayer``s (the same parameters and checkpoint keys as
a ``TransformerLayer``). ``hybrid_inference_stack_spec`` (alias ``mamba_inference_stack_spec``) is the same stack on
``InferenceSpecProvider``'s parts with the ``moe_inference`` block (``get_inference_optimized_moe_spec``: dense
top-k routing and grouped experts under an inference engine) in plain ``TransformerLayer``s, as in Megatron-Core.
Its checkpoint keys equal the training spec's except the routed experts', which are grouped (``linear_fc1.weight<i>``
rather than ``local_experts.<i>.linear_fc1.weight``; the sharded checkpoint keys are the same for both).
"""

from __future__ import annotations

from megatron_core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron_core.models.backends import InferenceSpecProvider
from megatron_core.models.gpt.experimental_attention_variant_module_specs import _dsa_attention_spec
from megatron_core.models.gpt.moe_module_specs import (
    get_inference_optimized_moe_spec,
    get_moe_module_spec_for_backend,
)
from megatron_core.ssm.gated_delta_net import GatedDeltaNet, GatedDeltaNetSubmodules
from megatron_core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron_core.ssm.mamba_mixer import MambaMixer, MambaMixerSubmodules
from megatron_core.ssm.mlp_layer import MLPLayer
from megatron_core.transformer.backend_specs import (
    dense_mlp_spec,
    norm_keys_map,
    norm_linear,
    pre_norm,
    pre_norm_layer_submodules,
    self_attention_spec,
)
from megatron_core.transformer.backends import BackendSpecProvider, LocalSpecProvider
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.hybrid_stack import HybridStack, HybridStackSubmodules
from megatron_core.transformer.multi_latent_attention import MLASelfAttention, MLASelfAttentionSubmodules
from megatron_core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec_for_backend,
)
from megatron_core.transformer.spec_utils import ModuleSpec
from megatron_core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

__all__ = ["hybrid_inference_stack_spec", "hybrid_stack_spec", "mamba_inference_stack_spec", "mamba_stack_spec", "moe",
           "moe_inference"]

# Checkpoint name of a Mamba layer's separate norm: Transformer Engine fuses it into the mixer's in_proj.
_MAMBA_NORM_KEY = {"norm.": "mixer.in_proj.layer_norm_"}
# ... and a gated delta net layer's input norm, fused into its in_proj the same way.
_GDN_NORM_KEY = {"input_layernorm.": "self_attention.in_proj.layer_norm_"}


def _hybrid_mtp_block_spec(backend: BackendSpecProvider) -> ModuleSpec:
    """The MTP block of a hybrid model: one layer spec with ``backend``'s norms and projection and no model layer."""
    return ModuleSpec(module=MultiTokenPredictionBlock, submodules=MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec_for_backend(None, backend)]))


def _latent_attention_layer(attention: ModuleSpec, backend: BackendSpecProvider) -> ModuleSpec:
    """A hybrid ``D`` / ``+`` layer: a separate input norm, then ``attention`` and its bias-dropout-add."""
    return ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=backend.layer_norm(), self_attention=attention, self_attn_bda=get_bias_dropout_add))


def _mla_attention_spec(backend: BackendSpecProvider) -> ModuleSpec:
    """Causal ``MLASelfAttention`` with latent norms on ``backend``'s parts (the ``+`` layers)."""
    column, qk_norm = backend.column_parallel_linear(), backend.layer_norm(rms_norm=True, for_qk=True)
    return ModuleSpec(module=MLASelfAttention, params={"attn_mask_type": AttnMaskType.causal},
                      submodules=MLASelfAttentionSubmodules(
                          linear_q_proj=column, linear_q_down_proj=column, linear_q_up_proj=column,
                          linear_kv_down_proj=column, linear_kv_up_proj=column,
                          core_attention=backend.core_attention(), linear_proj=backend.row_parallel_linear(),
                          q_layernorm=qk_norm, kv_layernorm=qk_norm))


def _hybrid_stack_spec(backend: BackendSpecProvider, moe_spec: ModuleSpec, moe_layer: type) -> ModuleSpec:
    """A ``HybridStack`` whose Mamba, gated delta net, attention, MLP and MoE (``moe_spec`` in a ``moe_layer``)
    layers take ``backend``'s parts, with the MTP block spec of the same backend."""
    return ModuleSpec(
        module=HybridStack,
        submodules=HybridStackSubmodules(
            mamba_layer=ModuleSpec(
                module=MambaLayer,
                submodules=MambaLayerSubmodules(
                    norm=pre_norm(backend),
                    mixer=ModuleSpec(module=MambaMixer, submodules=MambaMixerSubmodules(
                        in_proj=norm_linear(backend), out_proj=backend.row_parallel_linear())),
                    mamba_bda=get_bias_dropout_add,
                    sharded_state_dict_keys_map=norm_keys_map(backend, _MAMBA_NORM_KEY),
                ),
            ),
            gdn_layer=ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
                input_layernorm=pre_norm(backend),
                self_attention=ModuleSpec(module=GatedDeltaNet, submodules=GatedDeltaNetSubmodules(
                    in_proj=norm_linear(backend), out_norm=backend.layer_norm(rms_norm=True),
                    out_proj=backend.row_parallel_linear())),
                self_attn_bda=get_bias_dropout_add,
                sharded_state_dict_keys_map=norm_keys_map(backend, _GDN_NORM_KEY),
            )),
            attention_layer=ModuleSpec(module=TransformerLayer, submodules=pre_norm_layer_submodules(
                backend, self_attention=self_attention_spec(backend, AttnMaskType.causal))),
            dsa_layer=_latent_attention_layer(
                _dsa_attention_spec(backend, backend.layer_norm(rms_norm=True, for_qk=True)), backend),
            mla_layer=_latent_attention_layer(_mla_attention_spec(backend), backend),
            mlp_layer=ModuleSpec(module=MLPLayer, submodules=pre_norm_layer_submodules(
                backend, mlp=dense_mlp_spec(backend))),
            # Routed experts have no fused norm: the MoE layer keeps its own pre-MLP norm and its name.
            moe_layer=ModuleSpec(module=moe_layer, submodules=TransformerLayerSubmodules(
                pre_mlp_layernorm=backend.layer_norm(), mlp=moe_spec, mlp_bda=get_bias_dropout_add)),
            mtp_block_spec=_hybrid_mtp_block_spec(backend),
        ),
    )


# The MoE block of the ``E`` layers (8 local experts, no grouped GEMM; the config's MoE fields decide the rest).
moe = get_moe_module_spec_for_backend(LocalSpecProvider(), num_experts=8, moe_grouped_gemm=False)

# The MoE block of the inference spec's ``E`` layers.
moe_inference = get_inference_optimized_moe_spec()

hybrid_stack_spec = _hybrid_stack_spec(LocalSpecProvider(), moe, MoETransformerLayer)

hybrid_inference_stack_spec = _hybrid_stack_spec(InferenceSpecProvider(), moe_inference, TransformerLayer)

mamba_stack_spec = hybrid_stack_spec
mamba_inference_stack_spec = hybrid_inference_stack_spec
