"""Newton-Schulz orthogonalisation for Muon: the odd matrix polynomials that push every singular value towards 1.

Given ``G = U S V^T``, the polar factor is ``U V^T``. Muon approximates it by normalising ``X = G / ||G||_F`` (so
every singular value lies in ``(0, 1]``) and applying a few steps of ``X <- a X + b (X X^T) X + c (X X^T)^2 X``; each
step maps a singular value ``s`` to ``a s + b s^3 + c s^5`` and leaves ``U`` and ``V`` alone. The coefficient sets
(NVIDIA's emerging-optimizers names: ``simple``, ``quintic``, ``polar_express``, ...) trade exactness for speed: the
tuned ones inflate small singular values fast and leave the large ones within a band around 1, not at 1.

Tensor parallelism (:func:`newton_schulz_tp`): ``duplicated`` all-gathers the sharded matrix and orthogonalises it
whole on every rank; ``distributed`` keeps the shards and all-reduces the Gram matrix ``X X^T`` (taken over the
sharded dimension) and the Frobenius norm, which gives the same result up to rounding.

``fp32_matmul_prec="medium"`` runs the iteration in bf16 (what emerging-optimizers does on every device: torch has
no fp32-in bf16-compute matmul), ``"high"`` allows TF32 on CUDA, ``"highest"`` is plain fp32.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import chain, cycle, islice, repeat
from typing import Any

import torch

from megatron_core.distributed import collectives

__all__ = [
    "COEFFICIENT_SETS",
    "FP32_MATMUL_PRECISIONS",
    "MUON_SCALE_MODES",
    "MUON_TP_MODES",
    "coefficient_schedule",
    "fp32_matmul_precision",
    "get_muon_scale_factor",
    "newton_schulz",
    "newton_schulz_step",
    "newton_schulz_tp",
]

# (a, b, c) per step. Published constants (emerging-optimizers' tables, with their sources): Keller Jordan's
# "simple" cubic-quintic, modded-nanogpt's 5-step "quintic", Polar Express (arXiv:2505.16932, with its 1.01
# safety division), CANS (arXiv:2506.10935), AOL (flash-newton-schulz), DeepSeek-V4's 8 + 2 schedule, and the
# relaxed cubic "cubic5" (arXiv:2606.00371, c = 0).
COEFFICIENT_SETS: dict[str, tuple[tuple[float, float, float], ...]] = {
    "simple": ((3.4445, -4.7750, 2.0315),),
    "quintic": (
        (4.0848, -6.8946, 2.9270),
        (3.9505, -6.3029, 2.6377),
        (3.7418, -5.5913, 2.3037),
        (2.8769, -3.1427, 1.2046),
        (2.8366, -3.0525, 1.2012),
    ),
    "polar_express": (
        (8.2051, -22.9019, 16.4607),
        (4.0664, -2.8612, 0.5184),
        (3.9096, -2.8234, 0.5250),
        (3.2856, -2.4153, 0.4853),
        (2.2779, -1.6198, 0.3985),
        (1.8726, -1.2307, 0.3585),
        (1.8564, -1.2132, 0.3568),
        (1.8750, -1.2500, 0.3750),
    ),
    "cans": (
        (8.4703, -25.1081, 18.6293),
        (4.1828, -3.1087, 0.5806),
        (3.9619, -2.9541, 0.5630),
        (3.2866, -2.4647, 0.5074),
        (2.2737, -1.6447, 0.4162),
    ),
    "aol": (
        (4.0098, -7.0585, 2.4635),
        (3.4585, -5.5479, 2.5959),
        (2.7573, -3.2939, 1.4254),
        (2.7215, -3.0494, 1.3169),
    ),
    "deepseekv4": ((3.4445, -4.7750, 2.0315),) * 8 + ((2.0, -1.5, 0.5),) * 2,
    "cubic5": (
        (3.3656576, -3.3420992, 0.0),
        (2.5744352, -1.4957376, 0.0),
        (2.5368962, -1.4312570, 0.0),
        (2.4418906, -1.2764040, 0.0),
        (2.2230472, -0.9630650, 0.0),
    ),
}
# Schedules that keep their last step once they run out (the others start over).
_REPEAT_LAST = ("polar_express", "cans", "deepseekv4")
# Schedules defined for exactly their own number of steps.
_FIXED_LENGTH = ("cubic5",)

FP32_MATMUL_PRECISIONS = ("highest", "high", "medium")
MUON_SCALE_MODES = ("spectral", "unit_rms_norm", "shape_scaling")
MUON_TP_MODES = ("blockwise", "duplicated", "distributed")


def coefficient_schedule(coefficient_type: str, steps: int) -> list[tuple[float, float, float]]:
    """The ``(a, b, c)`` of each of ``steps`` iterations; ``ValueError`` for an unknown type or a bad length."""
    if coefficient_type not in COEFFICIENT_SETS:
        raise ValueError(f"coefficient_type ({coefficient_type!r}) must be one of {tuple(COEFFICIENT_SETS)}")
    sets = COEFFICIENT_SETS[coefficient_type]
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    if coefficient_type in _FIXED_LENGTH and steps != len(sets):
        raise ValueError(f"coefficient_type {coefficient_type!r} is a fixed {len(sets)}-step schedule; "
                         f"num_ns_steps ({steps}) must be {len(sets)}")
    source: Iterator[tuple[float, float, float]] = (
        chain(sets, repeat(sets[-1])) if coefficient_type in _REPEAT_LAST else cycle(sets))
    return list(islice(source, steps))


@contextmanager
def fp32_matmul_precision(precision: str) -> Iterator[None]:
    """Set ``torch.set_float32_matmul_precision`` for the block, restoring the previous value after."""
    if precision not in FP32_MATMUL_PRECISIONS:
        raise ValueError(f"fp32_matmul_prec ({precision!r}) must be one of {FP32_MATMUL_PRECISIONS}")
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def newton_schulz_step(x: torch.Tensor, a: float, b: float, c: float, tp_group: Any = None) -> torch.Tensor:
    """One step ``a X + (b A + c A^2) X`` with ``A = X X^T`` (summed over ``tp_group`` when ``X`` is sharded
    along its second dimension)."""
    gram = x @ x.mT
    if tp_group is not None and collectives.group_size(tp_group) > 1:
        reduced = gram.float()  # reduce in fp32: bf16 sums lose bits, and not every backend reduces bf16
        collectives.all_reduce(reduced, tp_group)
        gram = reduced.to(x.dtype)
    if c != 0.0:
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        return torch.addmm(x, poly, x, beta=a, alpha=1.0)
    return torch.addmm(x, gram, x, beta=a, alpha=b)


def _frobenius_normalize(x: torch.Tensor, eps: float, tp_group: Any) -> torch.Tensor:
    squares = x.square().sum()
    if tp_group is not None:
        collectives.all_reduce(squares, tp_group)
    return x / squares.sqrt().clamp_min(eps)


def newton_schulz(x: torch.Tensor, steps: int, coefficient_type: str = "quintic", eps: float = 1e-15,
                  transpose: bool | None = None, tp_group: Any = None,
                  fp32_matmul_prec: str | None = None) -> torch.Tensor:
    """The approximate polar factor of the fp32 (or fp64) matrix ``x`` ``[m, n]`` after ``steps`` iterations.

    The iteration runs on the orientation with the smaller Gram matrix (``transpose=None``: transposed when
    ``m > n``). With ``tp_group``, ``x`` is this rank's slice along the dimension that, after the transpose, is
    the second one: the Gram matrix and the norm are summed over the group. ``fp32_matmul_prec`` (default: torch's
    current setting) ``"medium"`` iterates in bf16.
    """
    if x.ndim != 2:
        raise ValueError(f"newton_schulz needs a 2-D matrix, got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"newton_schulz needs a float32 (or, for reference checks, float64) matrix, got {x.dtype}")
    schedule = coefficient_schedule(coefficient_type, steps)
    if transpose is None:
        transpose = x.size(0) > x.size(1)
    if transpose:
        x = x.mT
    x = _frobenius_normalize(x, eps, tp_group)
    dtype = x.dtype
    if dtype == torch.float32 and (fp32_matmul_prec or torch.get_float32_matmul_precision()) == "medium":
        x = x.to(torch.bfloat16)
    for a, b, c in schedule:
        x = newton_schulz_step(x, a, b, c, tp_group)
    x = x.to(dtype)
    return x.mT if transpose else x


def newton_schulz_tp(x: torch.Tensor, steps: int, coefficient_type: str, tp_group: Any,
                     partition_dim: int | None = None, tp_mode: str = "duplicated",
                     fp32_matmul_prec: str | None = None) -> torch.Tensor:
    """Orthogonalise the whole matrix of which ``x`` is this rank's ``partition_dim`` slice; return this rank's slice.

    ``partition_dim=None`` (or a one-rank group): ``x`` is the whole matrix. ``tp_mode`` is ``"duplicated"``
    (all-gather, orthogonalise the whole, keep the slice) or ``"distributed"`` (the sharded iteration).
    """
    kwargs = {"steps": steps, "coefficient_type": coefficient_type, "fp32_matmul_prec": fp32_matmul_prec}
    size = collectives.group_size(tp_group) if tp_group is not None else 1
    if partition_dim is None or size == 1:
        return newton_schulz(x, **kwargs)
    if partition_dim not in (0, 1):
        raise ValueError(f"partition_dim ({partition_dim}) must be 0 or 1 for a 2-D weight")
    if tp_mode == "duplicated":
        gathered = torch.empty((size * x.shape[0], x.shape[1]), dtype=x.dtype, device=x.device)
        collectives.all_gather(gathered, x.contiguous(), tp_group)  # the ranks' slices stacked along dim 0
        whole = torch.cat(gathered.view(size, *x.shape).unbind(0), dim=partition_dim)
        rank = collectives.group_rank(tp_group)
        return newton_schulz(whole, **kwargs).chunk(size, dim=partition_dim)[rank].contiguous()
    if tp_mode == "distributed":
        # The sharded dimension must be the Gram matrix's inner (summed) one: the columns after the transpose.
        return newton_schulz(x, transpose=partition_dim == 0, tp_group=tp_group, **kwargs)
    raise ValueError(f"tp_mode ({tp_mode!r}) must be 'duplicated' or 'distributed' here ('blockwise' "
                     "orthogonalises each shard with partition_dim=None)")


def get_muon_scale_factor(size_out: int, size_in: int, mode: str = "spectral") -> float:
    """Muon's update scale for a ``[size_out, size_in]`` matrix.

    ``spectral``: ``sqrt(max(out, in))``; ``unit_rms_norm``: ``sqrt(out / in)``; ``shape_scaling``:
    ``sqrt(max(1, out / in))`` (Keller Jordan's original).
    """
    if mode == "spectral":
        return max(size_out, size_in) ** 0.5
    if mode == "unit_rms_norm":
        return (size_out / size_in) ** 0.5
    if mode == "shape_scaling":
        return max(1.0, size_out / size_in) ** 0.5
    raise ValueError(f"muon scale_mode ({mode!r}) must be one of {MUON_SCALE_MODES}")
