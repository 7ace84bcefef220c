"""``TransformerConfig``: the shape, numerics, recompute and MoE settings of a transformer.

Mirrors Megatron-Core's dataclass (field names and defaults); the fields of features this library lacks
come from :mod:`megatron_core.megatron_only_fields` (accepted at their defaults). ``__post_init__`` derives
defaults (``ffn_hidden_size = 4 * hidden_size``, ``kv_channels = hidden_size / num_attention_heads``,
``num_query_groups = num_attention_heads``, init methods from ``init_method_std`` with the output projections
scaled by ``1 / sqrt(2 * num_layers)``) and validates: each rule is one small function of
:mod:`.transformer_validation`, and each error names the fields, their values and the rule.
``MLATransformerConfig`` adds the multi-latent attention fields (validated in
:mod:`megatron_core.transformer.mla_validation`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import init_method_normal, scaled_init_method_normal
from megatron_core.activations import quick_gelu as quick_gelu
from megatron_core.config_rules import TRANSFORMER_RULES as _TRANSFORMER_RULES
from megatron_core.config_rules import apply_rules as _apply_rules
from megatron_core.megatron_only_fields import MegatronOnlyTransformerFields as _MegatronOnlyTransformerFields
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.quantization.layer_precision import check_quant_recipe
from megatron_core.transformer import transformer_validation as _checks
from megatron_core.transformer.activation_offload_validation import check_fine_grained_activation_offloading
from megatron_core.transformer.enums import AttnBackend
from megatron_core.transformer.hybrid_cp_validation import check_hybrid_context_parallel
from megatron_core.transformer.linear_attention_validation import check_experimental_attention_variant
from megatron_core.transformer.mla_validation import check_mla_config
from megatron_core.transformer.moe_validation import (
    apply_deprecated_moe_aliases,
    check_ep_overlap,
    check_moe_config,
)
from megatron_core.transformer.mup_config import apply_mup_config, mup_init_methods
from megatron_core.transformer.pipeline_layout import PipelineParallelLayerLayout
from megatron_core.transformer.pipeline_layout import chunk_layer_counts as chunk_layer_counts
from megatron_core.transformer.rope_options import check_rope_options
from megatron_core.transformer.rope_utils import yarn_concentration_factor as yarn_concentration_factor
from megatron_core.transformer.transformer_validation import QUICK_GELUS as QUICK_GELUS
from megatron_core.transformer.transformer_validation import RECOMPUTE_MODULES as RECOMPUTE_MODULES
from megatron_core.transformer.transformer_validation import SOFTMAX_TYPES as SOFTMAX_TYPES


@dataclass
class TransformerConfig(ModelParallelConfig, _MegatronOnlyTransformerFields):
    """Configuration of a transformer (``megatron.core.transformer.TransformerConfig``)."""

    # Shape
    num_layers: int = 0
    hidden_size: int = 0
    num_attention_heads: int = 0
    num_query_groups: int | None = None
    ffn_hidden_size: int | None = None
    kv_channels: int | None = None
    mtp_num_layers: int | None = None
    mtp_loss_scaling_factor: float | None = 0.1  # weight of the MTP losses (averaged over the depths)
    mtp_use_repeated_layer: bool = False  # one MTP layer applied mtp_num_layers times
    mtp_detach_heads: bool = False  # MTP trains its own layers only (decoder, embedding and head detached)

    # Pipeline split
    num_layers_in_first_pipeline_stage: int | None = None
    num_layers_in_last_pipeline_stage: int | None = None
    pipeline_model_parallel_layout: str | list | PipelineParallelLayerLayout | None = None
    account_for_embedding_in_pipeline_split: bool = False
    account_for_loss_in_pipeline_split: bool = False

    # Dropout, residual, normalization
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    fp32_residual_connection: bool = False
    apply_residual_connection_post_layernorm: bool = False
    layernorm_epsilon: float = 1e-5
    layernorm_zero_centered_gamma: bool = False
    normalization: str = "LayerNorm"
    qk_layernorm: bool = False
    qk_l2_norm: bool = False  # Llama 4: each query / key head scaled to unit RMS (L2Norm) before RoPE
    # QK-clip (MuonClip): optimizer.qk_clip.clip_qk rescales each head's query/key weights by
    # eta = min(qk_clip_threshold / max logit, 1): queries by eta ** qk_clip_alpha, keys by eta ** (1 - alpha)
    qk_clip: bool = False
    qk_clip_alpha: float = 0.5
    qk_clip_threshold: float = 100
    log_max_attention_logit: bool = False  # record each head's largest logit (qk_clip records it too)
    persist_layer_norm: bool = False
    memory_efficient_layer_norm: bool = False

    # MLP and activation
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    gated_linear_unit: bool = False
    activation_func: Callable[[torch.Tensor], torch.Tensor] = F.gelu
    glu_linear_offset: float = 0.0  # gated MLPs: act(gate) * (up + glu_linear_offset)
    activation_func_clamp_value: float | None = None  # gated MLPs: gate <= v, -v <= up <= v before the GLU
    bias_activation_fusion: bool = False
    bias_dropout_fusion: bool = False

    # Attention
    attention_backend: AttnBackend = AttnBackend.auto
    softmax_scale: float | None = None
    softmax_type: str = "vanilla"  # 'off-by-one' / 'learnable': a per-head sink logit joins every softmax
    window_size: tuple[int, int] | None = None
    window_attn_skip_freq: int | list[int] | None = None
    cp_comm_type: str | list[str] | None = None
    apply_query_key_layer_scaling: bool = False
    attention_softmax_in_fp32: bool = True
    masked_softmax_fusion: bool = False
    rotary_interleaved: bool = False
    no_rope_freq: int | list[int] | None = None  # N: every N-th layer without RoPE; or 0/1 per layer (1: none)
    mrope_section: list[int] | None = None  # multimodal RoPE's temporal / height / width frequency sections
    apply_rope_fusion: bool = False
    fused_single_qkv_rope: bool = False
    multi_latent_attention: bool = False
    attention_output_gate: bool = False  # linear_qkv also gives a per-head gate; output *= sigmoid(gate)

    # YaRN rotary embeddings (GPTModel position_embedding_type='yarn'; Megatron-Core reads them as attributes)
    yarn_rotary_scaling_factor: float = 1.0
    yarn_original_max_position_embeddings: int = 4096
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    yarn_mscale: float | None = 1.0
    yarn_mscale_all_dim: float | None = 0.0
    yarn_correction_range_round_to_int: bool = True

    # Initialization
    init_method: Callable[[torch.Tensor], Any] | None = None
    output_layer_init_method: Callable[[torch.Tensor], Any] | None = None
    init_method_std: float = 0.02
    embedding_init_method: Callable[[torch.Tensor], Any] | None = None
    embedding_init_method_std: float | None = None
    init_model_with_meta_device: bool = False

    # muP (maximal update parametrisation): derived and validated in transformer.mup_config
    use_mup: bool = False
    mup_width_mult: float = 1.0  # set to hidden_size / mup_base_hidden_size when use_mup
    mup_base_hidden_size: int | None = None  # None: hidden_size (width multiplier 1)
    mup_embedding_mult: float = 1.0  # the embedding output is multiplied by it
    mup_output_mult: float = 1.0  # the logits are multiplied by it (left at 1.0, use_mup makes it 1 / width mult)
    mup_base_head_dim: float | None = None  # softmax_scale = sqrt(it, or 1) / kv_channels ** mup_attn_scale_power
    mup_attn_scale_power: float = 1.0

    # Hybrid (Mamba) models: read by ssm.MambaMixer; is_hybrid_model halves the output-layer init's depth scaling
    is_hybrid_model: bool = False
    mamba_state_dim: int = 128
    mamba_head_dim: int = 64
    mamba_num_groups: int = 8
    mamba_num_heads: int | None = None  # None: expand * hidden_size // mamba_head_dim

    # Gated delta net (linear attention) layers: ssm.gated_delta_net reads the sizes; checked in
    # linear_attention_validation. "dsa" is DeepSeek sparse attention (the dsa_* fields below).
    experimental_attention_variant: str | None = None  # None, "gated_delta_net" or "dsa"
    linear_attention_freq: int | list[int] | None = None  # N: every N-th layer is softmax attention; or 0/1 per layer
    linear_conv_kernel_dim: int | None = 4
    linear_key_head_dim: int | None = 128
    linear_value_head_dim: int | None = 128
    linear_num_key_heads: int | None = 16
    linear_num_value_heads: int | None = 32

    # DeepSeek sparse attention (experimental_attention_variant="dsa"): read by
    # transformer.experimental_attention_variant; checked in dsa_validation
    dsa_indexer_n_heads: int | None = None
    dsa_indexer_head_dim: int | None = None
    dsa_indexer_topk: int | None = None  # keys each query attends to
    dsa_indexer_topk_freq: int = 1  # > 1: only every N-th layer computes top-k, the others reuse it
    dsa_indexer_skip_topk_offset: int = 0
    dsa_indexer_loss_coeff: float | None = None  # the indexer's KL loss weight (None or 0: no indexer loss)
    dsa_indexer_use_sparse_loss: bool = False  # the KL loss over the selected keys only
    dsa_kernel_backend: str = "none"  # only "none" (PyTorch); "tilelang" / "cudnn" are refused
    dsa_indexer_rope_interleaved: bool = False
    dsa_indexer_rotate_activation: bool = True  # Hadamard rotation of indexer q and k
    dsa_indexer_scoring_relu: bool = True
    dsa_indexer_k_norm_epsilon: float | None = None  # None: layernorm_epsilon
    dsa_indexer_k_norm_fp32: bool = False

    # bf16=True: turn off cuBLAS's reduced-precision reduction in bf16 GEMMs (a process-wide torch setting)
    disable_bf16_reduced_precision_matmul: bool = False
    # MoE experts with an ungated squared ReLU: weight it by the routing probabilities in one function that saves
    # only its inputs (fusions.fused_weighted_squared_relu)
    use_fused_weighted_squared_relu: bool = False

    # Activation recompute
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None
    distribute_saved_activations: bool | None = None
    recompute_modules: list[str] | None = None

    # Fine-grained activation offloading (pipeline_parallel.fine_grained_activation_offload): the activations
    # saved inside each module named in offload_modules move to host memory in the forward and come back before
    # their backward; checked in activation_offload_validation
    fine_grained_activation_offloading: bool = False
    offload_modules: list[str] | None = field(default_factory=list)  # of activation_offload_validation.OFFLOAD_MODULES
    min_offloaded_tensor_size: int = 1024 * 1024  # in elements: smaller saved tensors stay on the device
    delay_offload_until_cuda_graph: bool = False  # MoE commits wait for a CUDA-graph replay (none here: no effect)
    delta_offload_bytes_across_pp_ranks: int = 0  # pipeline rank r keeps r times this many bytes on the device
    activation_offload_fraction: float = 1.0  # of each chunk's offloadable groups, the first fraction moves
    fine_grained_offloading_max_inflight_offloads: int | None = None  # per group name; None: no cap

    # Mixture of experts (validated in moe_validation.check_moe_config)
    num_moe_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_layer_freq: int | list[int] = 1
    moe_router_topk: int = 2
    moe_router_load_balancing_type: str | list[str] = "aux_loss"
    moe_aux_loss_coeff: float | list[float] = 0.0
    moe_z_loss_coeff: float | None = None
    moe_input_jitter_eps: float | None = None
    moe_router_score_function: str = "softmax"
    moe_router_pre_softmax: bool = False
    moe_router_topk_scaling_factor: float | None = None
    moe_router_num_groups: int | None = None
    moe_router_group_topk: int | None = None
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # quantile balancing: qb_beta <- ema * qb_beta + (1 - ema) * the global batch's quantile (0: no memory)
    moe_router_quantile_balancing_ema: float = 0.0
    moe_router_dtype: str | None = None
    moe_router_fusion: bool = False
    moe_token_dispatcher_type: str = "allgather"
    moe_grouped_gemm: bool = False
    moe_permute_fusion: bool = False
    moe_expert_capacity_factor: float | None = None
    moe_pad_expert_input_to_capacity: bool = False
    moe_token_drop_policy: str = "probs"
    moe_shared_expert_intermediate_size: int | None = None
    moe_shared_expert_overlap: bool = False
    moe_shared_expert_gate: bool = False
    moe_apply_probs_on_input: bool = False
    moe_per_layer_logging: bool = False
    # Deprecated aliases, mapped by moe_validation.apply_deprecated_moe_aliases as Megatron-Core does
    moe_layer_recompute: bool = False
    moe_router_topk_limited_devices: int | None = None
    moe_router_padding_for_fp8: bool | None = False
    # Benchmark and kernel-layout aids (moe/routing_overrides.py)
    moe_router_force_load_balancing: bool = False
    moe_router_force_biased: float | None = None
    moe_router_padding_for_quantization: bool | None = False
    moe_enable_routing_replay: bool = False  # record / replay each router's top-k (moe.router_replay)
    moe_latent_size: int | None = None  # routed experts work in this width (moe.latent_projection)
    # The flex dispatcher's backend (only its choice is checked: the flex dispatcher itself is refused)
    moe_flex_dispatcher_backend: str = "deepep"

    # Loss and misc
    calculate_per_token_loss: bool = False
    fp8: str | None = None
    fp8_recipe: str | None = "delayed"
    fp8_param: bool = False
    fp8_margin: int = 0
    fp8_interval: int = 1
    fp8_amax_history_len: int = 1
    fp8_amax_compute_algo: str = "most_recent"
    fp8_wgrad: bool = True
    tp_only_amax_red: bool = False
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1
    transformer_impl: str = "local"

    # CUDA graphs (transformer.layer_cuda_graphs; checked by transformer_validation.check_cuda_graphs)
    enable_cuda_graph: bool = False  # deprecated: True means cuda_graph_impl="local"
    cuda_graph_impl: str = "none"  # "none", "local" (whole layers through Inductor) or "full_iteration"
    cuda_graph_modules: Any = "full"  # "full" or empty (whole layers) with "local"
    cuda_graph_scope: Any = None  # deprecated name of cuda_graph_modules
    clone_scatter_output_in_embedding: bool = True
    test_mode: bool = False

    # Heterogeneous layers (transformer.heterogeneous): TransformerBlock builds layer n with
    # get_config_for_layer(n); both flags save each layer under its own checkpoint key.
    heterogeneous_block_specs: bool = False
    hetereogenous_dist_checkpoint: bool = False  # sic: Megatron-Core's spelling

    def __post_init__(self) -> None:
        """Validate (errors name fields, values and rule) and fill derived defaults."""
        super().__post_init__()
        _apply_rules("TransformerConfig", self, _TRANSFORMER_RULES)
        _checks.check_shape(self)
        _derive_shape_defaults(self)
        apply_deprecated_moe_aliases(self)
        _checks.check_parallel_shapes(self)
        _checks.check_normalization_and_activation(self)
        _check_config_class(self)
        _checks.check_fp8_and_transformer_impl(self)
        check_quant_recipe(self)
        _checks.check_gpt_oss_options(self)
        _checks.check_qk_clip(self)
        _checks.check_attention_output_gate(self)
        _checks.check_recompute(self)
        _checks.check_cuda_graphs(self)
        check_moe_config(self)
        check_ep_overlap(self)
        check_fine_grained_activation_offloading(self)
        _checks.check_pipeline_split(self)
        _checks.check_mtp(self)
        check_experimental_attention_variant(self)
        check_rope_options(self)
        check_hybrid_context_parallel(self)
        apply_mup_config(self)
        if self.bf16 and self.disable_bf16_reduced_precision_matmul:
            # Process-wide, as in Megatron-Core: cuBLAS bf16 GEMMs then accumulate without reduced-precision steps.
            torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if self.apply_query_key_layer_scaling:
            self.attention_softmax_in_fp32 = True
        if self.fp32_residual_connection and self.pipeline_model_parallel_size > 1:
            self.pipeline_dtype = torch.float32
        _derive_init_methods(self)


def _check_config_class(cfg: TransformerConfig) -> None:
    """MLA's fields live on ``MLATransformerConfig``: a plain config cannot turn it on."""
    if cfg.multi_latent_attention and not isinstance(cfg, MLATransformerConfig):
        raise ValueError(
            "multi_latent_attention=True needs an MLATransformerConfig (its q_lora_rank, kv_lora_rank, qk_head_dim, "
            "qk_pos_emb_head_dim, v_head_dim and rope fields), not a plain TransformerConfig"
        )


