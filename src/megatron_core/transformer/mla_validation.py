"""Validation of ``MLATransformerConfig``'s multi-latent attention fields (called from its ``__post_init__``).

Each rule raises a ``ValueError`` that names the fields, their values and the rule. Megatron-Core's own MLA
rules are kept (``rotary_interleaved`` is refused, ``apply_rope_fusion`` needs ``rope_type='yarn'``); the rest
states what the attention code relies on (positive sizes, an even RoPE width, head/latent sizes that split
over tensor parallelism) before any module is built.
"""

from __future__ import annotations

from typing import Any

from megatron_core.config_rules import check_value

__all__ = ["MLA_ROPE_TYPES", "check_mla_config"]

MLA_ROPE_TYPES = ("rope", "yarn")
_OWNER = "MLATransformerConfig"


def check_mla_config(cfg: Any) -> None:
    """Raise ``ValueError`` for an MLA setting the attention cannot run; a no-op for plain configs."""
    _check_sizes(cfg)
    _check_rope(cfg)
    if cfg.cache_mla_latents:
        raise ValueError(
            f"{_OWNER}: cache_mla_latents ({cfg.cache_mla_latents}) must stay False: caching the compressed latents "
            "needs Megatron-Core's absorbed FlashMLA decode, which this library does not provide (the KV-cache "
            "contexts cache the up-projected keys and values instead)"
        )
    if not cfg.multi_latent_attention:
        return
    if cfg.rotary_interleaved:
        raise ValueError(
            f"{_OWNER}: rotary_interleaved ({cfg.rotary_interleaved}) does not work with multi_latent_attention: "
            "MLA de-interleaves its RoPE channels itself (DeepSeek's layout)"
        )
    if cfg.apply_rope_fusion and cfg.rope_type != "yarn":
        raise ValueError(
            f"{_OWNER}: apply_rope_fusion ({cfg.apply_rope_fusion}) with multi_latent_attention needs "
            f"rope_type='yarn', got rope_type={cfg.rope_type!r}"
        )
    if cfg.softmax_type != "vanilla":
        raise ValueError(
            f"{_OWNER}: softmax_type ({cfg.softmax_type!r}) is not supported with multi_latent_attention "
            "(attention sinks are implemented for SelfAttention only)"
        )
    _check_tensor_parallel(cfg)


def _check_sizes(cfg: Any) -> None:
    check_value(_OWNER, "q_lora_rank", cfg.q_lora_rank, "positive int", allow_none=True)
    for name in ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim"):
        check_value(_OWNER, name, getattr(cfg, name), "positive int")
    if cfg.qk_pos_emb_head_dim % 2 != 0:
        raise ValueError(
            f"{_OWNER}: qk_pos_emb_head_dim ({cfg.qk_pos_emb_head_dim}) must be even (RoPE rotates channel pairs)"
        )


def _check_rope(cfg: Any) -> None:
    if cfg.rope_type not in MLA_ROPE_TYPES:
        raise ValueError(f"{_OWNER}: rope_type ({cfg.rope_type!r}) must be one of {list(MLA_ROPE_TYPES)}")
    for name in ("rotary_base", "rotary_scaling_factor", "beta_fast", "beta_slow"):
        check_value(_OWNER, name, getattr(cfg, name), "positive float")
    for name in ("mscale", "mscale_all_dim"):
        check_value(_OWNER, name, getattr(cfg, name), "non-negative float")
    check_value(_OWNER, "original_max_position_embeddings", cfg.original_max_position_embeddings, "positive int")
    percent = cfg.rotary_percent
    if not 0.0 < percent <= 1.0:
        raise ValueError(f"{_OWNER}: rotary_percent ({percent}) must be in (0, 1]")
    if cfg.rope_type == "rope":
        width = int(cfg.qk_pos_emb_head_dim * percent)
        if width == 0 or width % 2 != 0:
            raise ValueError(
                f"{_OWNER}: qk_pos_emb_head_dim ({cfg.qk_pos_emb_head_dim}) * rotary_percent ({percent}) = {width} "
                "rotated channels must be a positive even number"
            )


def _check_tensor_parallel(cfg: Any) -> None:
    """The local spec's down projections are column-parallel: their widths must split over the TP ranks."""
    tp = cfg.tensor_model_parallel_size
    if tp == 1:
        return
    if cfg.q_lora_rank is not None and cfg.q_lora_rank % tp != 0:
        raise ValueError(
            f"{_OWNER}: q_lora_rank ({cfg.q_lora_rank}) must be divisible by tensor_model_parallel_size ({tp}) "
            "(linear_q_down_proj is column-parallel)"
        )
    kv_width = cfg.kv_lora_rank + cfg.qk_pos_emb_head_dim
    if kv_width % tp != 0:
        raise ValueError(
            f"{_OWNER}: kv_lora_rank + qk_pos_emb_head_dim ({cfg.kv_lora_rank} + {cfg.qk_pos_emb_head_dim} = "
            f"{kv_width}) must be divisible by tensor_model_parallel_size ({tp}) (linear_kv_down_proj is "
            "column-parallel)"
        )
