"""Where a reshard plan's pieces live in this library's dynamic context, and the layouts of a built model.

:class:`~megatron_core.inference.contexts.DynamicInferenceContext` keeps, per attention layer (keyed by its
global 1-based ``layer_number``), a key and a value buffer of token slots ``[slots, local KV heads, head_dim]``;
token ``p`` of a request lives in slot ``table[p // block_size] * block_size + p % block_size`` of its block
table. A hybrid model's Mamba layers keep one conv and one SSM state slot per request
(:mod:`~megatron_core.inference.contexts.mamba_states`). :class:`PagedKVCache` and :class:`MambaStateCache`
name those tensors in the planners' order (this rank's layers of the kind, ascending) with the slots of the
requests moved, so the executor (:mod:`.execute`) needs no knowledge of the context.

The planners count layers among the model's attention (or Mamba) layers only; :func:`kv_shard_layout` and
:func:`mamba_shard_layout` build this rank's layouts from its model, with explicit layer windows, so uneven
pipeline stages and hybrid patterns map to the right global layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_core._ground.groups import get_pg_rank, get_pg_size
from megatron_core._ground.hybrid_pattern import Symbols
from megatron_core._wrapped_model import get_attr_wrapped_model
from megatron_core.inference.contexts.kv_cache_sizing import kv_cache_head_shape
from megatron_core.inference.disaggregation.kv_reshard import KVShardLayout
from megatron_core.inference.disaggregation.mamba_reshard import MambaShardLayout, MambaStateDims
from megatron_core.ssm.mamba_mixer import MambaMixer
from megatron_core.transformer.attention import Attention

__all__ = ["MambaStateCache", "PagedKVCache", "admit_transferred_request", "attention_layer_numbers",
           "context_kv_cache", "context_mamba_states", "global_layer_numbers", "kv_shard_layout",
           "mamba_layer_numbers", "mamba_shard_layout"]

_ATTENTION_SYMBOLS = (Symbols.ATTENTION, Symbols.DS_ATTENTION, Symbols.MLA)


@dataclass
class PagedKVCache:
    """This rank's KV buffers in the planner's layer order, and the slots of the tokens moved.

    ``keys[i]`` / ``values[i]`` are local attention layer ``i``'s ``[slots, local KV heads, head_dim]`` buffers;
    ``slots`` ``[tokens]`` lists the moved requests' token slots, request after request, token after token.
    Both sides of a reshard must list the same requests with the same lengths in the same order.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    slots: torch.Tensor


@dataclass
class MambaStateCache:
    """This rank's Mamba states in the planner's layer order, and the slots of the requests moved.

    ``conv[i]`` ``[slots, conv channels, d_conv]`` and ``ssm[i]`` ``[slots, local heads, headdim, d_state]`` are
    local Mamba layer ``i``'s; ``slots`` ``[requests]`` the moved requests' state slots, in the order both sides
    agree on.
    """

    conv: list[torch.Tensor]
    ssm: list[torch.Tensor]
    slots: torch.Tensor


def _decoder(model: Any) -> Any:
    return get_attr_wrapped_model(model, "decoder")


def attention_layer_numbers(model: Any) -> list[int]:
    """Global 1-based ``layer_number`` s of this rank's decoder attention layers (the keys of its KV cache)."""
    return sorted({m.layer_number for m in _decoder(model).modules() if isinstance(m, Attention)})


def mamba_layer_numbers(model: Any) -> list[int]:
    """Global 1-based ``layer_number`` s of this rank's decoder Mamba layers (the keys of its Mamba states)."""
    return sorted({m.layer_number for m in _decoder(model).modules() if isinstance(m, MambaMixer)})


def global_layer_numbers(model: Any) -> tuple[list[int], list[int]]:
    """``(attention, Mamba)`` layer numbers of the whole decoder, every pipeline stage: from a hybrid model's
    ``hybrid_layer_pattern``, else (a GPT model) every one of ``config.num_layers`` layers is attention."""
    pattern = getattr(model, "hybrid_layer_pattern", None)
    if pattern is None:
        return list(range(1, get_attr_wrapped_model(model, "config").num_layers + 1)), []
    symbols = pattern.split(Symbols.MTP_SEPARATOR)[0].replace(Symbols.PIPE, "")
    return ([i + 1 for i, s in enumerate(symbols) if s in _ATTENTION_SYMBOLS],
            [i + 1 for i, s in enumerate(symbols) if s == Symbols.MAMBA])


def _window(everywhere: list[int], local: list[int], stage_numbers: list[int], kind: str) -> tuple[int, int]:
    """``(first global index, count)`` of ``local`` among ``everywhere``; ``ValueError`` if not a contiguous run."""
    first = min(stage_numbers, default=1)
    start = sum(n < first for n in everywhere)
    if local != everywhere[start : start + len(local)]:
        raise ValueError(f"{kind} layers {local} of this rank are not consecutive {kind} layers of the model "
                         f"({everywhere})")
    return start, len(local)


def _groups(model: Any, pg_collection: Any) -> tuple[int, int, int, int]:
    """``(tp size, tp rank, pp size, pp rank)`` of ``pg_collection`` (default: the model's)."""
    pgs = pg_collection if pg_collection is not None else get_attr_wrapped_model(model, "pg_collection")
    tp, pp = getattr(pgs, "tp", None), getattr(pgs, "pp", None)
    return get_pg_size(tp), get_pg_rank(tp), get_pg_size(pp), get_pg_rank(pp)


def _global_rank(global_rank: int | None) -> int:
    if global_rank is not None:
        return global_rank
    return dist.get_rank() if dist.is_initialized() else 0