def _derive_shape_defaults(cfg: TransformerConfig) -> None:
    if cfg.ffn_hidden_size is None:
        cfg.ffn_hidden_size = 4 * cfg.hidden_size
    if cfg.kv_channels is None:
        cfg.kv_channels = cfg.hidden_size // cfg.num_attention_heads
    if cfg.num_query_groups is None:
        cfg.num_query_groups = cfg.num_attention_heads
    if cfg.recompute_modules is None:
        cfg.recompute_modules = ["core_attn"]


def _derive_init_methods(cfg: TransformerConfig) -> None:
    if cfg.use_mup:
        mup_init_methods(cfg)
        return
    if cfg.init_method is None:
        cfg.init_method = init_method_normal(cfg.init_method_std)
    if cfg.output_layer_init_method is None:
        cfg.output_layer_init_method = scaled_init_method_normal(
            cfg.init_method_std, cfg.num_layers, multiplier=1.0 if cfg.is_hybrid_model else 2.0)
    if cfg.embedding_init_method is None:
        std = cfg.embedding_init_method_std if cfg.embedding_init_method_std is not None else cfg.init_method_std
        cfg.embedding_init_method = init_method_normal(std)


@dataclass
class MLATransformerConfig(TransformerConfig):
    """Configuration of a multi-latent attention (DeepSeek-V2/V3) transformer (Megatron-Core's
    ``MLATransformerConfig``).

    Queries are rebuilt from a rank-``q_lora_rank`` latent (or projected directly when it is None), keys and
    values from one shared rank-``kv_lora_rank`` latent; every head has ``qk_head_dim`` channels without
    position and ``qk_pos_emb_head_dim`` rotated ones (the rotated key part is shared by all heads), and
    ``v_head_dim`` value channels. MLA builds its own rotary embedding from the ``rope_type`` fields below
    (``GPTModel`` then builds none for ``position_embedding_type='rope'``).
    """

    multi_latent_attention: bool = True
    q_lora_rank: int | None = 512
    kv_lora_rank: int = 512
    qk_head_dim: int = 128  # a query/key head's channels without position (the head has qk_pos_emb_head_dim more)
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    normalization: str = "RMSNorm"
    rope_type: str = "yarn"  # 'rope' or 'yarn'
    rotary_base: float = 10000
    rotary_percent: float = 1.0  # used by 'rope' only
    rotary_scaling_factor: float = 40  # YaRN's context stretch; also sets the softmax mscale with mscale_all_dim
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32
    beta_slow: float = 1
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    cache_mla_latents: bool = False  # refused (needs the absorbed FlashMLA decode)
    mla_down_proj_fusion: bool = False  # a Transformer Engine spec option; the local spec has no fused form

    def __post_init__(self) -> None:
        """Validate the transformer fields, then the MLA ones (``mla_validation``)."""
        super().__post_init__()
        check_mla_config(self)
