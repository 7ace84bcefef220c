"""Core attention ``softmax(Q K^T * scale + mask) V`` on ``F.scaled_dot_product_attention``.

Megatron-Core's local ``DotProductAttention`` computes this with an explicit softmax; here SDPA
does it, so on GPU the flash / cuDNN / memory-efficient kernels run. With a causal mask type
and no mask tensor the ``is_causal=True`` fast path is used (no ``[s, s]`` mask is built).
Masks follow Megatron: boolean, ``True`` = masked out, broadcastable to ``[b, heads, sq, sk]``.
With a causal mask type, a mask tensor that is exactly the plain causal pattern is recognised
(see :func:`is_plain_causal_mask`) and the fast path runs; any other mask is honoured.
Attention dropout runs under the tracker's model-parallel RNG fork (each TP rank drops different
heads' probabilities), except under sequence parallelism where the block already forked.
Grouped-query attention is passed to SDPA as ``enable_gqa`` (no key/value copies).
Sliding windows (``config.window_size``), packed sequences (``packed_seq_params``) and context
parallelism (``cp_comm_type``; see ``context_parallel``) are handled here too; under hybrid context
parallelism ``packed_seq_params.cp_group`` / ``local_cp_size`` pick each call's CP group.
Attention sinks (``config.softmax_type``, as Megatron-Core): 'off-by-one' adds ``exp(0)`` and 'learnable'
adds ``exp(softmax_offset[h])`` to every softmax denominator; ``softmax_offset`` is a parameter of this
rank's heads (split over TP like the heads, key ``...core_attention.softmax_offset``). They run on the
plain path only (:func:`~megatron_core.transformer.attention_kernels.attend_with_sink`): packed sequences
and context parallelism refuse them.
Inputs are ``[s, b, heads, head_dim]`` (this TP rank's heads); the output is ``[sq, b, heads * head_dim]``.
With ``qk_clip`` or ``log_max_attention_logit``, every forward also folds the largest logit of each of this rank's
heads into ``current_max_attn_logits`` (:mod:`~megatron_core.transformer.attention_max_logit`; reset by ``clip_qk``).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch

from megatron_core import tensor_parallel
from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.device import get_current_device
from megatron_core.process_groups_config import (
    check_parallel_size,
    resolve_pg_collection,
    resolve_process_group,
)
from megatron_core.tensor_parallel.weight_init import (
    _initialize_affine_weight_gpu,
    set_tensor_model_parallel_attributes,
)
from megatron_core.transformer.attention_kernels import attend, attend_with_sink, window_keep
from megatron_core.transformer.attention_max_logit import (
    context_parallel_max_logits,
    max_logits,
    update_running_max,
)
from megatron_core.transformer.causal_mask import is_causal_rows, is_plain_causal_mask, sdpa_mask
from megatron_core.transformer.context_parallel import CP_COMM_TYPES, context_parallel_attention
from megatron_core.transformer.enums import AttnMaskType
from megatron_core.transformer.module import MegatronModule
from megatron_core.transformer.packed_sequences import packed_cp_group, thd_layout
from megatron_core.transformer.transformer_config import TransformerConfig

__all__ = ["DotProductAttention", "is_plain_causal_mask"]

_WINDOW_TYPES = (AttnMaskType.causal, AttnMaskType.causal_bottom_right, AttnMaskType.padding_causal)


def _check_window(window: Any, mask_type: AttnMaskType) -> tuple[int, int] | None:
    if window is None:
        return None
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window)):
        raise ValueError(f"window_size ({window!r}) must be a (left, right) pair of ints >= -1 (-1 = unbounded)")
    if mask_type not in _WINDOW_TYPES:
        raise ValueError(
            f"window_size ({tuple(window)}) needs a causal attention mask type "
            f"({[t.name for t in _WINDOW_TYPES]}), got attn_mask_type={mask_type.name}"
        )
    return int(window[0]), int(window[1])


def _layer_uses_window(config: TransformerConfig, layer_number: int) -> bool:
    """Megatron's ``window_attn_skip_freq``: an int N makes every N-th layer full attention; a list of 0/1
    per layer marks the sliding-window layers (1); None: every layer uses ``window_size``."""
    freq = getattr(config, "window_attn_skip_freq", None)
    if config.window_size is None or freq is None:
        return config.window_size is not None
    if isinstance(freq, int) and freq > 0:
        return layer_number % freq != 0
    if isinstance(freq, (list, tuple)) and len(freq) == config.num_layers:
        return bool(freq[layer_number - 1])
    raise ValueError(
        f"window_attn_skip_freq ({freq!r}) must be a positive int or a list of num_layers ({config.num_layers}) 0/1 flags"
    )


def _resolve_comm_type(cp_comm_type: Any, config: TransformerConfig, layer_number: int) -> str:
    if cp_comm_type is None:
        cp_comm_type = getattr(config, "cp_comm_type", None)
    if isinstance(cp_comm_type, (list, tuple)):
        if len(cp_comm_type) != config.num_layers:
            raise ValueError(
                f"cp_comm_type has {len(cp_comm_type)} entries; a per-layer list needs num_layers "
                f"({config.num_layers})"
            )
        cp_comm_type = cp_comm_type[layer_number - 1]
    cp_comm_type = "p2p" if cp_comm_type is None else cp_comm_type
    if cp_comm_type not in CP_COMM_TYPES:
        raise ValueError(f"cp_comm_type ({cp_comm_type!r}) must be one of {list(CP_COMM_TYPES)}")
    return cp_comm_type


class DotProductAttention(MegatronModule):
    """Scaled dot-product attention over this tensor-parallel rank's heads (and CP rank's tokens)."""

    is_dot_product_attention = True  # read by causal_mask.drop_plain_causal_mask (subclasses included)

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__(config)
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        self.attention_type = attention_type
        window = config.window_size if _layer_uses_window(config, self.layer_number) else None
        self.window_size = _check_window(window, attn_mask_type)
        self.cp_comm_type = _resolve_comm_type(cp_comm_type, config, self.layer_number)
        self.pg_collection = resolve_pg_collection(pg_collection, required_pgs=["cp", "hcp"])
        # As in Megatron-Core, the config turns context parallelism on: a model part built with the default groups
        # of a CP world but a config without CP (a vision encoder beside a CP language model) sees whole sequences.
        # Language models check that their config states the group's size (LanguageModule); a size other than 1
        # must equal the group's.
        check_parallel_size(config, "context_parallel_size", self.pg_collection.cp, "context-parallel")
        self.cp_group = self.pg_collection.cp if config.context_parallel_size > 1 else None
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        if self.dropout_p > 0.0 and self._uses_ring():
            raise ValueError(
                f"attention_dropout ({self.dropout_p}) is not supported with cp_comm_type {self.cp_comm_type!r} "
                f"(ring attention over {get_pg_size(self.cp_group)} CP ranks); use 'all_gather' or 'a2a', "
                "or attention_dropout=0"
            )
        if softmax_scale is None:
            softmax_scale = config.softmax_scale
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        self.softmax_offset = None
        if self.softmax_type != "vanilla":
            self._build_softmax_offset(config, pg_collection)
        # Per-head largest logit of the forwards since the last clip_qk (qk_clip / log_max_attention_logit)
        self.record_max_logits = bool(getattr(config, "qk_clip", False)
                                      or getattr(config, "log_max_attention_logit", False))
        self.current_max_attn_logits: torch.Tensor | None = None

    def _build_softmax_offset(self, config: TransformerConfig, pg_collection: Any) -> None:
        """The per-head sink logits of this TP rank's heads: zeros ('off-by-one') or a parameter ('learnable')."""
        if get_pg_size(self.cp_group) > 1:
            raise ValueError(
                f"softmax_type={self.softmax_type!r} (attention sinks) is not supported with context parallelism "
                f"({get_pg_size(self.cp_group)} CP ranks)"
            )
        self.tp_group = resolve_process_group("tp", pg_collection=pg_collection)
        tp_size, tp_rank = get_pg_size(self.tp_group), get_pg_rank(self.tp_group)
        heads = config.num_attention_heads // tp_size
        device = torch.device("cpu") if config.use_cpu_initialization else get_current_device()
        offset = torch.zeros(heads, dtype=config.params_dtype, device=device)
        if self.softmax_type == "off-by-one":  # a constant (not saved, as in Megatron-Core) that moves with the module
            del self.softmax_offset
            self.register_buffer("softmax_offset", offset, persistent=False)
            return
        param = torch.nn.Parameter(offset)
        if config.perform_initialization and not config.use_cpu_initialization:
            _initialize_affine_weight_gpu(param, config.init_method, partition_dim=0)  # (sets the TP attributes)
        else:
            set_tensor_model_parallel_attributes(param, is_parallel=True, dim=0, stride=1)
        if config.perform_initialization and config.use_cpu_initialization:
            # The heads' values do not depend on the TP size: a full vector, of which this rank keeps its heads.
            master = torch.empty(config.num_attention_heads, dtype=torch.float32)
            config.init_method(master)
            with torch.no_grad():
                param.copy_(master[tp_rank * heads:(tp_rank + 1) * heads])
        self.softmax_offset = param

    def _uses_ring(self) -> bool:
        """Whether this layer's CP attention passes key/value blocks around a ring (no dropout there)."""
        if get_pg_size(self.cp_group) == 1 or self.cp_comm_type in ("all_gather", "a2a"):
            return False
        if self.cp_comm_type == "a2a+p2p":
            groups = self._hierarchical_groups()
            return bool(groups) and len(groups) == 2 and get_pg_size(groups[1]) > 1
        return True

    def _cp_group(self, packed_seq_params: Any = None) -> Any:
        """This call's CP group: ``packed_seq_params``'s under hybrid CP (see ``packed_cp_group``), else the layer's."""
        return packed_cp_group(packed_seq_params, self.cp_group)

    def _hierarchical_groups(self) -> list | None:
        return getattr(self.pg_collection, "hcp", None)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        """Attend ``query`` ``[sq, b, np, hn]`` to ``key``/``value`` ``[sk, b, ng, hn]``; returns ``[sq, b, np*hn]``."""
        mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        sq, b, np_, hn = query.shape
        dropout_p = self.dropout_p if self.training else 0.0
        cp_group = self._cp_group(packed_seq_params)
        cp_size = get_pg_size(cp_group)
        if packed_seq_params is not None or cp_size > 1:
            context = self._sharded_or_packed(
                query, key, value, attention_mask, mask_type, attention_bias, packed_seq_params, cp_group,
                cp_size, dropout_p,
            )
            return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)
        q = query.permute(1, 2, 0, 3)
        k = key.permute(1, 2, 0, 3)
        v = value.permute(1, 2, 0, 3)
        with self._rng(dropout_p):
            context = self._plain(q, k, v, attention_mask, mask_type, attention_bias, dropout_p)
        return context.permute(2, 0, 1, 3).reshape(sq, b, np_ * hn)

    def _rng(self, dropout_p: float) -> Any:
        if dropout_p > 0.0 and not self.config.sequence_parallel:
            return tensor_parallel.get_cuda_rng_tracker().fork()
        return contextlib.nullcontext()

    def _plain(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None,
        mask_type: AttnMaskType, attention_bias: torch.Tensor | None, dropout_p: float,
    ) -> torch.Tensor:
        sq, sk = q.shape[2], k.shape[2]
        keep, is_causal = sdpa_mask(mask_type, attention_mask, sq, sk, q.device)
        if self.window_size is not None:
            pattern = window_keep(sq, sk, self.window_size, True, q.device)
            keep = pattern if keep is None else keep & pattern
            is_causal = False
        if self.record_max_logits:
            self._record(max_logits(q, k, self.softmax_scale, keep, causal=is_causal))
        if attention_bias is not None:
            keep = _merge_bias(keep, attention_bias, is_causal, sq, sk, q.dtype, q.device)
            is_causal = False
        if self.softmax_offset is not None:
            return attend_with_sink(q, k, v, self.softmax_offset, scale=self.softmax_scale, mask=keep,
                                    is_causal=is_causal, dropout_p=dropout_p)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=keep, dropout_p=dropout_p, is_causal=is_causal, scale=self.softmax_scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )

    def _sharded_or_packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: torch.Tensor | None,
        mask_type: AttnMaskType, attention_bias: torch.Tensor | None, packed_seq_params: Any, cp_group: Any,
        cp_size: int, dropout_p: float,
    ) -> torch.Tensor:
        """Packed documents and/or context parallelism; returns ``[b, h, sq, d]``."""
        what = "packed sequences" if packed_seq_params is not None else "context parallelism"
        if self.softmax_offset is not None:
            raise ValueError(f"softmax_type={self.softmax_type!r} (attention sinks) is not supported with {what}")
        if attention_bias is not None:
            raise ValueError(f"attention_bias is not supported with {what}")
        causal = mask_type in _WINDOW_TYPES
        if attention_mask is not None and not (causal and self._ignorable_mask(attention_mask, query.shape[0],
                                                                               cp_group, cp_size)):
            raise ValueError(
                f"an explicit attention_mask (shape {tuple(attention_mask.shape)}) is not supported with {what} "
                f"(attn_mask_type={mask_type.name}); only the plain causal mask is accepted (it is then ignored)"
            )
        comm_type = self.cp_comm_type

        def run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            if cp_size == 1:
                return attend(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), causal=causal,
                              scale=self.softmax_scale, window=self.window_size, dropout_p=dropout_p)
            return context_parallel_attention(
                q, k, v, comm_type=comm_type, cp_group=cp_group, hierarchical_groups=self._hierarchical_groups(),
                causal=causal, window=self.window_size, scale=self.softmax_scale, dropout_p=dropout_p,
            )

        with self._rng(dropout_p):
            if packed_seq_params is None:
                if self.record_max_logits:
                    self._record_unpadded(query, key, causal, cp_group, cp_size)
                return run(query, key, value)
            return self._packed(query, key, value, packed_seq_params, cp_size, causal, run)

    def _record(self, batch_max: torch.Tensor) -> None:
        self.current_max_attn_logits = update_running_max(self.current_max_attn_logits, batch_max)

    def _record_unpadded(self, q: torch.Tensor, k: torch.Tensor, causal: bool, cp_group: Any, cp_size: int) -> None:
        """The maxima of ``q`` / ``k`` ``[s, b, heads, d]`` (one packed document, or this CP rank's tokens)."""
        if cp_size > 1:
            self._record(context_parallel_max_logits(q, k, cp_group, self.softmax_scale, causal, self.window_size))
            return
        sq, sk = q.shape[0], k.shape[0]
        keep = None
        if causal or self.window_size is not None:
            keep = window_keep(sq, sk, self.window_size, causal, q.device)
        self._record(max_logits(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), self.softmax_scale, keep))

    @staticmethod
    def _ignorable_mask(mask: torch.Tensor, sq: int, cp_group: Any, cp_size: int) -> bool:
        """The plain causal mask (this CP rank's rows of it under CP): the causal kernels replace it."""
        if cp_size == 1:
            return is_plain_causal_mask(mask, sq, sq)
        n, rank = cp_size, get_pg_rank(cp_group)
        c = sq // 2
        rows = list(range(rank * c, (rank + 1) * c)) + list(range((2 * n - 1 - rank) * c, (2 * n - rank) * c))
        return is_causal_rows(mask, rows, sq * n)

    def _packed(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, params: Any, cp_size: int, causal: bool,
        run: Any,
    ) -> torch.Tensor:
        sq, b = query.shape[:2]
        if b != 1:
            raise ValueError(f"packed sequences (qkv_format='thd') need micro-batch size 1, got {b}")
        if key.shape[0] != sq:
            raise ValueError("packed sequences support self-attention only (query and key lengths differ)")
        if cp_size > 1 and not causal:
            raise ValueError("packed sequences with context parallelism need a causal attention mask type")
        layout = thd_layout(params, sq * cp_size)
        outs, offset = [], 0
        for n_real, n_pad in zip(layout.lengths, layout.padded):
            local = n_pad // cp_size
            if cp_size > 1:
                if n_pad % (2 * cp_size) != 0:
                    raise ValueError(
                        f"packed document of padded length {n_pad} is not divisible by 2 * context_parallel_size "
                        f"({2 * cp_size}); pad documents with cu_seqlens_q_padded"
                    )
            if self.record_max_logits:  # without CP, over the document's real tokens only
                n_seen = local if cp_size > 1 else n_real
                self._record_unpadded(*(x[offset:offset + n_seen] for x in (query, key)), causal,
                                      self._cp_group(params), cp_size)
            if cp_size > 1:
                outs.append(run(*(x[offset:offset + local] for x in (query, key, value))))
            else:
                # Without CP, attend over the real tokens only; padding rows come out as zeros.
                n_use = n_real if not causal else n_pad
                if n_use > 0:
                    outs.append(run(*(x[offset:offset + n_use] for x in (query, key, value))))
                if n_pad > n_use:
                    outs.append(query.new_zeros(b, query.shape[2], n_pad - n_use, query.shape[3]))
            offset += local
        return torch.cat(outs, dim=2)


def _merge_bias(
    keep: torch.Tensor | None, bias: torch.Tensor | None, is_causal: bool, sq: int, sk: int, dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor | None:
    """An additive float mask: the bias plus -inf where masked."""
    if bias is None:
        return keep
    if is_causal:
        keep = torch.ones(sq, sk, dtype=torch.bool, device=device).tril(diagonal=sk - sq)
    additive = bias.to(dtype)
    if keep is not None:
        additive = additive.masked_fill(~keep, float("-inf"))
    return additive
