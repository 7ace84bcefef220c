"""Context parallelism of the gated delta net: all-to-alls between sequence-split and head-split activations.

Megatron-Core's ``tensor_a2a_cp2hp`` / ``tensor_a2a_hp2cp`` / ``get_parameter_local_cp``. Before the recurrence
each CP rank trades its part of the sequence (load-balanced: chunks ``r`` and ``2cp-1-r``) for the whole sequence
of ``1/cp`` of every section's heads; afterwards the inverse trade. The collectives are the Mamba mixer's
(:mod:`megatron_core.ssm.mamba_context_parallel`). For packed sequences the split is per document
(:func:`~megatron_core.transformer.packed_sequences.thd_partitioned_indices`), so the gathered tokens are put in
document order by one index permutation (:func:`thd_cp_gather_order`).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.ssm.mamba_context_parallel import (
    _all_to_all_cp2hp,
    _all_to_all_hp2cp,
    _redo_attention_load_balancing,
    _undo_attention_load_balancing,
)
from megatron_core.transformer.packed_sequences import thd_layout, thd_partitioned_indices

__all__ = ["get_parameter_local_cp", "head_perm_for_split_sections", "tensor_a2a_cp2hp", "tensor_a2a_hp2cp",
           "thd_cp_gather_order"]


def get_parameter_local_cp(param: torch.Tensor, dim: int, cp_group: Any,
                           split_sections: list[int] | None = None) -> torch.Tensor:
    """This CP rank's ``1/cp`` slice of ``param`` along ``dim`` (of each of ``split_sections`` when given, the
    slices concatenated). Slicing keeps autograd, so the gradient lands in the whole parameter."""
    cp, rank = get_pg_size(cp_group), get_pg_rank(cp_group)
    if cp == 1:
        return param
    if split_sections is not None:
        return torch.cat([get_parameter_local_cp(part, dim, cp_group)
                          for part in torch.split(param, list(split_sections), dim=dim)], dim=dim)
    size = param.shape[dim]
    if size % cp != 0:
        raise ValueError(f"get_parameter_local_cp: dim {dim} of the parameter ({size}) must be divisible by the "
                         f"context-parallel size ({cp})")
    return param.narrow(dim, rank * (size // cp), size // cp)


def _check_layout(tensor: torch.Tensor, seq_dim: int, head_dim: int, where: str) -> None:
    if seq_dim != 0 or head_dim not in (-1, 2) or tensor.dim() != 3:
        raise ValueError(f"{where}: only [s, b, h] tensors with seq_dim=0 and head_dim=-1 (or 2) are supported, got "
                         f"shape {tuple(tensor.shape)}, seq_dim={seq_dim}, head_dim={head_dim}")


def tensor_a2a_cp2hp(tensor: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any,
                     split_sections: list[int] | None = None,
                     undo_attention_load_balancing: bool = True) -> torch.Tensor:
    """``[s/cp, b, h]`` (this CP rank's part of the sequence) -> ``[s, b, h/cp]`` (the whole sequence, this rank's
    ``1/cp`` of each of ``split_sections``, else of ``h``), in natural order unless
    ``undo_attention_load_balancing`` is False (then the ranks' parts one after the other)."""
    cp = get_pg_size(cp_group)
    if cp == 1:
        return tensor
    _check_layout(tensor, seq_dim, head_dim, "tensor_a2a_cp2hp")
    if split_sections is not None:
        out = torch.cat([_all_to_all_cp2hp(part, cp_group)
                         for part in torch.split(tensor, list(split_sections), dim=-1)], dim=-1)
    else:
        out = _all_to_all_cp2hp(tensor, cp_group)
    return _undo_attention_load_balancing(out, cp) if undo_attention_load_balancing else out


def tensor_a2a_hp2cp(tensor: torch.Tensor, seq_dim: int, head_dim: int, cp_group: Any,
                     split_sections: list[int] | None = None,
                     redo_attention_load_balancing: bool = True) -> torch.Tensor:
    """The inverse of :func:`tensor_a2a_cp2hp`: ``[s, b, h/cp]`` -> ``[s/cp, b, h]`` (``split_sections`` are the
    local sections of ``h/cp``)."""
    cp = get_pg_size(cp_group)
    if cp == 1:
        return tensor
    _check_layout(tensor, seq_dim, head_dim, "tensor_a2a_hp2cp")
    if redo_attention_load_balancing:
        tensor = _redo_attention_load_balancing(tensor, cp)
    if split_sections is not None:
        return torch.cat([_all_to_all_hp2cp(part, cp_group)
                          for part in torch.split(tensor, list(split_sections), dim=-1)], dim=-1)
    return _all_to_all_hp2cp(tensor, cp_group)


@lru_cache(maxsize=16)
def head_perm_for_split_sections(split_sections: tuple[int, ...], cp_size: int,
                                 device: Any = None) -> torch.Tensor:
    """Channel order that lays sections out CP-rank-major: ``[s0 part 0, s1 part 0, ..., s0 part 1, ...]``, so one
    all-to-all of the permuted tensor gives each rank its part of every section (cached per sections, size, device)."""
    bad = [size for size in split_sections if size % cp_size]
    if bad:
        raise ValueError(f"the sections {list(split_sections)} must each be divisible by the context-parallel size "
                         f"({cp_size})")
    offsets = torch.tensor([0, *split_sections], device=device).cumsum(0)[:-1].tolist()
    per_rank = [torch.arange(start, start + size, device=device).view(cp_size, -1)
                for start, size in zip(offsets, split_sections)]
    return torch.cat(per_rank, dim=-1).reshape(-1)


def thd_cp_gather_order(packed_seq_params: Any, total_tokens: int, cp_size: int,
                        device: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """For packed documents split over CP: ``(to_documents, to_ranks)``, index permutations of dim 0 taking the
    ranks' concatenated parts (after :func:`tensor_a2a_cp2hp` without load-balancing undo) to document order and
    back."""
    layout = thd_layout(packed_seq_params, total_tokens)
    gathered = torch.tensor([i for rank in range(cp_size) for i in thd_partitioned_indices(layout, cp_size, rank)],
                            dtype=torch.long, device=device)
    return torch.argsort(gathered), gathered
