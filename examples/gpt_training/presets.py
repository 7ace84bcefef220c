"""Model presets for ``pretrain_gpt.py``: each fills model-shape flags the user did not set."""

from __future__ import annotations

PRESETS: dict[str, dict[str, object]] = {
    "tiny": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256, seq_length=128,
        max_position_embeddings=128, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=False,
    ),
    "mixtral-tiny": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, seq_length=128,
        max_position_embeddings=128, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True, num_experts=8, moe_router_topk=2,
        moe_grouped_gemm=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3,
    ),
    "deepseek-tiny": dict(  # DeepSeek-V3's shape in miniature: MLA, a dense first layer, sigmoid-routed experts
        num_layers=3, hidden_size=64, num_attention_heads=4, ffn_hidden_size=128, seq_length=128,
        max_position_embeddings=128, position_embedding_type="rope", normalization="RMSNorm", swiglu=True,
        disable_bias_linear=True, untie_embeddings_and_output_weights=True, multi_latent_attention=True,
        q_lora_rank=32, kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_layernorm=True,
        rope_type="rope", num_experts=8, moe_ffn_hidden_size=32, moe_layer_freq=[0, 1, 1], moe_router_topk=2,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_num_groups=4,
        moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_shared_expert_intermediate_size=32,
        moe_grouped_gemm=True, mtp_num_layers=1,
    ),
    "gpt2-125m": dict(
        num_layers=12, hidden_size=768, num_attention_heads=12, ffn_hidden_size=3072, seq_length=1024,
        max_position_embeddings=1024, position_embedding_type="learned_absolute", normalization="LayerNorm",
        swiglu=False, disable_bias_linear=False, untie_embeddings_and_output_weights=False,
    ),
    "tinyllama-1.1b": dict(
        num_layers=22, hidden_size=2048, num_attention_heads=32, num_query_groups=4, ffn_hidden_size=5632,
        seq_length=2048, max_position_embeddings=2048, position_embedding_type="rope", normalization="RMSNorm",
        swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True, vocab_size=32000,
    ),
    "llama-8b": dict(
        num_layers=32, hidden_size=4096, num_attention_heads=32, num_query_groups=8, ffn_hidden_size=14336,
        seq_length=8192, max_position_embeddings=8192, position_embedding_type="rope", rotary_base=500000,
        normalization="RMSNorm", swiglu=True, disable_bias_linear=True, untie_embeddings_and_output_weights=True,
        vocab_size=128256,
    ),
}


def apply_preset(args, defaults: dict | None = None) -> None:
    """Fill every model-shape flag the user left unset (``None``, off, or at its parser default in ``defaults``)
    from ``args.model_preset``."""
    if args.model_preset is None:
        return
    if args.model_preset not in PRESETS:
        raise ValueError(f"--model-preset {args.model_preset!r} is unknown; choose from {sorted(PRESETS)}")
    defaults = defaults or {}
    for name, value in PRESETS[args.model_preset].items():
        current = getattr(args, name, None)
        if current is None or current is False or (name in defaults and current == defaults[name]):
            setattr(args, name, value)
