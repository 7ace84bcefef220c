"""The model features and parallel layouts of the parallel-training equivalence audit.

A :class:`Feature` is a tiny model (GPT with the local spec, or the hybrid Mamba model) described by
``TransformerConfig`` fields and spec flags; :func:`model_provider` is its ``model_provider_func`` for
``get_model`` (pipeline chunks included). A :class:`Layout` is one way of spreading the ranks (TP, TP+SP, CP,
PP, DP with the distributed optimizer, EP; ``LAYOUTS`` holds the 2-rank ones) plus the loss normalisation it trains
with, and optionally the paths it takes (virtual pipeline, pipeline layout strings, overlapped DDP, fused weight
gradients, the precision-aware optimizer) and its :class:`TrainOptions` (the optimizer settings and batch size that
the one-process reference shares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn.functional as F

from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.experimental_attention_variant_module_specs import (
    get_transformer_block_with_experimental_attention_variant_spec,
)
from megatron_core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_mtp_block_spec
from megatron_core.models.hybrid import HybridModel
from megatron_core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec
from megatron_core.transformer import MLATransformerConfig, TransformerConfig

VOCAB, SEQ, MBS, MAX_SEQ = 64, 8, 2, 16
HYBRID_PATTERN = "M*M-"

_LLAMA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=64,
              normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False)
_GPT2 = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, normalization="LayerNorm",
             add_bias_linear=True)
_MLA = dict(_LLAMA, q_lora_rank=16, kv_lora_rank=12, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8,
            rope_type="rope", layernorm_epsilon=1e-6)
_MOE = dict(_LLAMA, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=16)
_HYBRID = dict(num_layers=4, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
               normalization="RMSNorm", add_bias_linear=False, mamba_state_dim=8, mamba_head_dim=8,
               mamba_num_groups=2, layernorm_epsilon=1e-5)
_GDN = dict(linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=4,
            linear_num_value_heads=8)
_DSA = dict(_MLA, qk_layernorm=True, experimental_attention_variant="dsa", dsa_indexer_n_heads=4,
            dsa_indexer_head_dim=16, dsa_indexer_topk=5, dsa_indexer_loss_coeff=0.1, cp_comm_type="all_gather")
_COMMON = dict(hidden_dropout=0.0, attention_dropout=0.0, use_cpu_initialization=True)


@dataclass(frozen=True)
class Feature:
    """One model variant: config fields, the config class, and the model's constructor arguments."""

    name: str
    config: dict[str, Any]
    mla: bool = False
    hybrid: str | None = None  # the hybrid model's layer pattern
    model: dict[str, Any] = field(default_factory=dict)

    def make_config(self, **parallel: Any) -> TransformerConfig:
        """The model's config with the layout's fields (``parallel``) added; they override the feature's."""
        cls = MLATransformerConfig if self.mla else TransformerConfig
        return cls(**{**_COMMON, **self.config, **parallel})


def _rope(**model: Any) -> dict[str, Any]:
    return dict(position_embedding_type="rope", **model)


FEATURES: dict[str, Feature] = {f.name: f for f in (
    Feature("gpt", _LLAMA, model=_rope()),
    Feature("qk_layernorm", dict(_LLAMA, qk_layernorm=True), model=_rope()),
    Feature("qk_l2_norm", dict(_LLAMA, qk_l2_norm=True), model=_rope()),
    Feature("tied", _LLAMA, model=_rope(share_embeddings_and_output_weights=True)),
    Feature("learned_absolute", _LLAMA, model=dict(position_embedding_type="learned_absolute")),
    Feature("gpt2", _GPT2, model=dict(position_embedding_type="learned_absolute",
                                      share_embeddings_and_output_weights=True)),
    Feature("output_gate", dict(_LLAMA, attention_output_gate=True), model=_rope()),
    Feature("sinks", dict(_LLAMA, softmax_type="learnable"), model=_rope()),
    Feature("mla", dict(_MLA, qk_layernorm=True), mla=True, model=_rope()),
    Feature("mla_no_q_lora", dict(_MLA, q_lora_rank=None, qk_layernorm=True), mla=True, model=_rope()),
    Feature("moe_grouped", dict(_MOE, moe_grouped_gemm=True, moe_aux_loss_coeff=0.01), model=_rope()),
    Feature("moe_sequential", dict(_MOE, moe_aux_loss_coeff=0.01, moe_z_loss_coeff=1e-3), model=_rope()),
    Feature("moe_shared_bias", dict(_MOE, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                                    moe_router_bias_update_rate=0.01, moe_shared_expert_intermediate_size=16,
                                    moe_shared_expert_gate=True, moe_router_load_balancing_type="seq_aux_loss",
                                    moe_aux_loss_coeff=0.02), model=_rope()),
    Feature("moe_latent", dict(_MOE, moe_latent_size=8, moe_aux_loss_coeff=0.01), model=_rope()),
    Feature("moe_quantile", dict(_MOE, moe_router_load_balancing_type="quantile_balancing",
                                 moe_router_quantile_balancing_ema=0.5), model=_rope()),
    Feature("dsa", _DSA, mla=True, model=_rope()),
    Feature("gdn", dict(_LLAMA, experimental_attention_variant="gated_delta_net", linear_attention_freq=2, **_GDN),
            model=_rope()),
    Feature("mtp", dict(_LLAMA, mtp_num_layers=1), model=_rope()),
    Feature("hybrid", _HYBRID, hybrid=HYBRID_PATTERN, model=_rope()),
    Feature("hybrid_gdn", dict(_HYBRID, **_GDN), hybrid="G*G-", model=_rope()),
)}


