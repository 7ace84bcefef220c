"""The lightning indexer of DeepSeek sparse attention (Megatron-Core's ``DSAIndexer`` and its top-k helpers).

Per query token the indexer scores every key token cheaply and keeps the ``dsa_indexer_topk`` best:

- indexer query ``q = linear_wq_b(qr)`` from MLA's normed query latent ``qr``, ``dsa_indexer_n_heads`` heads of
  ``dsa_indexer_head_dim``; one shared indexer key ``k = k_norm(linear_wk(x))`` (a LayerNorm with bias) from
  the attention input ``x``;
- RoPE on the first ``qk_pos_emb_head_dim`` channels of both (half-split, or MLA's interleaved pairs with
  ``dsa_indexer_rope_interleaved``), then, with ``dsa_indexer_rotate_activation``, a Hadamard rotation
  (orthonormal: the dot products are unchanged up to rounding; pure PyTorch here, any float dtype);
- ``score[s, t] = sum_h w[s, h] * relu(q[s, h] . k[t])`` with ``w = linear_weights_proj(x) / sqrt(n_heads) /
  sqrt(head_dim)`` (``dsa_indexer_scoring_relu=False`` drops the ReLU); plus the additive mask; top-k per row,
  -1 for slots whose score is ``-inf``.

The projections are duplicated on every TP rank (``parallel_mode="duplicated"``) and, under sequence
parallelism, ``x`` and ``qr`` are all-gathered first, so every rank scores the whole sequence; the parameters
are marked ``average_gradients_across_tp_domain`` as in Megatron-Core.

Under context parallelism the indexer rotates this rank's tokens at their own positions (the load-balanced split);
with packed sequences (``qkv_format='thd'``) positions restart at every document, as in MLA. The caller
(:class:`~.dsa_attention.DSAttention`) gathers the keys over CP.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core._ground import get_pg_size
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron_core.transformer.experimental_attention_variant import dsa_masking
from megatron_core.transformer.experimental_attention_variant.dsa_layout import get_packed_qk_cu_seqlens
from megatron_core.transformer.mla_rope import build_mla_rotary_embedding, rotary_angles, rotate_mla
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["DSAIndexer", "DSAIndexerSubmodules", "fused_qk_topk_naive", "rotate_activation"]


def rotate_activation(x: torch.Tensor) -> torch.Tensor:
    """``x`` times the orthonormal (Sylvester) Hadamard matrix over its last dimension, a power of two."""
    n = x.shape[-1]
    if n & (n - 1):
        raise ValueError(f"rotate_activation needs a power-of-two last dimension, got {n}")
    y, h = x, 1
    while h < n:
        y = y.reshape(*x.shape[:-1], n // (2 * h), 2, h)
        y = torch.stack((y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]), dim=-2)
        h *= 2
    return y.reshape(x.shape) * n ** -0.5


def _compute_index_scores(q: torch.Tensor, weights: torch.Tensor, k: torch.Tensor, use_relu: bool = True
                          ) -> torch.Tensor:
    """``[b, sq, sk]`` fp32 scores from ``q`` ``[sq, b, h, d]``, ``weights`` ``[sq, b, h]``, ``k`` ``[sk, b, d]``."""
    scores = torch.einsum("sbhd,tbd->sbht", q.float(), k.float())
    if use_relu:
        scores = torch.relu(scores)
    return (scores * weights.float().unsqueeze(-1)).sum(dim=2).transpose(0, 1)


def fused_qk_topk_naive(q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, index_topk: int,
                        mask: torch.Tensor | None = None, varlen_starts: torch.Tensor | None = None,
                        varlen_ends: torch.Tensor | None = None, key_positions: torch.Tensor | None = None,
                        use_relu: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(index scores [b, sq, sk] + mask, top-k key indices [b, sq, min(index_topk, sk)])``.

    ``mask`` is additive (``[sq, sk]`` or ``[b, sq, sk]``; None adds nothing), or the row-wise key bounds
    ``varlen_starts`` / ``varlen_ends`` (``[sq]``, over ``key_positions``, see :mod:`.dsa_masking`) describe it;
    slots whose score is ``-inf`` hold -1.
    """
    mask = dsa_masking.resolve_sparse_mask(mask, varlen_starts, varlen_ends, key_positions, sk=k.shape[0],
                                           device=q.device)
    scores = _compute_index_scores(q, weights, k, use_relu=use_relu)
    if mask is not None:
        scores = scores + mask
    topk = min(index_topk, k.shape[0])
    top_scores, top_indices = scores.topk(topk, dim=-1)
    return scores, top_indices.masked_fill(top_scores == float("-inf"), -1)


@dataclass
class DSAIndexerSubmodules:
    """The indexer's projections and key norm (Megatron-Core's field names)."""

    linear_wq_b: ModuleSpec | type | None = None
    linear_wk: ModuleSpec | type | None = None
    k_norm: ModuleSpec | type | None = None
    linear_weights_proj: ModuleSpec | type | None = None