def kv_shard_layout(model: Any, pg_collection: Any = None, global_rank: int | None = None) -> KVShardLayout:
    """This rank's :class:`KVShardLayout` for ``model`` (its tensor- and pipeline-parallel groups from
    ``pg_collection``, default the model's; ``global_rank`` defaults to ``torch.distributed``'s rank)."""
    tp_size, tp_rank, pp_size, pp_rank = _groups(model, pg_collection)
    config = get_attr_wrapped_model(model, "config")
    everywhere, _ = global_layer_numbers(model)
    stage = [layer.layer_number for layer in _decoder(model).layers]
    start, count = _window(everywhere, attention_layer_numbers(model), stage, "attention")
    return KVShardLayout(num_layers=len(everywhere), num_heads=kv_cache_head_shape(config, 1)[0], tp_size=tp_size,
                         tp_rank=tp_rank, pp_size=pp_size, pp_rank=pp_rank, global_rank=_global_rank(global_rank),
                         layer_start=start, num_local_layers=count)


def mamba_shard_layout(model: Any, pg_collection: Any = None, global_rank: int | None = None) -> MambaShardLayout:
    """This rank's :class:`MambaShardLayout` for a hybrid ``model`` (dims from its first Mamba mixer;
    ``ValueError`` when this rank has none, or the model none at all)."""
    mixers = [m for m in _decoder(model).modules() if isinstance(m, MambaMixer)]
    _, everywhere = global_layer_numbers(model)
    if not mixers:
        raise ValueError("mamba_shard_layout: this rank's decoder has no Mamba layer")
    tp_size, tp_rank, _, _ = _groups(model, pg_collection)
    stage = [layer.layer_number for layer in _decoder(model).layers]
    start, count = _window(everywhere, mamba_layer_numbers(model), stage, "Mamba")
    m = mixers[0]
    dims = MambaStateDims(nheads=m.nheads, headdim=m.headdim, d_state=m.d_state, ngroups=m.ngroups, d_conv=m.d_conv)
    return MambaShardLayout(global_rank=_global_rank(global_rank), tp_size=tp_size, tp_rank=tp_rank,
                            layer_start=start, num_layers=count, dims=dims)


def _token_slots(context: Any, request_ids: Sequence[Any], device: torch.device) -> torch.Tensor:
    """The slots of every cached token of ``request_ids``, in order."""
    bs = context.block_size_tokens
    slots = []
    for rid in request_ids:
        blocks = torch.tensor(context.request_blocks[rid], dtype=torch.long)
        positions = torch.arange(context.kv_length(rid))
        slots.append(blocks[positions // bs] * bs + positions % bs)
    return torch.cat(slots).to(device) if slots else torch.empty(0, dtype=torch.long, device=device)


def context_kv_cache(context: Any, layer_numbers: Sequence[int], request_ids: Sequence[Any],
                     dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> PagedKVCache:
    """The KV buffers of ``layer_numbers`` (see :func:`attention_layer_numbers`) of a dynamic ``context`` and
    the slots of ``request_ids``' cached tokens (``kv_length`` of each).

    A layer that has not run yet gets its buffers now (zeroed), in ``dtype`` on ``device``; they default to
    those of the layers that have run, else ``InferenceConfig.kv_cache_dtype`` (else float32) and the context's
    device (else the CPU). A fresh receiving context of a model not in float32 needs ``dtype``: the model's
    first step would otherwise find buffers of another dtype.
    """
    existing = next(iter(context.kv_memory.values()), (None,))[0]
    if existing is not None:
        dtype, device = dtype or existing.dtype, device or existing.device
    device = torch.device(device or context.device or "cpu")
    like = torch.empty(0, dtype=dtype or context.inference_config.kv_cache_dtype or torch.float32, device=device)
    keys, values = [], []
    for layer in layer_numbers:
        key, value = context._layer_memory(layer, context.num_groups_local, context.head_dim, like)
        keys.append(key)
        values.append(value)
    return PagedKVCache(keys, values, _token_slots(context, request_ids, keys[0].device if keys else device))


def context_mamba_states(context: Any, layer_numbers: Sequence[int], request_ids: Sequence[Any],
                         device: torch.device | str | None = None) -> MambaStateCache:
    """The Mamba states of ``layer_numbers`` (see :func:`mamba_layer_numbers`) of a hybrid dynamic ``context``
    and the state slots of ``request_ids`` (states not yet used are allocated zeroed on ``device``)."""
    if context.mamba_slots is None:
        raise ValueError("context_mamba_states: the context has no Mamba states (InferenceConfig."
                         "mamba_inference_state_config is None)")
    device = torch.device(device or context.device or "cpu")
    conv, ssm = zip(*(context.mamba_slots.states(layer, device) for layer in layer_numbers)) if layer_numbers \
        else ((), ())
    slots = torch.tensor([context.mamba_slots.slot(rid) for rid in request_ids], dtype=torch.long,
                         device=conv[0].device if conv else device)
    return MambaStateCache(list(conv), list(ssm), slots)


def admit_transferred_request(context: Any, request_id: Any, num_tokens: int) -> None:
    """Register ``request_id`` in a destination ``context`` with blocks (and a Mamba slot) for ``num_tokens``
    cached tokens, to be filled by a reshard; afterwards it decodes from position ``num_tokens``.

    ``RuntimeError`` when the context has too few free blocks (the request is not admitted).
    """
    context.add_request(request_id)
    if not context.grow_request(request_id, num_tokens):
        context.release_request(request_id)
        raise RuntimeError(f"admit_transferred_request: request {request_id} needs "
                           f"{context.blocks_for_tokens(num_tokens)} KV blocks for {num_tokens} tokens, but only "
                           f"{context.block_allocator.get_active_avail()} are free")
    context.request_kv_length[request_id] = num_tokens
