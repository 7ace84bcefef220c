"""Broadcast a micro-batch from tensor-parallel rank 0 to the other TP ranks (``utils.get_batch_on_this_tp_rank``).

TP rank 0 reads the data; the other ranks of its TP group allocate receive buffers of the agreed
shapes and take the tensors by broadcast. Which tensors travel depends on the pipeline stage:
every stage of a PP=1 model (or one with MTP layers) needs all of them, the first stage only the
inputs, the last only labels and loss mask, a middle stage only packed-sequence metadata.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import device


def get_batch_on_this_tp_rank(
    batch: dict[str, Any],
    has_cu_seqlens: bool,
    is_hybrid_cp: bool,
    create_attention_mask_in_dataloader: bool,
    broadcast_src_rank: int,
    broadcast_group: Any,
    cp_size: int,
    tp_rank: int,
    micro_batch_size: int,
    seq_length: int,
    mtp_on_this_rank: bool,
    pipeline_model_parallel_size: int = 1,
    is_pipeline_first_stage: bool = False,
    is_pipeline_last_stage: bool = False,
) -> dict[str, Any]:
    """Return the batch on every TP rank: rank 0's ``batch`` sent to the others of ``broadcast_group``.

    Keys: tokens, labels, loss_mask, position_ids (``[micro_batch_size, seq_length]``), attention_mask
    (``[mbs, 1, s, s]`` bool, when made by the data loader), cu_seqlens / cu_seqlens_padded / max_seqlen
    (packed sequences), local_cp_size (hybrid CP) and hybrid_cp_group (None). ``broadcast_src_rank`` is
    the global rank of TP rank 0.
    """
    dev = device.get_current_device()

    def bcast(tensor: torch.Tensor | None) -> None:
        if tensor is not None:
            torch.distributed.broadcast(tensor, broadcast_src_rank, group=broadcast_group)

    if pipeline_model_parallel_size == 1 or mtp_on_this_rank:
        stage = "all"
    elif is_pipeline_first_stage:
        stage = "first"
    elif is_pipeline_last_stage:
        stage = "last"
    else:
        stage = "middle"
    sends_inputs = stage in ("all", "first")
    sends_targets = stage in ("all", "last")
    sends_seqlens = has_cu_seqlens or (is_hybrid_cp and stage == "all")
    sends_mask = create_attention_mask_in_dataloader and stage != "middle"

    def bcast_cu_seqlens(value: torch.Tensor | None) -> torch.Tensor | None:
        """Length-prefixed broadcast: numel first, then the int32 tensor (2-D ``[mbs, n/mbs]`` on receivers)."""
        count = torch.tensor(0 if value is None else value.numel(), dtype=torch.int64, device=dev)
        bcast(count)
        n = int(count.item())
        if n == 0:
            return None
        if tp_rank == 0:
            if value.dtype != torch.int32:
                raise ValueError(f"get_batch_on_this_tp_rank: cu_seqlens must be int32, got {value.dtype}")
            bcast(value)
            return value
        if n % micro_batch_size:
            raise ValueError(f"cu_seqlens numel {n} is not divisible by micro_batch_size {micro_batch_size}")
        received = torch.empty((micro_batch_size, n // micro_batch_size), dtype=torch.int32, device=dev)
        bcast(received)
        return received

    if tp_rank == 0:
        if is_hybrid_cp:
            bcast(torch.tensor(batch["tokens"].shape[1], dtype=torch.int32, device=dev))
        out = dict(batch)
        if stage == "middle" and not has_cu_seqlens:
            return out
        if not sends_inputs:
            out["tokens"] = out["position_ids"] = None
        if not sends_targets:
            out["labels"] = out["loss_mask"] = None
        if stage == "middle" and has_cu_seqlens:
            out["attention_mask"] = None
    else:
        if is_hybrid_cp:
            length = torch.tensor(0, dtype=torch.int32, device=dev)
            bcast(length)
            seq_length = int(length.item())
        shape = (micro_batch_size, seq_length)
        out = {
            "tokens": torch.empty(shape, dtype=torch.int64, device=dev) if sends_inputs else None,
            "labels": torch.empty(shape, dtype=torch.int64, device=dev) if sends_targets else None,
            "loss_mask": torch.empty(shape, dtype=torch.float32, device=dev) if sends_targets else None,
            "position_ids": torch.empty(shape, dtype=torch.int64, device=dev) if sends_inputs else None,
            "attention_mask": (torch.empty((micro_batch_size, 1, seq_length, seq_length), dtype=torch.bool,
                                           device=dev) if sends_mask else None),
            "cu_seqlens": None,
            "cu_seqlens_padded": None,
            "max_seqlen": torch.empty(micro_batch_size, dtype=torch.int32, device=dev) if sends_seqlens else None,
            "local_cp_size": (torch.empty(1, dtype=torch.int32, device=dev)
                              if is_hybrid_cp and stage == "all" else None),
            "hybrid_cp_group": None,
        }
    if stage == "middle" and not has_cu_seqlens:
        return out
    if sends_inputs:
        bcast(out["tokens"])
    if sends_targets:
        bcast(out["labels"])
        bcast(out["loss_mask"])
    if sends_inputs:
        bcast(out["position_ids"])
    if sends_seqlens:
        out["cu_seqlens"] = bcast_cu_seqlens(out.get("cu_seqlens"))
        bcast(out["max_seqlen"])
        if cp_size > 1:
            out["cu_seqlens_padded"] = bcast_cu_seqlens(out.get("cu_seqlens_padded"))
    if sends_mask:
        bcast(out["attention_mask"])
    if is_hybrid_cp and stage == "all":
        bcast(out["local_cp_size"])
    return out