class DSAIndexer(MegatronModule):
    """The DSA lightning indexer: top-k key indices per query (see the module docstring)."""

    def __init__(self, config: TransformerConfig, submodules: DSAIndexerSubmodules, pg_collection: Any = None
                 ) -> None:
        super().__init__(config=config)
        pg_collection = resolve_pg_collection(pg_collection, required_pgs=["tp", "cp"])
        self.pg_collection = pg_collection
        self.tp_group = pg_collection.tp
        self.hidden_size = config.hidden_size
        self.qk_pos_emb_head_dim = config.qk_pos_emb_head_dim
        self.q_lora_rank = config.q_lora_rank if config.q_lora_rank is not None else config.hidden_size
        self.index_n_heads = config.dsa_indexer_n_heads
        self.index_head_dim = config.dsa_indexer_head_dim
        self.index_topk = config.dsa_indexer_topk
        self.softmax_scale: float = self.index_head_dim ** -0.5
        self.rotary_pos_emb = build_mla_rotary_embedding(config, pg_collection.cp)
        linear = dict(config=config, init_method=config.init_method, bias=False, skip_bias_add=False,
                      skip_weight_param_allocation=False, parallel_mode="duplicated")
        self.linear_wq_b = build_module(submodules.linear_wq_b, self.q_lora_rank,
                                        self.index_n_heads * self.index_head_dim, **linear)
        self.linear_wk = build_module(submodules.linear_wk, self.hidden_size, self.index_head_dim, **linear)
        k_norm_config = copy.copy(config)
        k_norm_config.normalization = "LayerNorm"
        eps = (config.dsa_indexer_k_norm_epsilon if config.dsa_indexer_k_norm_epsilon is not None
               else config.layernorm_epsilon)
        self.k_norm = build_module(submodules.k_norm, config=k_norm_config, hidden_size=self.index_head_dim, eps=eps)
        self.linear_weights_proj = build_module(submodules.linear_weights_proj, self.hidden_size,
                                                self.index_n_heads, **linear)
        for param in self.parameters():
            # Every TP rank computes the same whole gradient: average it over TP, never sum it.
            param.average_gradients_across_tp_domain = True
            param.sequence_parallel = False

    def _apply_rope(self, x: torch.Tensor, angles: torch.Tensor, mscale: float,
                    cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE on the first ``qk_pos_emb_head_dim`` channels of ``x`` ``[s, b, heads, index_head_dim]`` (packed:
        ``[t, 1, heads, index_head_dim]`` with the documents' ``cu_seqlens``)."""
        x_pe, x_nope = torch.split(x, [self.qk_pos_emb_head_dim, self.index_head_dim - self.qk_pos_emb_head_dim],
                                   dim=-1)
        cp_group = self.pg_collection.cp if cu_seqlens is not None else None
        if self.config.dsa_indexer_rope_interleaved:
            x_pe = rotate_mla(x_pe, angles, mscale, self.config, cu_seqlens, cp_group)
        else:
            x_pe = apply_rotary_pos_emb(x_pe, angles, config=self.config, cu_seqlens=cu_seqlens, mscale=mscale,
                                        cp_group=cp_group)
        return torch.cat((x_pe, x_nope), dim=-1)

    def forward_before_topk(self, x: torch.Tensor, qr: torch.Tensor, packed_seq_params: Any = None
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [s, b, n_heads, head_dim], k [s, b, head_dim], weights [s, b, n_heads])`` over this CP rank's whole
        sequence (``x`` ``[s, b, hidden]`` and ``qr`` ``[s, b, q_lora_rank]`` are this rank's tokens)."""
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        cu_q, cu_kv = get_packed_qk_cu_seqlens(packed_seq_params) if packed else (None, None)
        seq_len = self.rotary_pos_emb.get_rotary_seq_len(None, self, x, self.config,
                                                         packed_seq_params if packed else None)
        angles, mscale = rotary_angles(self.rotary_pos_emb, seq_len, packed, x.device)
        if self.config.sequence_parallel and get_pg_size(self.tp_group) > 1:
            x = gather_from_sequence_parallel_region(x, group=self.tp_group)
            qr = gather_from_sequence_parallel_region(qr, group=self.tp_group)
        seqlen, bsz, _ = x.shape
        q, _ = self.linear_wq_b(qr)
        q = self._apply_rope(q.reshape(seqlen, bsz, self.index_n_heads, self.index_head_dim), angles, mscale, cu_q)
        k, _ = self.linear_wk(x)
        k = self.k_norm(k.float()).to(k.dtype) if self.config.dsa_indexer_k_norm_fp32 else self.k_norm(k)
        k = self._apply_rope(k.reshape(seqlen, bsz, 1, self.index_head_dim), angles, mscale, cu_kv)
        k = k.reshape(seqlen, bsz, self.index_head_dim)
        if self.config.dsa_indexer_rotate_activation:
            q, k = rotate_activation(q), rotate_activation(k)
        weights, _ = self.linear_weights_proj(x)
        return q, k, weights * (self.index_n_heads ** -0.5) * self.softmax_scale

    def forward_with_scores(self, x: torch.Tensor, qr: torch.Tensor, mask: torch.Tensor | None = None,
                            packed_seq_params: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(index scores [b, s, s], top-k indices [b, s, topk])``; ``mask`` is additive (None: unmasked)."""
        q, k, weights = self.forward_before_topk(x, qr, packed_seq_params)
        return fused_qk_topk_naive(q, k, weights, self.index_topk, mask,
                                   use_relu=self.config.dsa_indexer_scoring_relu)

    def forward(self, x: torch.Tensor, qr: torch.Tensor, mask: torch.Tensor | None = None,
                packed_seq_params: Any = None) -> torch.Tensor:
        """Top-k key indices ``[b, s, topk]`` for sparse attention."""
        return self.forward_with_scores(x, qr, mask, packed_seq_params)[1]