def _staged(pattern: str, config: TransformerConfig) -> str:
    """The hybrid ``pattern`` cut evenly into one ``|``-separated segment per virtual pipeline stage (the hybrid
    model takes its virtual stages only from separators, as in Megatron-Core); unchanged without a virtual
    pipeline."""
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        return pattern
    stages = vp * config.pipeline_model_parallel_size
    if len(pattern) % stages:
        raise ValueError(f"hybrid pattern {pattern!r} ({len(pattern)} layers) cannot be cut into {stages} stages")
    size = len(pattern) // stages
    return "|".join(pattern[i:i + size] for i in range(0, len(pattern), size))


def model_provider(feature: Feature, pre_process: bool = True, post_process: bool = True,
                   vp_stage: int | None = None, config: TransformerConfig | None = None,
                   pg_collection: Any = None) -> GPTModel | HybridModel:
    """``feature``'s model (or this pipeline stage's chunk of it) for ``get_model``."""
    if feature.hybrid:
        return HybridModel(config, hybrid_stack_spec, VOCAB, MAX_SEQ,
                           hybrid_layer_pattern=_staged(feature.hybrid, config), pre_process=pre_process,
                           post_process=post_process, vp_stage=vp_stage, pg_collection=pg_collection,
                           **feature.model)
    if config.experimental_attention_variant is not None:
        block = get_transformer_block_with_experimental_attention_variant_spec(config, vp_stage=vp_stage)
    else:
        block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, qk_l2_norm=config.qk_l2_norm,
                                          vp_stage=vp_stage)
    mtp = get_gpt_mtp_block_spec(config, block, False, vp_stage=vp_stage) if config.mtp_num_layers else None
    return GPTModel(config, block, VOCAB, MAX_SEQ, pre_process=pre_process, post_process=post_process,
                    vp_stage=vp_stage, pg_collection=pg_collection, mtp_block_spec=mtp, **feature.model)


@dataclass(frozen=True)
class TrainOptions:
    """What a run computes, shared by a layout and its one-process reference: the optimizer (``"adam"`` or
    ``"sgd"``), its learning rate (``None``: the runner's), ``clip_grad``, ``weight_decay`` and which parameters
    skip it (``wd_rule``: ``"standard"`` biases and 1-D parameters; ``"qk_layernorm"`` the same but the q/k
    layernorms decay (``apply_wd_to_qk_layernorm``); ``"overrides"`` the standard rule plus ``config_overrides``
    that exempt the embedding and output weights and double the dense ``linear_fc2`` weights' decay), the
    micro-batches of a step over all data-parallel ranks, and a decoder depth replacing the feature's."""

    optimizer: str = "adam"
    lr: float | None = None
    clip_grad: float = 0.5
    weight_decay: float = 0.01
    wd_rule: str = "standard"
    global_microbatches: int = 4
    num_layers: int | None = None


@dataclass(frozen=True)
class Layout:
    """How the ranks split the model: TP (``sp``), CP, PP (``vp`` virtual stages, or an explicit
    ``pipeline_layout`` string, ``account_embedding`` / ``account_loss`` in the split), EP (``etp``: the experts'
    TP size; ``None``: TP's); the rest is DP. ``per_token`` picks the loss normalisation: Megatron's
    ``calculate_per_token_loss`` (sum over tokens / global token count) or the default mean of per-microbatch token
    means. The path options (DDP's ``overlap_grad_reduce`` / ``overlap_param_gather`` with ``bucket_size``,
    ``grad_accum_fusion``, ``defer_embedding_wgrad``, ``precision_aware`` optimizer, ``align_sync``: the schedules
    launch each chunk's gradient reduction and parameter gather (Megatron-LM's ``align_grad_reduce`` /
    ``align_param_gather``), ``optimizer_instances`` distributed-optimizer instances, and any other
    ``TransformerConfig`` / ``DistributedDataParallelConfig`` fields as ``(name, value)`` pairs in
    ``config_extra`` / ``ddp_extra``) change how, not what, is computed; ``train`` is what is computed."""

    name: str
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    sp: bool = False
    distributed_optimizer: bool = False
    per_token: bool = False
    vp: int | None = None
    pipeline_layout: str | None = None
    account_embedding: bool = False
    account_loss: bool = False
    etp: int | None = None
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    bucket_size: int | None = None
    grad_accum_fusion: bool = False
    defer_embedding_wgrad: bool = False
    precision_aware: bool = False
    align_sync: bool = False
    optimizer_instances: int = 1
    config_extra: tuple[tuple[str, Any], ...] = ()
    ddp_extra: tuple[tuple[str, Any], ...] = ()
    train: TrainOptions = field(default_factory=TrainOptions)

    def dp(self, world: int) -> int:
        """The data-parallel size on ``world`` ranks."""
        return world // (self.tp * self.pp * self.cp)


ONE_PROCESS = {mode: Layout(f"one_process_{mode}", per_token=mode == "per_token") for mode in ("mean", "per_token")}


def one_process(layout: Layout) -> Layout:
    """The one-process run that ``layout`` must reproduce: its loss normalisation and :class:`TrainOptions`."""
    mode = "per_token" if layout.per_token else "mean"
    return Layout(f"one_process_{mode}", per_token=layout.per_token, train=layout.train)


LAYOUTS: dict[str, Layout] = {layout.name: layout for layout in (
    Layout("tp2", tp=2, per_token=True),
    Layout("tp2_sp", tp=2, sp=True),
    Layout("cp2", cp=2, per_token=True),
    Layout("pp2", pp=2),
    Layout("dp2_distopt", distributed_optimizer=True),
    Layout("ep2", ep=2, per_token=True),
)}
