"""The padded-batch layout of a step's prefill chunks (``ssm.mamba_prefill_batch``): its index tensors, when it is
refused, and its reuse for the step's other layers."""

from __future__ import annotations

import torch

from megatron_core.ssm.mamba_prefill_batch import prefill_batch_plan


class _Context:
    pass


def test_plan_indices_of_two_chunks() -> None:
    prefill = [(2, 3, 5), (5, 2, 0)]  # rows 2-4 of slot 5, rows 5-6 of slot 0; 7 rows in the step
    plan = prefill_batch_plan(_Context(), prefill, 7, 4, torch.device("cpu"))
    assert (plan.chunks, plan.longest, plan.pad_row) == (2, 3, 7)
    assert plan.gather.tolist() == [2, 3, 4, 5, 6, 7]
    assert plan.valid.view(-1).tolist() == [1.0, 1.0, 1.0, 1.0, 1.0, 0.0]
    assert plan.slots.tolist() == [5, 0]
    # In [3 stored inputs, the chunk's rows], the last 4 real inputs start at the chunk's last row minus 1.
    assert plan.tail.tolist() == [[2, 3, 4, 5], [1, 2, 3, 4]]
    assert plan.src.tolist() == [0, 1, 2, 3, 4] and plan.dest.tolist() == [2, 3, 4, 5, 6]


def test_plan_refused_or_reused() -> None:
    context, cpu = _Context(), torch.device("cpu")
    assert prefill_batch_plan(context, [(0, 9, 1)], 9, 4, cpu) is None  # one chunk: nothing to batch
    assert prefill_batch_plan(context, [(0, 1, 1), (1, 1, 2), (2, 9, 3)], 11, 4, cpu) is None  # 27 > 2 x 11 rows
    prefill = [(0, 4, 1), (4, 3, 2)]
    plan = prefill_batch_plan(context, prefill, 7, 4, cpu)
    assert prefill_batch_plan(context, prefill, 7, 4, cpu) is plan  # the step's next layer
    other = prefill_batch_plan(context, list(prefill), 7, 4, cpu)  # the next step's (equal) list: rebuilt
    assert other is not plan and other.gather.tolist() == plan.gather.tolist()
