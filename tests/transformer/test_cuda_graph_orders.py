"""transformer.cuda_graphs' schedule-order helpers against Megatron-Core's documented examples."""

from __future__ import annotations

from megatron_core.transformer.cuda_graphs import (
    convert_schedule_table_to_order,
    get_overlap_moe_expert_parallel_comm_order,
)


def test_schedule_table_to_order():
    # PP2 N3M5 VP2: microbatch ids 0 1 2 0 1 2 3 4 3 4, chunks 0 0 0 1 1 1 0 0 1 1.
    table = list(zip([0, 1, 2, 0, 1, 2, 3, 4, 3, 4], [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]))
    assert convert_schedule_table_to_order(5, 2, table) == [
        1, 1, 1, 2, 2, 2, -2, 1, -2, 1, -2, 2, -1, 2, -1, -1, -2, -2, -1, -1]
    assert convert_schedule_table_to_order(0, 2, table[:2]) == [1, -2, 1, -2]


def test_overlap_order_with_and_without_wgrad():
    order, chunks = get_overlap_moe_expert_parallel_comm_order([1, 2, -2, 1, -1, -1], [1, 2], True)
    assert order == [1, 2, 3, 1, -3, -3.5, -2, -2.5, -1, -1.5, -1, -1.5]
    assert chunks == [[0, 0], [1, 0], [1, 1], [0, 0]] + [None] * 8
    order, chunks = get_overlap_moe_expert_parallel_comm_order([1, 2, -2, 1, -1, -1], [1, 2], False)
    assert order == [1, 2, 3, 1, -3, -2, -1, -1]
    assert chunks == [[0, 0], [1, 0], [1, 1], [0, 0], None, None, None, None]
