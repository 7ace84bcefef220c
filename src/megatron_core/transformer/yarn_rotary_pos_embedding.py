"""YaRN rotary embeddings (Megatron-Core's ``YarnRotaryEmbedding``, ``position_embedding_type='yarn'``).

YaRN stretches RoPE to ``scaling_factor`` times the context it was trained on: each frequency is a blend
of the original one (kept for the fast-rotating dimensions, which see many turns within the original
context) and the original divided by ``scaling_factor`` (for the slow ones). The blend weight ramps
linearly between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over
``original_max_position_embeddings`` positions (bounds rounded outwards with
``correction_range_round_to_int``). The cosines and sines are then multiplied by the concentration
factor of :func:`megatron_core.transformer.rope_utils.yarn_concentration_factor`, which
``apply_rotary_pos_emb`` takes from the config (``yarn_*`` fields), so only the angles live here.

The frequencies equal Hugging Face's ``rope_type='yarn'`` (``truncate`` is
``correction_range_round_to_int``). As in Megatron-Core, ``forward`` returns ``(angles, concentration factor)``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from megatron_core.transformer.rope_utils import yarn_concentration, yarn_mscale
from megatron_core.transformer.rotary_pos_embedding import RotaryEmbedding

__all__ = ["YarnRotaryEmbedding", "yarn_correction_range", "yarn_inv_freq", "yarn_mscale"]

_yarn_get_mscale = yarn_mscale  # Megatron-Core's name (re-exported by its ``embeddings`` package)


def _correction_dim(rotations: float, dim: int, base: float, max_positions: int) -> float:
    """The (fractional) dimension pair whose frequency makes ``rotations`` full turns over ``max_positions``."""
    return dim * math.log(max_positions / (rotations * 2 * math.pi)) / (2 * math.log(base))


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, max_positions: int,
                          round_to_int: bool = True) -> tuple[float, float]:
    """``(low, high)``: the dimension pairs where the blend from kept to scaled frequencies starts and ends."""
    low = _correction_dim(beta_fast, dim, base, max_positions)
    high = _correction_dim(beta_slow, dim, base, max_positions)
    if round_to_int:
        low, high = math.floor(low), math.ceil(high)
    return max(low, 0), min(high, dim - 1)


def yarn_inv_freq(dim: int, base: float, scaling_factor: float, original_max_position_embeddings: int,
                  beta_fast: float = 32.0, beta_slow: float = 1.0, round_to_int: bool = True,
                  device: torch.device | str | None = None) -> torch.Tensor:
    """The ``dim // 2`` YaRN inverse frequencies (fp32) of a rotary dimension ``dim``."""
    kept = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    scaled = kept / scaling_factor
    low, high = yarn_correction_range(beta_fast, beta_slow, dim, base, original_max_position_embeddings,
                                      round_to_int)
    if low == high:
        high += 0.001  # a ramp of zero width would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low)).clamp(0, 1)
    return scaled * ramp + kept * (1 - ramp)


class YarnRotaryEmbedding(RotaryEmbedding):
    """Rotary angles with YaRN's frequencies; ``forward`` returns ``(angles, concentration factor)``."""

    def __init__(
        self,
        kv_channels: int,
        rotary_percent: float = 1.0,
        rotary_interleaved: bool = False,
        seq_len_interpolation_factor: float | None = None,
        rotary_base: float = 10000.0,
        use_cpu_initialization: bool = False,
        scaling_factor: float = 1.0,
        original_max_position_embeddings: int = 4096,
        beta_fast: float = 32.0,
        beta_slow: float = 1.0,
        mscale: float | None = 1.0,
        mscale_all_dim: float | None = 0.0,
        correction_range_round_to_int: bool = True,
        cp_group: Any = None,
    ) -> None:
        if rotary_percent != 1.0:
            raise ValueError(f"rotary_percent ({rotary_percent}) must be 1.0 with YaRN rotary embeddings "
                             "(Megatron-Core's YaRN rotates every channel whatever rotary_percent says)")
        if not scaling_factor > 0:
            raise ValueError(f"scaling_factor ({scaling_factor}) must be > 0")
        super().__init__(kv_channels, rotary_percent, rotary_interleaved, seq_len_interpolation_factor,
                         rotary_base, use_cpu_initialization=use_cpu_initialization, cp_group=cp_group)
        self.scaling_factor = scaling_factor
        self.original_max_position_embeddings = original_max_position_embeddings
        self.beta_fast, self.beta_slow = beta_fast, beta_slow
        self.mscale, self.mscale_all_dim = mscale, mscale_all_dim
        self.correction_range_round_to_int = correction_range_round_to_int
        self.inv_freq = yarn_inv_freq(kv_channels, rotary_base, scaling_factor, original_max_position_embeddings,
                                      beta_fast, beta_slow, correction_range_round_to_int, self.inv_freq.device)
        self.concentration_factor = yarn_concentration(scaling_factor, mscale, mscale_all_dim)

    def forward(self, max_seq_len: int, offset: int = 0, packed_seq: bool = False) -> tuple[torch.Tensor, float]:
        """``(angles [max_seq_len, 1, 1, kv_channels], concentration factor)``; under CP this rank's rows."""
        return super().forward(max_seq_len, offset, packed_seq), self.concentration_factor
