"""DeepSeek sparse attention as MLA's core attention (Megatron-Core's ``DSAttention``, ``unfused_dsa_fn`` and the
top-k sharing rule).

Each query attends only to the ``dsa_indexer_topk`` keys its :class:`~.dsa_indexer.DSAIndexer` selects (within
the causal or given mask); the indexer sees MLA's attention input ``x`` and normed query latent ``qr``, both
detached, so the main loss never trains it. In training with ``dsa_indexer_loss_coeff > 0`` the indexer's KL loss
(:func:`~.dsa_indexer_loss.compute_dsa_indexer_loss`) is attached to the output through
:class:`~.dsa_indexer_loss.DSAIndexerLossAutoScaler` and recorded for the logs.

With ``dsa_indexer_topk_freq = N > 1`` only some layers run an indexer (:func:`is_dsa_skip_topk_layer`); the
others reuse the top-k of the computing layer before them (:func:`source_dsa_compute_layer`), handed over in a
per-forward holder attached to the attention mask (or the config when there is none), as Megatron-Core does.

Layouts: MLA's query ``[sq, b, np, d + r]``, key ``[sk, b, np, d + r]`` and value ``[sk, b, np, v]``; or the
absorbed form (query ``[sq, b, np, c + r]``, one shared key head ``[sk, b, 1, c + r]`` whose first
``c = kv_lora_rank`` channels are the value, ``value=None`` and ``up_v_weight`` ``[np, v, c]``). Under sequence
parallelism ``x`` holds this rank's tokens while query and key cover the whole sequence (MLA's up projections
gather them). Packed sequences (``qkv_format='thd'``, micro-batch size 1, query/key ``[t, 1, ...]`` or
``[t, ...]``) attend causally within each document, by the padded ``cu_seqlens``.

Context parallelism is Megatron-Core's all-gather form (``cp_comm_type='all_gather'``): each rank keeps its
queries (the load-balanced split, per document when packed), and the keys (values, indexer keys) are all-gathered
over CP and put back in sequence order (:mod:`.dsa_layout`), so top-k indices and masks address the whole
sequence; their gradients are reduce-scattered back. Each rank's indexer loss is its share of the whole
sequence's: its rows' KL summed and divided by the rows of all CP ranks (not divided with
``calculate_per_token_loss``), so the shares add up over CP to the single-process loss (logged summed over CP),
and with the schedules' CP factor and the data x context-parallel gradient average the indexer's gradient is the
single-process one. The fused kernels are not provided.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.process_groups_config import resolve_pg_collection
from megatron_core.tensor_parallel.mappings import (
    gather_from_sequence_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.experimental_attention_variant import dsa_masking
from megatron_core.transformer.experimental_attention_variant.dsa_indexer import fused_qk_topk_naive
from megatron_core.transformer.experimental_attention_variant.dsa_indexer_loss import (
    DSAIndexerLossAutoScaler,
    compute_dsa_indexer_loss,
)
from megatron_core.transformer.experimental_attention_variant.dsa_layout import (
    DSATokenLayout,
    dsa_token_layout,
    ensure_sbhd,
)
from megatron_core.transformer.experimental_attention_variant.dsa_loss_logging import (
    DSAIndexerLossLoggingHelper,
)
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.spec_utils import ModuleSpec, build_module
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["DSAttention", "DSAttentionSubmodules", "is_dsa_skip_topk_layer", "source_dsa_compute_layer",
           "unfused_dsa_fn"]


def is_dsa_skip_topk_layer(layer_number: int, skip_topk_offset: int, topk_freq: int) -> bool:
    """Whether 1-based layer ``layer_number`` reuses an earlier layer's top-k: layers up to
    ``max(skip_topk_offset, 1)`` compute their own, then one layer in every ``topk_freq`` computes."""
    if layer_number < 1:
        raise ValueError(f"layer_number ({layer_number}) must be 1-based and positive")
    if skip_topk_offset < 0:
        raise ValueError(f"skip_topk_offset ({skip_topk_offset}) must be non-negative")
    if topk_freq < 1:
        raise ValueError(f"topk_freq ({topk_freq}) must be positive")
    offset = max(skip_topk_offset, 1)
    return max(layer_number - offset, 0) % topk_freq != 0


def source_dsa_compute_layer(layer_number: int, skip_topk_offset: int, topk_freq: int) -> int:
    """The 1-based computing layer whose top-k ``layer_number`` uses (itself when it computes)."""
    is_dsa_skip_topk_layer(layer_number, skip_topk_offset, topk_freq)
    offset = max(skip_topk_offset, 1)
    if layer_number <= offset:
        return layer_number
    return layer_number - (layer_number - offset) % topk_freq


def unfused_dsa_fn(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, topk_indices: torch.Tensor,
                   softmax_scale: float, mask: torch.Tensor | None = None, varlen_starts: torch.Tensor | None = None,
                   varlen_ends: torch.Tensor | None = None, key_positions: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """Sparse attention over the selected keys: ``[sq, b, np * hnv]``.

    ``query`` ``[sq, b, np, hn]``; ``key`` ``[sk, b, 1 | np, hn]`` and ``value`` ``[sk, b, 1 | np, hnv]`` (one
    shared head is broadcast; packed ``[t, heads, d]`` tensors are read as ``[t, 1, heads, d]`` and the output is
    then ``[t, np * hnv]``); ``topk_indices`` ``[b, sq, topk]`` (-1: empty slot); ``mask`` additive ``[sq, sk]``
    / ``[b, sq, sk]`` (None: causal), or the row-wise key bounds ``varlen_starts`` / ``varlen_ends`` over
    ``key_positions`` (:mod:`.dsa_masking`). A query's softmax runs over its selected, unmasked keys only (a query
    with none gets zeros). Works 512 query rows at a time, never forming ``[sq, sk]`` scores per head.
    """
    if value is None:
        raise NotImplementedError("unfused_dsa_fn needs a value tensor (the absorbed layout passes the latent "
                                  "part of the key)")
    query, packed = ensure_sbhd(query, "query")
    key, value = ensure_sbhd(key, "key")[0], ensure_sbhd(value, "value")[0]
    sq, b, heads, _ = query.shape
    sk, nk, nv, hnv = key.shape[0], key.shape[2], value.shape[2], value.shape[3]
    mask = dsa_masking.resolve_sparse_mask(mask, varlen_starts, varlen_ends, key_positions, sk=sk,
                                           device=query.device)
    for name, n in (("key", nk), ("value", nv)):
        if n not in (1, heads):
            raise ValueError(f"unfused_dsa_fn: {name} has {n} heads; it needs 1 (shared) or the query's {heads}")
    _, _, row_mask, _ = dsa_masking.prepare_additive_mask(mask, sq=sq, sk=sk, b=b, device=query.device)
    output = torch.empty((sq, b, heads * hnv), dtype=value.dtype, device=query.device)
    chunk = 512
    for bi in range(b):
        mask_b = row_mask[0 if row_mask.shape[0] == 1 else bi]
        for s0 in range(0, sq, chunk):
            s1 = min(s0 + chunk, sq)
            idx = topk_indices[bi, s0:s1].to(dtype=torch.int64, device=query.device)  # [s, K]
            safe = idx.clamp(0, max(sk - 1, 0))
            bias = mask_b[s0:s1].gather(-1, safe)  # [s, K]
            valid = (idx >= 0) & torch.isfinite(bias)
            k_sel = key[:, bi][safe].float()  # [s, K, nk, hn]
            v_sel = value[:, bi][safe].float()  # [s, K, nv, hnv]
            logits = torch.einsum("snd,sknd->snk", query[s0:s1, bi].float(), k_sel.expand(-1, -1, heads, -1))
            logits = logits * softmax_scale + bias.unsqueeze(1)
            probs = dsa_masking.masked_softmax(logits, valid.unsqueeze(1).expand_as(logits))
            out = torch.einsum("snk,sknd->snd", probs, v_sel.expand(-1, -1, heads, -1))
            output[s0:s1, bi] = out.reshape(s1 - s0, heads * hnv).to(value.dtype)
    return output.squeeze(1) if packed else output


def _resolve_cp_comm_type(cp_comm_type: str | None, config: TransformerConfig, layer_number: int) -> str:
    """The layer's CP communication type: the argument, else ``config.cp_comm_type`` (per layer when a list),
    else ``"p2p"``."""
    if cp_comm_type is None:
        cp_comm_type = getattr(config, "cp_comm_type", None)
        if isinstance(cp_comm_type, (list, tuple)):
            cp_comm_type = cp_comm_type[layer_number - 1] if len(cp_comm_type) >= layer_number else None
    return "p2p" if cp_comm_type is None else cp_comm_type


@dataclass
class DSAttentionSubmodules:
    """DSAttention's indexer (Megatron-Core's field name)."""

    indexer: ModuleSpec | type | None = None


class DSAttention(MegatronModule):
    """Sparse attention over the indexer's top-k keys (see the module docstring)."""

    consumes_absorbed_v_up_projection = True
    requires_dsa_inputs = True
    _HOLDER_ATTR = "_dsa_index_share_topk_holder"

    def __init__(self, config: TransformerConfig, submodules: DSAttentionSubmodules, layer_number: int,
                 attn_mask_type: AttnMaskType, attention_type: str, attention_dropout: float | None = None,
                 softmax_scale: float | None = None, k_channels: int | None = None, v_channels: int | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__(config=config)
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.index_topk = config.dsa_indexer_topk
        self.index_topk_freq = config.dsa_indexer_topk_freq or 1
        self.index_skip_topk_offset = config.dsa_indexer_skip_topk_offset or 0
        self.index_share = self.index_topk_freq > 1
        self.skip_topk = self.index_share and is_dsa_skip_topk_layer(layer_number, self.index_skip_topk_offset,
                                                                     self.index_topk_freq)
        self.source_layer = (source_dsa_compute_layer(layer_number, self.index_skip_topk_offset, self.index_topk_freq)
                             if self.index_share else layer_number)
        self.pg_collection = resolve_pg_collection(pg_collection, required_pgs=["tp", "cp"])
        cp_comm_type = _resolve_cp_comm_type(cp_comm_type, config, layer_number)
        if get_pg_size(self.pg_collection.cp) > 1 and cp_comm_type != "all_gather":
            raise ValueError(f"cp_comm_type ({cp_comm_type!r}) must be 'all_gather' for DSAttention with context "
                             f"parallelism (CP size {get_pg_size(self.pg_collection.cp)}): DSA gathers the keys "
                             "over CP")
        self.indexer = (None if self.skip_topk
                        else build_module(submodules.indexer, config=config, pg_collection=self.pg_collection))
        if softmax_scale is None:
            softmax_scale = 1.0 / math.sqrt(k_channels if k_channels is not None else config.kv_channels)
        self.softmax_scale = softmax_scale
        self.cp_comm_type = cp_comm_type

    def _topk_holder(self, packed_seq_params: Any, attention_mask: torch.Tensor | None) -> dict[int, torch.Tensor]:
        carrier = packed_seq_params if packed_seq_params is not None else attention_mask
        carrier = carrier if carrier is not None else self.config
        holder = getattr(carrier, self._HOLDER_ATTR, None)
        if holder is None:
            holder = {}
            setattr(carrier, self._HOLDER_ATTR, holder)
        return holder

    def _float_mask(self, attn_mask_type: AttnMaskType | None, attention_mask: torch.Tensor | None, sq: int,
                    sk: int, b: int, device: torch.device, layout: DSATokenLayout | None) -> torch.Tensor:
        """The additive mask: causal ``[sq, sk]`` for a causal mask type (within documents, at this CP rank's
        positions, by ``layout``), else ``attention_mask`` (True = masked, ``[b, 1, sq, sk]``) as ``[b, sq, sk]``."""
        if attn_mask_type is not None:
            if attn_mask_type != AttnMaskType.causal:
                raise ValueError(f"DSAttention supports attn_mask_type causal (or None with an attention_mask), got "
                                 f"{attn_mask_type}")
            if layout is not None:
                return layout.causal_mask(sk)
            return dsa_masking.prepare_additive_mask(None, sq=sq, sk=sk, b=b, device=device)[0]
        if attention_mask is None or tuple(attention_mask.shape) != (b, 1, sq, sk):
            shape = None if attention_mask is None else tuple(attention_mask.shape)
            raise ValueError(f"DSAttention without attn_mask_type needs an attention_mask [b, 1, sq, sk] = "
                             f"[{b}, 1, {sq}, {sk}], got {shape}")
        return torch.zeros((b, sq, sk), dtype=torch.float32, device=device).masked_fill(
            attention_mask[:, 0].to(torch.bool), float("-inf"))

    def _gather_sequence(self, t: torch.Tensor | None, local_rows: int, full_rows: int, name: str
                         ) -> torch.Tensor | None:
        """Under sequence parallelism, ``t`` over the whole sequence (gathered if it holds this rank's rows)."""
        if t is None or t.shape[0] == full_rows:
            return t
        if t.shape[0] == local_rows:
            return gather_from_sequence_parallel_region(t, group=self.pg_collection.tp)
        raise ValueError(f"DSAttention: {name} has {t.shape[0]} rows; under sequence parallelism it needs "
                         f"{local_rows} (this rank's) or {full_rows} (all)")

    def _gather_over_cp(self, t: torch.Tensor | None, layout: DSATokenLayout | None, local_rows: int, name: str
                        ) -> torch.Tensor | None:
        """This CP rank's rows of ``t`` gathered from every CP rank and put in sequence order (gradient
        reduce-scattered back); ``t`` itself without CP."""
        if t is None or layout is None or layout.key_reorder is None:
            return t
        if t.shape[0] != local_rows:
            raise ValueError(f"DSAttention under context parallelism: {name} has {t.shape[0]} rows, expected this "
                             f"rank's {local_rows}")
        gathered = gather_from_sequence_parallel_region(t, group=self.pg_collection.cp)
        return gathered.index_select(0, layout.key_reorder)

    def _cp_row_count(self, rows: torch.Tensor | None, local_rows: int) -> torch.Tensor | int:
        """The query rows the indexer loss averages over on all CP ranks together (every rank holds as many rows;
        with ``real_token_mask_q`` the real rows are counted and summed over CP)."""
        cp_group = self.pg_collection.cp
        if rows is None:
            return local_rows * get_pg_size(cp_group)
        count = rows.sum().to(torch.float32)
        return reduce_from_tensor_model_parallel_region(count, group=cp_group).clamp_min(1.0)

    def _topk(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        return fused_qk_topk_naive(q, k, weights, self.index_topk, mask,
                                   use_relu=self.config.dsa_indexer_scoring_relu)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None,
                attention_mask: torch.Tensor | None, x: torch.Tensor, qr: torch.Tensor,
                position_ids: torch.Tensor | None = None, attn_mask_type: AttnMaskType | None = None,
                attention_bias: torch.Tensor | None = None, packed_seq_params: Any = None,
                up_v_weight: torch.Tensor | None = None) -> torch.Tensor:
        """Sparse attention: ``[sq, b, np * v]`` (``v`` the value width, or ``up_v_weight``'s in the absorbed
        form); packed ``[t, ...]`` when ``x`` is ``[t, hidden]``. ``x`` ``[s, b, hidden]`` and ``qr``
        ``[s, b, q_lora_rank]`` feed the indexer."""
        if attention_bias is not None:
            raise ValueError("DSAttention does not take an attention_bias")
        query, key = ensure_sbhd(query, "query")[0], ensure_sbhd(key, "key")[0]
        value = None if value is None else ensure_sbhd(value, "value")[0]
        packed = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed and query.shape[1] != 1:
            raise ValueError(f"DSAttention with packed sequences (qkv_format='thd') needs micro-batch size 1, got "
                             f"{query.shape[1]}")
        config = self.config
        latent = int(getattr(config, "kv_lora_rank", 0) or 0)
        absorbed = (value is None and latent > 0 and key.shape[2] == 1
                    and query.shape[-1] == key.shape[-1] == latent + int(config.qk_pos_emb_head_dim))
        if value is None and not absorbed:
            raise ValueError(f"DSAttention got value=None but query/key are not in the absorbed layout (query width "
                             f"{query.shape[-1]}, key width {key.shape[-1]}, key heads {key.shape[2]}, expected "
                             f"kv_lora_rank + qk_pos_emb_head_dim = {latent + int(config.qk_pos_emb_head_dim)})")
        if absorbed and up_v_weight is None:
            raise ValueError("DSAttention in the absorbed layout needs up_v_weight [np, v_head_dim, kv_lora_rank]")
        if not absorbed and up_v_weight is not None:
            raise ValueError("DSAttention got up_v_weight with an explicit value tensor; the absorbed form passes "
                             "value=None")
        tp = get_pg_size(self.pg_collection.tp)
        if config.sequence_parallel and tp > 1:
            local, full = x.shape[0], x.shape[0] * tp
            if query.shape[0] != full:
                raise ValueError(f"DSAttention under sequence parallelism needs the whole sequence of queries "
                                 f"({full} rows), got {query.shape[0]}")
            key = self._gather_sequence(key, local, full, "key")
            value = self._gather_sequence(value, local, full, "value")
        sq, b = query.shape[0], query.shape[1]
        cp_group = self.pg_collection.cp
        cp_size = get_pg_size(cp_group)
        layout = None
        if packed or cp_size > 1:
            layout = dsa_token_layout(sq, cp_size, get_pg_rank(cp_group), packed_seq_params if packed else None,
                                      query.device)
        key = self._gather_over_cp(key, layout, sq, "key")
        value = self._gather_over_cp(value, layout, sq, "value")
        sk = key.shape[0]
        mask = self._float_mask(attn_mask_type, attention_mask, sq, sk, b, query.device, layout)
        rows = dsa_masking.extract_query_valid_rows_from_packed_seq_params(packed_seq_params, b=b, sq=sq,
                                                                            device=query.device)
        x_ndim = x.ndim
        x, qr = x.detach(), qr.detach()
        coeff = config.dsa_indexer_loss_coeff or 0.0
        use_loss = self.training and torch.is_grad_enabled() and coeff > 0 and not self.skip_topk
        holder = self._topk_holder(packed_seq_params, attention_mask) if self.index_share else None
        loss = None
        if self.skip_topk:
            if self.source_layer not in holder:
                raise RuntimeError(f"DSA layer {self.layer_number} reuses the top-k of layer {self.source_layer}, "
                                   f"which did not run before it in this forward (dsa_indexer_topk_freq="
                                   f"{self.index_topk_freq}, dsa_indexer_skip_topk_offset="
                                   f"{self.index_skip_topk_offset}); a pipeline stage must start on a computing "
                                   "layer")
            topk = holder[self.source_layer]
        elif use_loss:
            q, k, weights = self.indexer.forward_before_topk(x, qr, packed_seq_params)
            scores, topk = self._topk(q, self._gather_over_cp(k, layout, sq, "indexer key"), weights, mask)
            key_for_loss = key.expand(-1, -1, query.shape[2], -1) if absorbed else key
            # Under CP a rank's loss is its share of the whole sequence's loss: its rows' KL summed, divided (unless
            # per-token) by the row count of every CP rank; the shares add up over CP (logging and gradients).
            cp_share = cp_size > 1 and not config.calculate_per_token_loss
            loss = compute_dsa_indexer_loss(scores, topk, query.detach(), key_for_loss.detach(), self.softmax_scale,
                                            coeff, config.dsa_indexer_use_sparse_loss, self.pg_collection, mask=mask,
                                            query_valid_rows=rows,
                                            calculate_per_token_loss=config.calculate_per_token_loss or cp_share)
            if cp_share:
                loss = loss / self._cp_row_count(rows, b * sq)
            DSAIndexerLossLoggingHelper.save_loss_to_tracker(loss, self.layer_number, config.num_layers,
                                                             reduce_group=cp_group if cp_size > 1 else None)
        else:
            with torch.no_grad():
                q, k, weights = self.indexer.forward_before_topk(x, qr, packed_seq_params)
                topk = self._topk(q, self._gather_over_cp(k, layout, sq, "indexer key"), weights, mask)[1]
        if self.index_share and not self.skip_topk:
            holder[self.layer_number] = topk
        if absorbed:
            heads = query.shape[2]
            out = unfused_dsa_fn(query, key, key[..., :latent], topk, self.softmax_scale, mask=mask)
            out = torch.einsum("sbhc,hdc->sbhd", out.view(sq, b, heads, latent),
                               up_v_weight.to(dtype=out.dtype, device=out.device))
            output = out.reshape(sq, b, -1)
        else:
            output = unfused_dsa_fn(query, key, value, topk, self.softmax_scale, mask=mask)
        if loss is not None:
            output = DSAIndexerLossAutoScaler.apply(output, loss)
        return output.squeeze(1) if x_ndim == 2 else output
