"""The GPT model of ``pretrain_gpt.py`` from the flags: its config, its ``model_provider`` for ``get_model``."""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.nn.functional as F

from gpt_training.fp8 import convert_model_to_fp8, fp8_config_fields
from megatron_core.device import get_current_device
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.distributed.static_main_grads import local_cuda_graphs_enabled
from megatron_core.models.gpt import GPTModel
from megatron_core.models.gpt.gpt_layer_specs import (
    get_gpt_decoder_block_spec,
    get_gpt_layer_local_spec,
    get_gpt_mtp_block_spec,
)
from megatron_core.training.model_builder import get_model
from megatron_core.transformer import MLATransformerConfig, TransformerConfig


def transformer_config_from_args(args: argparse.Namespace) -> TransformerConfig:
    """The TransformerConfig the flags describe."""
    params_dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32
    config_class, mla = (MLATransformerConfig, _mla_config(args)) if getattr(args, "multi_latent_attention", False) \
        else (TransformerConfig, {})
    return config_class(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups,
        ffn_hidden_size=args.ffn_hidden_size,
        kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout,
        attention_dropout=args.attention_dropout,
        normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon,
        gated_linear_unit=args.swiglu,
        activation_func=F.silu if args.swiglu else F.gelu,
        bias_activation_fusion=bool(args.swiglu and getattr(args, "bias_swiglu_fusion", True)),
        cross_entropy_loss_fusion=getattr(args, "cross_entropy_loss_fusion", False),
        cross_entropy_fusion_impl=getattr(args, "cross_entropy_fusion_impl", "native"),
        # MLA's fused RoPE exists for YaRN only (Megatron-Core's rule): plain RoPE runs unfused there.
        apply_rope_fusion=getattr(args, "apply_rope_fusion", True) and not (mla and args.rope_type == "rope"),
        add_bias_linear=not args.disable_bias_linear,
        init_method_std=args.init_method_std,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        overlap_p2p_comm=getattr(args, "overlap_p2p_comm", False),
        batch_p2p_comm=not getattr(args, "overlap_p2p_comm", False),
        account_for_embedding_in_pipeline_split=args.account_for_embedding_in_pipeline_split,
        account_for_loss_in_pipeline_split=args.account_for_loss_in_pipeline_split,
        sequence_parallel=args.sequence_parallel,
        context_parallel_size=args.context_parallel_size,
        cp_comm_type=args.cp_comm_type,
        gradient_accumulation_fusion=getattr(args, "gradient_accumulation_fusion", False),
        bf16=args.bf16,
        fp16=args.fp16,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype if args.pipeline_model_parallel_size > 1 else None,
        recompute_granularity=args.recompute_granularity,
        recompute_method=args.recompute_method,
        recompute_num_layers=args.recompute_num_layers,
        recompute_modules=getattr(args, "recompute_modules", None),
        cuda_graph_impl=getattr(args, "cuda_graph_impl", "none"),
        **fp8_config_fields(args),
        use_cpu_initialization=args.use_cpu_initialization,
        mtp_num_layers=getattr(args, "mtp_num_layers", None),
        mtp_loss_scaling_factor=getattr(args, "mtp_loss_scaling_factor", 0.1),
        qk_layernorm=getattr(args, "qk_layernorm", False),
        **_moe_config(args),
        **mla,
    )


def _mla_config(args: argparse.Namespace) -> dict:
    """The MLATransformerConfig fields of the flags (Megatron-LM's names)."""
    fields = dict(q_lora_rank=args.q_lora_rank, kv_lora_rank=args.kv_lora_rank, qk_head_dim=args.qk_head_dim,
                  qk_pos_emb_head_dim=args.qk_pos_emb_head_dim, v_head_dim=args.v_head_dim,
                  rotary_scaling_factor=args.rotary_scaling_factor, mscale=args.mscale,
                  mscale_all_dim=args.mscale_all_dim, rotary_base=args.rotary_base or 10000,
                  rotary_percent=args.rotary_percent, original_max_position_embeddings=args.max_position_embeddings)
    if args.rope_type is not None:
        fields["rope_type"] = args.rope_type
    return fields


