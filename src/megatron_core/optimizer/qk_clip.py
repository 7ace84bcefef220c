"""QK-clip after an optimizer step (MuonClip): ``clip_qk(model, log_max_only=False)``, as Megatron-Core's.

Each decoder layer's core attention records the largest pre-softmax logit of each of its heads during the
step's forwards (``TransformerConfig.qk_clip`` or ``log_max_attention_logit``). ``clip_qk`` takes the maximum of
those records over the data-parallel x context-parallel group, rescales the query/key weights of the heads over
``qk_clip_threshold`` (``SelfAttention.clip_qk`` / ``MLASelfAttention.clip_qk``), clears the records and returns
the largest logit of the model chunks as a float (0.0 when none was recorded).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from megatron_core._ground import module_chain
from megatron_core.process_groups_config import resolve_process_group

__all__ = ["clip_qk"]


def _decoder_layers(model_chunk: torch.nn.Module) -> Iterable[torch.nn.Module]:
    """The decoder layers of a model chunk, looking through wrappers (``DistributedDataParallel``,
    ``Float16Module``, ...) by their ``module`` attribute; Megatron-Core reads ``model_chunk.module.module``."""
    decoder = next((m.decoder for m in module_chain(model_chunk) if hasattr(m, "decoder")), None)
    if decoder is None:
        raise ValueError(f"clip_qk: found no decoder in model chunk {type(model_chunk).__name__} "
                         "(expected a GPTModel-like module, possibly wrapped in modules with a 'module' attribute)")
    return decoder.layers


def _reduce_group() -> Any:
    """The data-parallel x context-parallel group, or None when there is nothing to reduce over."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return None
    return resolve_process_group("dp_cp")


def clip_qk(model: torch.nn.Module | list[torch.nn.Module], log_max_only: bool = False) -> float:
    """Apply QK-clip to every decoder layer of ``model`` (a model chunk or a list of them); returns the max logit.

    With ``log_max_only`` the weights are left alone and the records are only read (and cleared). Layers without
    a record (no forward since the last call, or recording off) are skipped. Without initialized model parallel
    groups the records are used as they are (no all-reduce).
    """
    chunks = [model] if isinstance(model, torch.nn.Module) else list(model)
    group = _reduce_group()
    largest = 0.0
    with torch.no_grad():
        for chunk in chunks:
            for layer in _decoder_layers(chunk):
                attention = getattr(layer, "self_attention", None)
                if not hasattr(attention, "clip_qk"):
                    continue
                core = attention.core_attention
                logits = getattr(core, "current_max_attn_logits", None)
                if logits is None:
                    continue
                if group is not None:
                    torch.distributed.all_reduce(logits, op=torch.distributed.ReduceOp.MAX, group=group)
                largest = max(largest, torch.max(logits).item())
                if log_max_only:
                    core.current_max_attn_logits = None
                else:
                    attention.clip_qk()
    return largest
