"""All-to-all context parallelism of the Mamba mixer (Megatron-Core's ``ssm.mamba_context_parallel``).

The sequence arrives split over the CP ranks in the attention layers' load-balanced order (CP rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``). The causal convolution and the SSD scan need the whole sequence,
so :meth:`MambaContextParallel.pre_conv_ssm` trades sequence for channels with one all-to-all (Megatron-Core runs
one per part of ``in_proj``'s output; here the parts travel together): afterwards each CP rank holds the FULL
sequence (in natural order) for ``1/cp`` of this TP rank's heads: the matching slices of ``z``, ``x`` and ``dt``,
and the ``B``/``C`` state of the groups those heads read. When a TP rank has fewer groups than CP ranks, each
group's ``B``/``C`` is repeated so that consecutive CP ranks share it. :meth:`MambaContextParallel.post_conv_ssm`
restores the load-balanced order and brings the result back to sequence-split, all heads.

Every CP rank keeps the whole TP-local ``conv1d``, ``dt_bias``, ``A_log`` and ``D`` and uses the slice of its
heads, cut in the forward pass: each rank's gradient is non-zero only on its slice, and the data-parallel
gradient reduction over the DP x CP group sums the slices into the full gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.tensor_parallel.mappings import all_to_all_hp2sp, all_to_all_sp2hp

__all__ = ["MambaContextParallel"]


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


class MambaContextParallel:
    """Head-sharding of one Mamba mixer over its CP group: sizes, the all-to-alls, and this rank's parameter slices.

    It holds no parameters of its own (no checkpoint entries): ``*_cp1`` are the mixer's TP-local parameters,
    which are the same on every CP rank. ``cp_group`` may be ``None`` (no context parallelism).
    """

    def __init__(self, cp_group: Any, d_inner_local_tp: int, nheads_local_tp: int, ngroups_local_tp: int,
                 d_state: int, conv1d_weight_cp1: torch.Tensor, conv1d_bias_cp1: torch.Tensor, conv1d_padding: int,
                 dt_bias_cp1: torch.Tensor, A_log_cp1: torch.Tensor, D_cp1: torch.Tensor, D_has_hdim: bool) -> None:
        self.cp_group = cp_group
        self.d_inner_local_tp, self.nheads_local_tp = d_inner_local_tp, nheads_local_tp
        self.ngroups_local_tp, self.d_state = ngroups_local_tp, d_state
        self.conv1d_weight_cp1, self.conv1d_bias_cp1, self.conv1d_padding = (conv1d_weight_cp1, conv1d_bias_cp1,
                                                                             conv1d_padding)
        self.dt_bias_cp1, self.A_log_cp1, self.D_cp1, self.D_has_hdim = dt_bias_cp1, A_log_cp1, D_cp1, D_has_hdim
        self.cp_size = get_pg_size(cp_group)
        self.cp_rank = get_pg_rank(cp_group)
        cp = self.cp_size
        _check(nheads_local_tp % cp == 0,
               f"the Mamba heads of a tensor-parallel rank ({nheads_local_tp}) must be divisible by the "
               f"context-parallel size ({cp}): the number of heads must be divisible by "
               "tensor_model_parallel_size * context_parallel_size")
        self.nheads_local_tpcp = nheads_local_tp // cp
        self.d_inner_local_tpcp = d_inner_local_tp // cp
        if ngroups_local_tp >= cp:
            _check(ngroups_local_tp % cp == 0,
                   f"the Mamba groups of a tensor-parallel rank ({ngroups_local_tp}) must be divisible by the "
                   f"context-parallel size ({cp}) when there are at least as many: mamba_num_groups must be "
                   "divisible by tensor_model_parallel_size * context_parallel_size")
            self.group_repeat_count = 1
            self.ngroups_local_tpcp = ngroups_local_tp // cp
        else:
            _check(cp % ngroups_local_tp == 0,
                   f"the context-parallel size ({cp}) must be divisible by the Mamba groups of a tensor-parallel "
                   f"rank ({ngroups_local_tp}) when there are fewer groups than CP ranks (each group's state is "
                   "then shared by consecutive CP ranks)")
            self.group_repeat_count = cp // ngroups_local_tp
            self.ngroups_local_tpcp = 1

    def pre_conv_ssm(self, input_: torch.Tensor, packed_seq_params: Any = None) -> torch.Tensor:
        """``zxBCdt`` ``[l / cp, b, .]`` of this TP rank, load-balanced -> ``[l, b, .]`` of this CP rank's heads,
        in natural sequence order (``z, x, B, C, dt`` stacked as before, each its CP slice)."""
        if self.cp_size == 1:
            return input_
        self._check_input(input_, packed_seq_params, "pre_conv_ssm")
        bc = self.ngroups_local_tp * self.d_state
        z, x, B, C, dt = torch.split(
            input_, [self.d_inner_local_tp, self.d_inner_local_tp, bc, bc, self.nheads_local_tp], dim=-1)
        length, batch, _ = input_.shape
        parts = [z, x, self._repeat_groups(B), self._repeat_groups(C), dt]
        # One all-to-all for all five parts: lay the channels out destination-major, so that CP rank j's chunk
        # is [z_j, x_j, B_j, C_j, dt_j], which is also the layout the convolution and scan read.
        by_rank = torch.cat([part.reshape(length, batch, self.cp_size, -1) for part in parts], dim=-1)
        out = _all_to_all_cp2hp(by_rank.reshape(length, batch, -1), self.cp_group)
        return _undo_attention_load_balancing(out, self.cp_size)

    def post_conv_ssm(self, input_: torch.Tensor, packed_seq_params: Any = None) -> torch.Tensor:
        """``[l, b, h / cp]`` in natural order (this CP rank's channels) -> ``[l / cp, b, h]`` load-balanced."""
        if self.cp_size == 1:
            return input_
        self._check_input(input_, packed_seq_params, "post_conv_ssm")
        return _all_to_all_hp2cp(_redo_attention_load_balancing(input_, self.cp_size), self.cp_group)

    def conv1d(self, input_: torch.Tensor) -> torch.Tensor:
        """Depthwise ``F.conv1d`` of ``[b, channels, l]`` with this CP rank's weight slice, padded on both sides
        by ``conv1d_padding`` (keep the first ``l`` outputs for the causal convolution)."""
        return F.conv1d(input_, self.get_conv1d_weight(), self.get_conv1d_bias(), padding=self.conv1d_padding,
                        groups=self.conv1d_channels())

    def conv1d_channels(self) -> int:
        """Channels of this CP rank's convolution: its parts of ``x``, ``B`` and ``C``."""
        return self.d_inner_local_tpcp + 2 * self.ngroups_local_tpcp * self.d_state

    def get_conv1d_weight(self) -> torch.Tensor:
        """This CP rank's rows of the convolution weight ``[channels, 1, d_conv]``."""
        return self._slice_conv_param(self.conv1d_weight_cp1)

    def get_conv1d_bias(self) -> torch.Tensor:
        """This CP rank's entries of the convolution bias."""
        return self._slice_conv_param(self.conv1d_bias_cp1)

    def get_dt_bias(self) -> torch.Tensor:
        """This CP rank's heads of ``dt_bias``."""
        return self._slice_vector_param(self.dt_bias_cp1)

    def get_A_log(self) -> torch.Tensor:
        """This CP rank's heads of ``A_log``."""
        return self._slice_vector_param(self.A_log_cp1)

    def get_D(self) -> torch.Tensor:
        """This CP rank's part of ``D`` (per head, or per channel with ``D_has_hdim``)."""
        return self._slice_vector_param(self.D_cp1, has_hdim=self.D_has_hdim)

    def _slice_conv_param(self, param: torch.Tensor) -> torch.Tensor:
        """This CP rank's rows of a TP-local convolution parameter stacked as ``[x, B, C]`` along dim 0.

        Sliced in the forward pass (the mixer passes its current parameter) so the gradient lands in the
        full parameter.
        """
        if self.cp_size == 1:
            return param
        bc = self.ngroups_local_tp * self.d_state
        x, B, C = torch.split(param, [self.d_inner_local_tp, bc, bc], dim=0)
        x_size, bc_size = self.d_inner_local_tpcp, self.ngroups_local_tpcp * self.d_state
        bc_start = (self.cp_rank // self.group_repeat_count) * bc_size
        x_start = self.cp_rank * x_size
        return torch.cat([x[x_start:x_start + x_size], B[bc_start:bc_start + bc_size],
                          C[bc_start:bc_start + bc_size]], dim=0)

    def _slice_vector_param(self, param: torch.Tensor, has_hdim: bool = False) -> torch.Tensor:
        """This CP rank's heads (or, with ``has_hdim``, channels) of a TP-local per-head parameter."""
        if self.cp_size == 1:
            return param
        size = self.d_inner_local_tpcp if has_hdim else self.nheads_local_tpcp
        return param[self.cp_rank * size:(self.cp_rank + 1) * size]

    def _repeat_groups(self, state: torch.Tensor) -> torch.Tensor:
        """``[l, b, g * n]`` -> ``[l, b, g * r * n]``: each group's state ``r`` times in a row, so that after the
        all-to-all the CP ranks holding a group's heads hold that group's state."""
        if self.group_repeat_count == 1:
            return state
        length, batch, _ = state.shape
        grouped = state.reshape(length, batch, self.ngroups_local_tp, 1, self.d_state)
        return grouped.expand(-1, -1, -1, self.group_repeat_count, -1).reshape(length, batch, -1)

    def _check_input(self, input_: torch.Tensor, packed_seq_params: Any, where: str) -> None:
        if packed_seq_params is not None:
            raise NotImplementedError(f"MambaContextParallel.{where}: packed sequences (packed_seq_params) are not "
                                      "supported with context parallelism by this library")
        _check(input_.dim() == 3, f"MambaContextParallel.{where}: input must be [s, b, h], got shape "
                                  f"{tuple(input_.shape)}")
        length = input_.shape[0] * (self.cp_size if where == "pre_conv_ssm" else 1)
        _check(length % (2 * self.cp_size) == 0,
               f"MambaContextParallel.{where}: the full sequence length ({length}) must be divisible by "
               f"2 * context_parallel_size ({2 * self.cp_size}), the load-balanced chunks of the CP split")


def _all_to_all_cp2hp(input_: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``[l / cp, b, h]`` (sequence-split) -> ``[l, b, h / cp]`` (channel-split; rank ``j``'s sequence part ``j``-th).

    Autograd: the backward is the inverse all-to-all.
    """
    length, batch, hidden = input_.shape
    cp = get_pg_size(cp_group)
    _check(hidden % cp == 0, f"all-to-all over CP: the channel dim ({hidden}) must be divisible by the "
                             f"context-parallel size ({cp})")
    return all_to_all_sp2hp(input_, group=cp_group).reshape(length * cp, batch, hidden // cp)


def _all_to_all_hp2cp(input_: torch.Tensor, cp_group: Any) -> torch.Tensor:
    """``[l, b, h / cp]`` (channel-split) -> ``[l / cp, b, h]`` (rank ``j`` gets sequence part ``j``): the inverse
    of :func:`_all_to_all_cp2hp`. Autograd: the backward is that all-to-all."""
    length, batch, hidden = input_.shape
    cp = get_pg_size(cp_group)
    _check(length % cp == 0, f"all-to-all over CP: the sequence length ({length}) must be divisible by the "
                             f"context-parallel size ({cp})")
    return all_to_all_hp2sp(input_, group=cp_group).reshape(length // cp, batch, hidden * cp)


def _load_balanced_order(cp_size: int) -> list[int]:
    """The natural chunk index at each of the ``2 cp`` positions of the CP ranks' concatenated parts:
    ``[0, 2cp-1, 1, 2cp-2, ...]`` (rank ``r`` holds chunks ``r`` and ``2cp-1-r``)."""
    order = []
    for rank in range(cp_size):
        order += [rank, 2 * cp_size - 1 - rank]
    return order


def _undo_attention_load_balancing(input_: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The CP ranks' concatenated load-balanced parts (dim 0) -> the sequence in natural order."""
    chunks = torch.chunk(input_, 2 * cp_size, dim=0)
    position = {chunk: pos for pos, chunk in enumerate(_load_balanced_order(cp_size))}
    return torch.cat([chunks[position[i]] for i in range(2 * cp_size)], dim=0)


def _redo_attention_load_balancing(input_: torch.Tensor, cp_size: int) -> torch.Tensor:
    """The sequence in natural order (dim 0) -> the CP ranks' load-balanced parts, concatenated."""
    chunks = torch.chunk(input_, 2 * cp_size, dim=0)
    return torch.cat([chunks[i] for i in _load_balanced_order(cp_size)], dim=0)
