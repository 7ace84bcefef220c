"""Rank grids: which global ranks form each parallel group (Megatron's ``RankGenerator``).

A grid is an ordered list of named axes, e.g. ``"tp-cp-ep-dp-pp"``. The left-most axis varies
fastest: ranks adjacent in ``tp`` are adjacent integers, and ``pp`` has the largest stride. A group
"spanning" some axes holds every rank that differs from another only along those axes.
"""

from __future__ import annotations

import math


class ParallelConfigError(RuntimeError, ValueError):
    """Invalid parallel sizes or layout. Both a ``RuntimeError`` (as Megatron-Core raises) and a ``ValueError``."""


def _prefix_product(sizes: list[int]) -> list[int]:
    strides = [1]
    for size in sizes:
        strides.append(strides[-1] * size)
    return strides


def _decompose(index: int, shape: list[int]) -> list[int]:
    """Mixed-radix digits of ``index`` with the first axis fastest."""
    digits = []
    for size in shape:
        digits.append(index % size)
        index //= size
    return digits


def generate_masked_orthogonal_rank_groups(
    world_size: int, parallel_size: list[int], mask: list[bool]
) -> list[list[int]]:
    """Every group of ranks spanning the axes where ``mask`` is True.

    ``parallel_size`` lists the axis sizes, fastest first; their product must be ``world_size``.
    Groups are listed with the non-masked axes enumerated fastest-first, and inside a group the
    ranks are ordered with the first masked axis fastest.
    """
    if math.prod(parallel_size) != world_size:
        raise ParallelConfigError(
            f"the product of the parallel sizes {parallel_size} ({math.prod(parallel_size)}) "
            f"must equal the world size ({world_size})"
        )
    strides = _prefix_product(parallel_size)[:-1]
    masked_shape = [s for s, m in zip(parallel_size, mask) if m]
    masked_strides = [st for st, m in zip(strides, mask) if m]
    other_shape = [s for s, m in zip(parallel_size, mask) if not m]
    other_strides = [st for st, m in zip(strides, mask) if not m]

    groups = []
    for outer in range(math.prod(other_shape)):
        base = sum(d * st for d, st in zip(_decompose(outer, other_shape), other_strides))
        group = [
            base + sum(d * st for d, st in zip(_decompose(inner, masked_shape), masked_strides))
            for inner in range(math.prod(masked_shape))
        ]
        groups.append(group)
    return groups


class RankGenerator:
    """Enumerates the rank groups of one grid of ``tp, cp, ep, dp, pp`` axes in a given ``order``."""

    AXES = ("tp", "cp", "ep", "dp", "pp")

    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str, rank_offset: int = 0) -> None:
        self.tp, self.ep, self.dp, self.pp, self.cp = tp, ep, dp, pp, cp
        self.rank_offset = rank_offset
        self.world_size = tp * ep * dp * pp * cp
        self.name_to_size = {"tp": tp, "pp": pp, "dp": dp, "ep": ep, "cp": cp}
        names = [n for n in order.lower().split("-") if n]
        unknown = [n for n in names if n not in self.name_to_size]
        if unknown or len(set(names)) != len(names):
            raise ParallelConfigError(
                f"order '{order}' must be '-'-separated distinct axes from {list(self.AXES)}; got {names}"
            )
        for name, size in self.name_to_size.items():
            if name not in names:
                if size != 1:
                    raise ParallelConfigError(
                        f"the {name} size is {size} but '{name}' is missing from order '{order}'; "
                        "an axis larger than 1 must appear in the order"
                    )
                names.append(name)
        self.order = "-".join(names)
        self.ordered_names = names
        self.ordered_size = [self.name_to_size[n] for n in names]

    def get_mask(self, token: str) -> list[bool]:
        """Which axes of the order the ``-``-separated ``token`` spans."""
        parts = token.split("-")
        for part in parts:
            if part not in self.name_to_size:
                raise ParallelConfigError(f"unknown axis '{part}' in token '{token}'")
        return [name in parts for name in self.ordered_names]

    def get_ranks(self, token: str) -> list[list[int]]:
        """Every group spanning the axes named in ``token`` (e.g. ``"tp-dp"``), as global ranks."""
        groups = generate_masked_orthogonal_rank_groups(
            self.world_size, self.ordered_size, self.get_mask(token)
        )
        return [[r + self.rank_offset for r in g] for g in groups]
