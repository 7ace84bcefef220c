"""Rotary position embedding angles (Megatron-Core's ``RotaryEmbedding``).

``RotaryEmbedding(kv_channels, rotary_percent, ...)(seq_len)`` returns the angles
``[s, 1, 1, rot_dim]`` that ``apply_rotary_pos_emb`` consumes; ``rot_dim = kv_channels *
rotary_percent``. ``inv_freq`` is a plain fp32 attribute, not a buffer: it is not in the state
dict (as in Megatron-Core) and a bf16 cast of the model does not round it. Results are cached
per (sequence length, offset, device, packed).

Under context parallelism (a ``cp_group`` of size ``cp`` > 1) the angles cover the whole sequence
and this rank keeps chunks ``r`` and ``2 * cp - 1 - r`` of ``2 * cp`` (the load-balanced split
of ``get_batch_on_this_cp_rank``); for packed sequences (``packed_seq=True``) they are not split:
``apply_rotary_pos_emb`` picks each token's in-document position.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core._ground import get_pg_rank, get_pg_size
from megatron_core.device import get_current_device
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.packed_sequences import packed_cp_group
from megatron_core.transformer.rope_utils import apply_rotary_pos_emb, get_pos_emb_on_this_cp_rank

__all__ = ["RotaryEmbedding", "apply_rotary_pos_emb"]


def _llama3_scaled_inv_freq(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float = 1.0, high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> torch.Tensor:
    """Llama 3.1 frequency scaling: long wavelengths slowed by ``factor``, short ones kept, smooth in between."""
    low_freq_wavelen = original_max_position_embeddings / low_freq_factor
    high_freq_wavelen = original_max_position_embeddings / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_dim(kv_channels: int, rotary_percent: float) -> int:
    """The rotated width ``kv_channels * rotary_percent`` of each head (``ValueError`` unless in (0, 1] and even)."""
    if not 0.0 < rotary_percent <= 1.0:
        raise ValueError(f"rotary_percent ({rotary_percent}) must be in (0, 1]")
    dim = int(kv_channels * rotary_percent)
    if dim % 2 != 0:
        raise ValueError(f"kv_channels ({kv_channels}) * rotary_percent ({rotary_percent}) = {dim} must be even")
    return dim


def rotary_inv_freq(dim: int, rotary_base: float, device: torch.device | str) -> torch.Tensor:
    """The fp32 inverse frequencies ``base ** (-2i / dim)``, ``i < dim / 2``, of a rotary embedding of width ``dim``."""
    return 1.0 / (rotary_base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))


def move_inv_freq(module: torch.nn.Module, fn: Any) -> bool:
    """Move ``module.inv_freq`` (a plain attribute) to the device ``fn`` sends tensors to; True when it moved.

    Called from a rotary module's ``_apply``: moves of the module (``.cuda()``, ``.to(device)``) take ``inv_freq``
    along while dtype casts leave it fp32.
    """
    target = fn(module.inv_freq).device
    if target == module.inv_freq.device:
        return False
    module.inv_freq = module.inv_freq.to(target)
    return True


class RotaryEmbedding(torch.nn.Module):
    """Produces rotary angles for positions ``offset .. offset + seq_len - 1``."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        use_cpu_initialization: bool = False,
        cp_group: Any = None,
    ) -> None:
        super().__init__()
        dim = rotary_dim(kv_channels, rotary_percent)
        self.rotary_interleaved = rotary_interleaved
        self.cp_group = resolve_process_group("cp", group=cp_group)
        self.seq_len_interpolation_factor = seq_len_interpolation_factor
        device = torch.device("cpu") if use_cpu_initialization else get_current_device()
        inv_freq = rotary_inv_freq(dim, rotary_base, device)
        if rope_scaling:
            inv_freq = _llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
        self.inv_freq = inv_freq
        self._cache: dict[tuple, torch.Tensor] = {}

    def _apply(self, fn: Any, recurse: bool = True) -> RotaryEmbedding:
        """Moves of the module (``.cuda()``, ``.to(device)``) take ``inv_freq`` along; dtype casts leave it fp32.

        Without this, a model built on the CPU and moved to a GPU would copy ``inv_freq`` from the host
        whenever the angles are recomputed: inside a compiled graph captured by a CUDA graph, that copy fails.
        """
        super()._apply(fn, recurse)
        if move_inv_freq(self, fn):
            self._cache.clear()
        return self

    def _cp(self) -> tuple[int, int]:
        return get_pg_size(self.cp_group), get_pg_rank(self.cp_group)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> torch.Tensor:
        """Angles ``[max_seq_len, 1, 1, rot_dim]`` (fp32); this CP rank's ``max_seq_len / cp`` rows under CP."""
        device = get_current_device()
        if torch.compiler.is_compiling():
            # Inside a compiled graph the angles fuse into their consumers; a cached graph output would be
            # overwritten by the next replay under CUDA graphs.
            return self._local(self._angles(max_seq_len, offset, device), packed_seq)
        key = (max_seq_len, offset, device, packed_seq)
        cached = self._cache.get(key)
        if cached is None:
            cached = self._cache[key] = self._local(self._angles(max_seq_len, offset, device), packed_seq)
        return cached

    def _local(self, emb: torch.Tensor, packed_seq: bool) -> torch.Tensor:
        if self._cp()[0] == 1 or packed_seq:
            return emb
        return get_pos_emb_on_this_cp_rank(emb, 0, self.cp_group)

    def _angles(self, max_seq_len: int, offset: int, device: torch.device) -> torch.Tensor:
        inv_freq = self.inv_freq.to(device)
        positions = torch.arange(max_seq_len, device=device, dtype=torch.float32) + offset
        if self.seq_len_interpolation_factor is not None:
            positions = positions / self.seq_len_interpolation_factor
        freqs = torch.outer(positions, inv_freq)
        if self.rotary_interleaved:
            emb = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        else:
            emb = torch.cat((freqs, freqs), dim=-1)
        return emb[:, None, None, :]

    def get_rotary_seq_len(
        self, inference_context: Any, transformer: Any, transformer_input: torch.Tensor | None,
        transformer_config: Any, packed_seq_params: Any = None,
    ) -> int:
        """The full sequence length the angles must cover (undoing the sequence-parallel and CP splits).

        With an inference context, every position up to its ``max_sequence_length`` (the context
        picks each token's row). Under hybrid CP the split undone is this call's (``packed_seq_params``).
        """
        if inference_context is not None:
            return inference_context.max_sequence_length
        if transformer_input is None:
            transformer_input = transformer.input_tensor
        seq_len = transformer_input.size(0)
        if transformer_config.sequence_parallel:
            # The TP group's size (the block's group, else parallel_state's), not the config field.
            tp_group = transformer.tp_group if hasattr(transformer, "tp_group") else resolve_process_group("tp")
            seq_len *= get_pg_size(tp_group)
        return seq_len * get_pg_size(packed_cp_group(packed_seq_params, self.cp_group))
