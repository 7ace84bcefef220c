"""Megatron-Core config fields of features this library does not have, so that Megatron-Core configs construct.

``ModelParallelConfig`` and ``TransformerConfig`` inherit these fields (Megatron-Core 0.19's names and defaults).
Each carries one of two marks in its metadata:

- ``refused``: a feature switch. At its default it is accepted; any other value raises a ``ValueError``
  naming the field, the value and the missing feature (:func:`check_megatron_only_fields`).
- ``ignored``: a setting of a refused or absent feature, or a kernel choice with the same results
  (TP communication overlap's knobs, CUDA graph sizes, inference kernel choices, ...).
  Any value is accepted and has no effect; ``docs/compat.md`` lists them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = ["MegatronOnlyParallelFields", "MegatronOnlyTransformerFields", "check_megatron_only_fields"]


def _refused(default: Any, feature: str) -> Any:
    return field(default=default, metadata={"refused": feature})


def _ignored(default: Any, why: str) -> Any:
    return field(default=default, metadata={"ignored": why})


_GTP = "gradient tensor parallelism (weight shards)"
_TP_OVERLAP = "Transformer Engine's userbuffer overlap of TP communication"
_CPU_OFFLOAD = "only used with cpu_offloading"
_CUDA_GRAPH = ("a setting of Megatron-Core's CUDA graph manager (cuda_graph_impl='local' records whole layers through "
               "Inductor here: transformer.layer_cuda_graphs)")
_INFERENCE_KERNELS = "an inference kernel choice of Megatron-Core's optimized layers"
_FLEX = "the 'flex' token dispatcher (DeepEP / HybridEP / NCCL-EP)"


@dataclass
class MegatronOnlyParallelFields:
    """``ModelParallelConfig`` fields of Megatron-Core features this library does not have."""

    tensor_parallel_num_weight_shards: int | None = _refused(None, _GTP)
    gtp_weight_remat_size: int = _refused(1, _GTP)
    expert_tensor_parallel_num_weight_shards: int | None = _refused(None, _GTP)
    expert_gtp_weight_remat_size: int = _refused(1, _GTP)
    # max_seqlen_per_dp_cp_rank is a ModelParallelConfig field: datasets.data_schedule schedules with it.
    # Unmarked: hybrid context parallelism (pipeline_parallel.hybrid_cp_schedule), checked by ModelParallelConfig
    # and transformer.hybrid_cp_validation; kept here for Megatron-Core's field order.
    hybrid_context_parallel: bool = False
    # Unmarked: the combined 1F1B schedule (pipeline_parallel.combined_1f1b), checked by moe_validation.check_ep_overlap.
    overlap_moe_expert_parallel_comm: bool = False
    # Unmarked: deferred weight gradients (tensor_parallel.delayed_wgrad), checked by moe_validation.check_ep_overlap.
    delay_wgrad_compute: bool = False
    overlap_dispatch_backward_with_experts_wgrad: bool = False
    ep_overlap_early_attn_memory_release: bool = False
    # Unmarked: set from pipeline_model_parallel_layout by transformer_validation.check_pipeline_split (MTP on a
    # stage before the last); P2PCommunicator exchanges shapes when it is on.
    mtp_standalone: bool = False
    tp_comm_bulk_wgrad: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_bulk_dgrad: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_overlap_ag: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_overlap_rs: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_overlap_rs_dgrad: bool = _ignored(False, _TP_OVERLAP)
    tp_comm_split_ag: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_atomic_ag: bool = _ignored(False, _TP_OVERLAP)
    tp_comm_split_rs: bool = _ignored(True, _TP_OVERLAP)
    tp_comm_atomic_rs: bool = _ignored(False, _TP_OVERLAP)
    tp_comm_overlap_disable_qkv: bool = _ignored(False, _TP_OVERLAP)
    tp_comm_overlap_disable_fc1: bool = _ignored(False, _TP_OVERLAP)
    tp_comm_bootstrap_backend: str = _ignored("nccl", _TP_OVERLAP)
    cpu_offloading_activations: bool = _ignored(True, _CPU_OFFLOAD)
    cpu_offloading_weights: bool = _ignored(False, _CPU_OFFLOAD)
    cpu_offloading_double_buffering: bool = _ignored(False, _CPU_OFFLOAD)
    cpu_offloading_retain_pinned_cpu_buffers: bool = _ignored(False, _CPU_OFFLOAD)
    _cpu_offloading_context: Any = _ignored(None, _CPU_OFFLOAD)


@dataclass
class MegatronOnlyTransformerFields:
    """``TransformerConfig`` fields of Megatron-Core features this library does not have."""

    # Architecture variants (qk_l2_norm, no_rope_freq and mrope_section are TransformerConfig fields)
    # experimental_attention_variant and the linear_* fields are TransformerConfig fields (gated delta net layers).
    experimental_attention_variant_loss_scale_func: Callable | None = _ignored(None, "only used with "
                                                                                     "experimental_attention_variant")
    # the dsa_* fields are TransformerConfig fields (DeepSeek sparse attention, transformer.dsa_validation).
    # is_hybrid_model and the Mamba sizes (mamba_state_dim, ...) are TransformerConfig fields: ssm.MambaMixer reads them.
    mamba_training_ssm_states_dtype: Any = _ignored(None, "a kernel choice: the pure-PyTorch SSD scan computes its "
                                                          "inter-chunk states in fp32")
    use_mamba_mem_eff_path: bool = _ignored(True, "a kernel choice: the pure-PyTorch Mamba mixer has one path")
    mtp_hybrid_override_pattern: str | None = _ignored(None, "hybrid (Mamba) multi-token-prediction layers")

    # Kernels, fusions and precision
    use_transformer_engine_op_fuser: bool = _refused(False, "Transformer Engine's op fuser")
    use_te_activation_func: bool = _refused(False, "Transformer Engine's activation modules")
    fused_residual_rmsnorm: bool = _ignored(False, "a kernel choice: the residual add already runs inside the "
                                                   "RMSNorm of TransformerLayer")
    flash_attention_version: int | None = _ignored(None, "a kernel choice of Transformer Engine (SDPA picks here)")
    activation_func_fp8_input_store: bool = _refused(False, "Transformer Engine FP8")
    fp8_quantizer_factory: str | None = _refused(None, "Transformer Engine FP8")
    fp8_output_proj: bool = _refused(False, "Transformer Engine FP8")
    fp8_dot_product_attention: bool = _refused(False, "Transformer Engine FP8")
    fp8_multi_head_attention: bool = _refused(False, "Transformer Engine FP8")
    fp4: str | None = _refused(None, "FP4 training")
    fp4_recipe: str | None = _ignored("nvfp4", "only used with fp4")
    fp4_param: bool = _refused(False, "FP4 training")
    fp4_quantizer_factory: str | None = _refused(None, "FP4 training")
    # Unmarked: per-module quantization recipes, checked by quantization.layer_precision.check_quant_recipe and
    # applied by fp8.convert_to_float8.
    quant_recipe: Any = None
    use_kitchen: bool = _refused(False, "NVIDIA Kitchen quantization")
    use_kitchen_attention: bool = _refused(False, "NVIDIA Kitchen quantization")
    kitchen_attention_backend: str = _ignored("sdpa", "only used with use_kitchen_attention")
    batch_invariant_mode: bool = _refused(False, "batch-invariant kernels")
    use_grouped_gemm_for_shared_expert: bool = _refused(False, "Transformer Engine grouped GEMMs for shared experts")
    use_grouped_gemm_for_dense_mlp: bool = _refused(False, "Transformer Engine grouped GEMMs for dense MLPs")
    high_priority_a2a_comm_stream: bool = _ignored(False, "a CUDA stream priority of the combined 1F1B schedule")
    mlp_chunks_for_prefill: int = _ignored(1, "a memory choice with the same results")
    mlp_chunks_for_training: int = _ignored(1, "a memory choice with the same results")
    disable_parameter_transpose_cache: bool = _ignored(False, "a Transformer Engine cache")
    config_logger_dir: str = _ignored("", "Megatron-Core's config logger")

    # CUDA graphs
    external_cuda_graph: bool = _refused(False, "Transformer Engine's CUDA graphs (cuda_graph_impl='local' instead)")
    cuda_graph_use_single_mempool: bool = _ignored(True, _CUDA_GRAPH)
    cuda_graph_retain_backward_graph: bool = _ignored(False, _CUDA_GRAPH)
    cuda_graph_warmup_steps: int = _ignored(3, _CUDA_GRAPH)
    inference_cuda_graph_scope: Any = _ignored(None, _CUDA_GRAPH)

    # Inference kernels (this library's engine has its own settings: InferenceConfig)
    flash_decode: bool = _ignored(False, _INFERENCE_KERNELS)
    inference_rng_tracker: bool = _ignored(False, _INFERENCE_KERNELS)
    inference_sampling_seed: int = _ignored(42, _INFERENCE_KERNELS)
    symmetric_ar_type: str | None = _ignored(None, _INFERENCE_KERNELS)
    nccl_all_reduce_for_prefill: bool = _ignored(False, _INFERENCE_KERNELS)
    # Unmarked: declared and unused in Megatron-Core 0.19 as here; the layers come from
    # transformer_impl="inference_optimized" (get_gpt_decoder_layer_specs).
    use_inference_optimized_layers: bool = False
    inference_fuse_tp_communication: bool = _ignored(False, _INFERENCE_KERNELS)
    inference_disable_triton_nvls_kernels: bool = _ignored(False, _INFERENCE_KERNELS)
    inference_grouped_gemm_backend: str = _ignored("vllm", _INFERENCE_KERNELS)
    inference_moe_disable_fused_quant_kernels: bool = _ignored(False, _INFERENCE_KERNELS)
    # Unmarked: picks MoELayer's inference dispatcher ('nccl' or 'nvls', transformer.moe.token_dispatcher_inference).
    inference_moe_token_dispatcher_type: str = "nvls"

    # Mixture of experts
    moe_token_dropping: bool = _refused(False, "moe_token_dropping (unsupported in Megatron-Core too; use "
                                               "moe_expert_capacity_factor)")
    moe_enable_deepep: bool = _refused(False, "DeepEP (moe_token_dispatcher_type='flex')")
    moe_flex_dispatcher_num_sms: int | None = _refused(None, _FLEX)
    moe_deepep_num_sms: int | None = _refused(None, _FLEX)
    moe_hybridep_num_sms: int | None = _refused(None, _FLEX)
    moe_hybridep_num_blocks_permute: int | None = _refused(None, _FLEX)
    moe_hybridep_num_blocks_unpermute: int | None = _refused(None, _FLEX)
    moe_hybridep_num_sms_preprocessing: int = _refused(108, _FLEX)
    moe_hybridep_pad_uneven_dispatch_inputs: bool = _refused(False, _FLEX)
    moe_permute_fusion_into_hybridep: bool = _refused(False, _FLEX)
    moe_ncclep_static_shape: bool = _refused(False, _FLEX)
    moe_ncclep_zero_copy: bool = _refused(False, _FLEX)
    moe_expert_rank_capacity_factor: float | None = _refused(None, _FLEX)
    moe_mlp_glu_interleave_size: int | None = _refused(None, "block-interleaved GLU for fused kernels")
    moe_shared_expert_glu_interleave_size: int | None = _refused(None, "block-interleaved GLU for fused kernels")
    moe_single_grouped_weight: bool = _refused(False, "Transformer Engine's GroupedTensor (the grouped experts "
                                                      "here already hold one 3-D parameter per projection)")
    moe_single_grouped_bias: bool = _refused(False, "Transformer Engine's GroupedTensor")
    moe_pad_experts_for_cuda_graph_inference: bool = _refused(False, "padded experts for CUDA-graph inference")
    moe_paged_stash: bool = _refused(False, "the MoE paged stash")
    moe_paged_stash_page_size: int = _ignored(64, "only used with moe_paged_stash")
    moe_paged_stash_buffer_size_factor_cuda: float = _ignored(1.1, "only used with moe_paged_stash")
    moe_paged_stash_buffer_size_factor_cpu: float = _ignored(0.0, "only used with moe_paged_stash")


def check_megatron_only_fields(owner: str, config: Any) -> None:
    """Raise ``ValueError`` for a ``refused`` field of ``config`` set away from its default."""
    for f in dataclasses.fields(config):
        feature = f.metadata.get("refused")
        if feature is None:
            continue
        value = getattr(config, f.name)
        if value != f.default:
            raise ValueError(f"{owner}: {f.name} ({value!r}) must stay {f.default!r}: this library does not "
                             f"provide {feature}")