def _moe_config(args: argparse.Namespace) -> dict:
    """The MoE fields of the TransformerConfig (none for a dense model)."""
    if args.num_experts is None:
        return {}
    return dict(
        num_moe_experts=args.num_experts, expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size, moe_ffn_hidden_size=args.moe_ffn_hidden_size,
        moe_layer_freq=args.moe_layer_freq, moe_router_topk=args.moe_router_topk,
        moe_router_score_function=args.moe_router_score_function, moe_router_pre_softmax=args.moe_router_pre_softmax,
        moe_router_topk_scaling_factor=args.moe_router_topk_scaling_factor,
        moe_router_num_groups=args.moe_router_num_groups, moe_router_group_topk=args.moe_router_group_topk,
        moe_router_enable_expert_bias=args.moe_router_enable_expert_bias,
        moe_router_bias_update_rate=args.moe_router_bias_update_rate, moe_router_dtype=args.moe_router_dtype,
        moe_router_load_balancing_type=args.moe_router_load_balancing_type, moe_aux_loss_coeff=args.moe_aux_loss_coeff,
        moe_z_loss_coeff=args.moe_z_loss_coeff, moe_input_jitter_eps=args.moe_input_jitter_eps,
        moe_token_dispatcher_type=args.moe_token_dispatcher_type, moe_grouped_gemm=args.moe_grouped_gemm,
        moe_expert_capacity_factor=args.moe_expert_capacity_factor,
        moe_pad_expert_input_to_capacity=args.moe_pad_expert_input_to_capacity,
        moe_token_drop_policy=args.moe_token_drop_policy,
        moe_shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=args.moe_shared_expert_gate, moe_per_layer_logging=args.moe_per_layer_logging,
        moe_router_force_load_balancing=getattr(args, "moe_router_force_load_balancing", False),
    )


def ddp_config_from_args(args: argparse.Namespace) -> DistributedDataParallelConfig:
    """The DistributedDataParallelConfig the flags describe."""
    return DistributedDataParallelConfig(
        grad_reduce_in_fp32=args.bf16 or args.fp16,
        overlap_grad_reduce=args.overlap_grad_reduce,
        overlap_param_gather=args.overlap_param_gather,
        use_distributed_optimizer=args.use_distributed_optimizer,
        overwrite_main_grad_on_first_wgrad=bool(getattr(args, "overwrite_main_grad_on_first_wgrad", False)),
        fp8_param_gather=bool(getattr(args, "fp8_param_gather", False)),
    )


def model_provider(args: argparse.Namespace, vocab_size: int, models: list[torch.nn.Module] | None = None,
                   pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None,
                   config: TransformerConfig | None = None, pg_collection=None) -> torch.nn.Module:
    """One GPTModel chunk for ``get_model`` (``models``: chunks already built, e.g. from a Hugging Face model)."""
    if models is not None:
        model = models[vp_stage or 0]
    else:
        # MoE models get one spec per layer (dense and MoE layers interleaved by --moe-layer-freq).
        spec = (get_gpt_decoder_block_spec(config, use_transformer_engine=False, vp_stage=vp_stage)
                if config.num_moe_experts is not None or config.multi_latent_attention
                else get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm))
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=args.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
            position_embedding_type=args.position_embedding_type,
            rotary_percent=args.rotary_percent,
            rotary_base=args.rotary_base,
            vp_stage=vp_stage,
            mtp_block_spec=(get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
                            if config.mtp_num_layers else None),
        )
    if model.config.fp8:  # before DDP (FP8 parameters live in its buffers) and before compiling
        try:
            convert_model_to_fp8(model, get_current_device())
        except ValueError as error:  # a layer shape FP8 GEMMs cannot take: say which flag asked for them
            raise ValueError(f"--fp8-format {args.fp8} --fp8-recipe {args.fp8_recipe}: {error}") from error
    if args.compile:
        compile_layers_and_loss(model)
    return model


def build_model(args: argparse.Namespace, config: TransformerConfig, vocab_size: int,
                models: list[torch.nn.Module] | None = None) -> list[torch.nn.Module]:
    """One DDP-wrapped (and, with --bf16/--fp16, Float16Module-wrapped) GPTModel per virtual stage of this rank;
    with --use-torch-fsdp2 one FSDP2-sharded GPTModel."""
    return get_model(partial(model_provider, args, vocab_size, models), config=config,
                     ddp_config=ddp_config_from_args(args), use_torch_fsdp2=args.use_torch_fsdp2)


def compile_layers_and_loss(model: GPTModel) -> None:
    """``torch.compile`` every transformer layer and the loss in place (the model's structure is unchanged); layers
    recorded as CUDA graphs (``cuda_graph_impl="local"``) are compiled by the library already."""
    for layer in model.decoder.layers:
        if not local_cuda_graphs_enabled(layer.config):
            layer.compile()
    if model.post_process:
        model.compute_language_model_loss = torch.compile(model.compute_language_model_loss)


def count_parameters(chunks: list[torch.nn.Module]) -> int:
    """Parameters held by this rank (shards, not the global model)."""
    return sum(p.numel() for chunk in chunks for p in chunk.parameters())
