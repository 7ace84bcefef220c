"""Validation of the DeepSeek sparse attention fields of ``TransformerConfig`` (``experimental_attention_variant="dsa"``).

Megatron-Core's rules (no linear bias, ``dsa_indexer_topk_freq >= 1``, ``dsa_indexer_skip_topk_offset >= 0``, no
fused RoPE) plus the ones its code assumes without checking: the indexer sizes are set, and the Hadamard rotation
needs a power-of-two indexer head. The fused kernels (``dsa_kernel_backend`` "tilelang" / "cudnn") are refused
here; context parallelism is DSA's all-gather form, so with ``context_parallel_size > 1`` a single
``cp_comm_type`` must be ``"all_gather"`` (a per-layer list is checked by each DSA layer). Each rule raises a
``ValueError`` naming fields, values and the rule.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DSA_KERNEL_BACKENDS", "check_dsa_config"]

DSA_KERNEL_BACKENDS = ("none", "tilelang", "cudnn")
_SIZE_FIELDS = ("dsa_indexer_n_heads", "dsa_indexer_head_dim", "dsa_indexer_topk")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check_kernel_backend(cfg: Any) -> None:
    backend = cfg.dsa_kernel_backend
    if backend not in DSA_KERNEL_BACKENDS:
        raise ValueError(f"dsa_kernel_backend ({backend!r}) must be one of {list(DSA_KERNEL_BACKENDS)}")
    if backend != "none":
        raise ValueError(f"dsa_kernel_backend ({backend!r}) is not supported: this library has no fused DSA "
                         "kernels; use 'none' (the PyTorch path, which computes the same result)")


def _check_sizes(cfg: Any) -> None:
    for name in _SIZE_FIELDS:
        value = getattr(cfg, name)
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} ({value!r}) must be a positive integer for experimental_attention_variant="
                             "'dsa'")
    head_dim = cfg.dsa_indexer_head_dim
    if cfg.dsa_indexer_rotate_activation and head_dim & (head_dim - 1):
        raise ValueError(f"dsa_indexer_head_dim ({head_dim}) must be a power of two with "
                         "dsa_indexer_rotate_activation=True (the Hadamard rotation)")
    rope_dim = getattr(cfg, "qk_pos_emb_head_dim", None)
    if getattr(cfg, "multi_latent_attention", False) and rope_dim is not None and head_dim < rope_dim:
        raise ValueError(f"dsa_indexer_head_dim ({head_dim}) must be >= qk_pos_emb_head_dim ({rope_dim}): the "
                         "indexer rotates its first qk_pos_emb_head_dim channels")


def _check_topk_sharing(cfg: Any) -> None:
    freq, offset = cfg.dsa_indexer_topk_freq, cfg.dsa_indexer_skip_topk_offset
    if not _is_int(freq) or freq < 1:
        raise ValueError(f"dsa_indexer_topk_freq ({freq!r}) must be a positive integer")
    if not _is_int(offset) or offset < 0:
        raise ValueError(f"dsa_indexer_skip_topk_offset ({offset!r}) must be a non-negative integer")


def _check_loss(cfg: Any) -> None:
    coeff = cfg.dsa_indexer_loss_coeff
    if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0):
        raise ValueError(f"dsa_indexer_loss_coeff ({coeff!r}) must be None or a number >= 0")
    eps = cfg.dsa_indexer_k_norm_epsilon
    if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps <= 0):
        raise ValueError(f"dsa_indexer_k_norm_epsilon ({eps!r}) must be None or a positive number")


def check_dsa_config(cfg: Any) -> None:
    """The rules above, for a config with ``experimental_attention_variant="dsa"``."""
    _check_kernel_backend(cfg)
    if cfg.add_bias_linear:
        raise ValueError("experimental_attention_variant='dsa' requires add_bias_linear=False (Megatron-Core's "
                         "absorbed MLA, which DSA sits in, has no linear biases)")
    if cfg.apply_rope_fusion:
        raise ValueError("apply_rope_fusion=True is not supported with experimental_attention_variant='dsa'")
    comm = getattr(cfg, "cp_comm_type", None)
    if cfg.context_parallel_size > 1 and not isinstance(comm, (list, tuple)) and comm != "all_gather":
        raise ValueError(f"cp_comm_type ({comm!r}) must be 'all_gather' with experimental_attention_variant='dsa' "
                         f"and context_parallel_size ({cfg.context_parallel_size}) > 1: DSA's context parallelism "
                         "gathers the keys over CP")
    _check_sizes(cfg)
    _check_topk_sharing(cfg)
    _check_loss(cfg)
