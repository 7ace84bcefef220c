"""An independent rank-list oracle: groups computed by brute force from rank coordinates.

The library builds groups with mixed-radix strides; this oracle instead compares every pair of
ranks' coordinates, so the two share no code.
"""

from __future__ import annotations

AXES = ("tp", "cp", "ep", "dp", "pp")


def coordinates(rank: int, order: str, sizes: dict[str, int]) -> dict[str, int]:
    """Coordinates of ``rank`` on the grid, the first axis of ``order`` varying fastest."""
    names = order.split("-") + [a for a in AXES if a not in order.split("-")]
    coords = {}
    for name in names:
        coords[name] = rank % sizes[name]
        rank //= sizes[name]
    return coords


def group_of(rank: int, axes: str, order: str, sizes: dict[str, int]) -> list[int]:
    """Ranks that differ from ``rank`` only along ``axes`` (a '-'-joined list), ascending."""
    world = 1
    for size in sizes.values():
        world *= size
    spanned = set(axes.split("-"))
    mine = coordinates(rank, order, sizes)
    return [
        other
        for other in range(world)
        if all(c == mine[a] for a, c in coordinates(other, order, sizes).items() if a not in spanned)
    ]


def expected_groups(rank: int, world: int, order: str, tp: int, pp: int, cp: int, ep: int, etp: int) -> dict:
    """Every group of ``rank`` for one layout, keyed like the library's group names."""
    dp = world // (tp * pp * cp)
    edp = world // (etp * ep * pp)
    dense = {"tp": tp, "cp": cp, "ep": 1, "dp": dp, "pp": pp}
    expert = {"tp": etp, "cp": 1, "ep": ep, "dp": edp, "pp": pp}
    groups = {
        name: group_of(rank, axes, order, dense)
        for name, axes in {
            "tp": "tp", "pp": "pp", "dp": "dp", "cp": "cp", "dp_cp": "dp-cp", "mp": "tp-pp",
            "tp_dp": "tp-dp", "tp_cp": "tp-cp", "tp_dp_cp": "tp-dp-cp",
        }.items()
    }
    groups.update(
        {
            name: group_of(rank, axes, order, expert)
            for name, axes in {
                "ep": "ep", "expt_tp": "tp", "tp_ep": "tp-ep", "tp_ep_pp": "tp-ep-pp", "expt_dp": "dp",
            }.items()
        }
    )
    pp_group = groups["pp"]
    groups["embd"] = [pp_group[0], pp_group[-1]] if len(pp_group) > 1 else [pp_group[0]]
    groups["pos_embd"] = [pp_group[0]]
    return groups
