"""``print_offload_summary_table``: the offloaded megabytes per rank and group name, printed by rank 0.

Megatron-Core prints it once, after the first iteration fixes the offload policy. Without
``torch.distributed`` (a single process) the table has one row.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

__all__ = ["format_offload_summary_table", "print_offload_summary_table"]

_MB = 1024 * 1024


def _gather(obj: Any, group: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()):
        return [obj]
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def format_offload_summary_table(rows: list[list[int]], names: list[str]) -> str:
    """The table text: one row of megabytes per rank (``rows[r][i]``: rank ``r``, group ``names[i]``) and
    a totals row."""
    col = max(12, max((len(n) for n in names), default=8) + 2)
    rank_col = max(6, len(f"Rank {len(rows) - 1}") + 2)
    header = "Rank".ljust(rank_col) + "".join(n.rjust(col) for n in names) + "Total".rjust(col)
    rule, sep = "=" * len(header), "-" * len(header)

    def line(label: str, values: list[int]) -> str:
        return label.ljust(rank_col) + "".join(f"{v / _MB:.2f}".rjust(col) for v in [*values, sum(values)])

    totals = [sum(r[i] for r in rows) for i in range(len(names))]
    body = [line(f"Rank {r}", row) for r, row in enumerate(rows)]
    return "\n".join([rule, "Activation Offload Summary (MB)".center(len(header)), rule, header, sep, *body, sep,
                      line("Total", totals), rule])


def print_offload_summary_table(total_offload_bytes: dict[str, int], group: Any = None) -> None:
    """Gather every rank's offloaded bytes per group name (over ``group``, default the world) and print the
    table on its first rank; all ranks of ``group`` must call it."""
    names = sorted({n for names in _gather(list(total_offload_bytes), group) for n in names})
    rows = _gather([total_offload_bytes.get(n, 0) for n in names], group)
    first = not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) == 0
    if first:
        print("\n" + format_offload_summary_table(rows, names) + "\n")  # noqa: T201 (Megatron-Core prints it)
