"""The prefill chunks of one step laid out as one padded batch, for one Triton scan call over all of them.

The dynamic context gives each prefill chunk of a step as ``(first row, rows, slot)``. On the GPU path,
:func:`megatron_core.ssm.mamba_inference.mixer_inference` runs them together: the chunks' rows are gathered into
``[chunks, longest, .]`` (padding rows read an appended zero row), convolved behind their stored inputs in one
call and scanned in one Triton call from their stored states. A padding row's ``dt`` is set to zero, so it neither
decays nor feeds the state: the final state of each sequence is its last real row's. The index tensors are built
once per step on the host (copied from pinned memory without waiting on the device) and kept on the context for
the step's other Mamba layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["PrefillBatchPlan", "prefill_batch_plan"]

# Batch the chunks only while the padded batch holds at most this many times their rows.
MAX_PADDING_RATIO = 2.0


@dataclass
class PrefillBatchPlan:
    """Index tensors (on the step's device) of a step's prefill chunks as a padded batch ``[S, L]``.

    ``gather`` ``[S * L]``: the row of each batch position (``pad_row`` for padding); ``valid`` ``[S, L, 1]``:
    1.0 on real rows, 0.0 on padding; ``slots`` ``[S]``; ``tail`` ``[S, K]``: the positions, in the convolution's
    input with the ``K - 1`` stored inputs in front, of each sequence's last ``K`` inputs (its new convolution
    state); ``src`` / ``dest`` ``[rows]``: each real row's flat batch position and its row in the step.
    """

    chunks: int
    longest: int
    pad_row: int
    gather: torch.Tensor
    valid: torch.Tensor
    slots: torch.Tensor
    tail: torch.Tensor
    src: torch.Tensor
    dest: torch.Tensor


def _build(prefill: list[tuple[int, int, int]], pad_row: int, kernel: int, device: torch.device) -> PrefillBatchPlan:
    chunks, longest = len(prefill), max(count for _, count, _ in prefill)
    gather, valid, src, dest = [], [], [], []
    for s, (first, count, _) in enumerate(prefill):
        gather += list(range(first, first + count)) + [pad_row] * (longest - count)
        valid += [1.0] * count + [0.0] * (longest - count)
        src += range(s * longest, s * longest + count)
        dest += range(first, first + count)
    tail = [[count - 1 + k for k in range(kernel)] for _, count, _ in prefill]
    host = [torch.tensor(v, dtype=torch.long) for v in (gather, [slot for _, _, slot in prefill], tail, src, dest)]
    host.append(torch.tensor(valid, dtype=torch.float32).view(chunks, longest, 1))
    if device.type == "cuda":  # pinned, so the copies need not wait for the device
        moved = [t.pin_memory().to(device, non_blocking=True) for t in host]
    else:
        moved = [t.to(device) for t in host]
    return PrefillBatchPlan(chunks, longest, pad_row, moved[0], moved[5], moved[1], moved[2], moved[3], moved[4])


def prefill_batch_plan(context: Any, prefill: list[tuple[int, int, int]], rows: int, kernel: int,
                       device: torch.device) -> PrefillBatchPlan | None:
    """The plan of ``prefill`` (``(first, count, slot)`` per chunk; ``rows`` rows in the step, ``kernel`` the
    convolution width), or None where batching does not pay: fewer than two chunks, or a padded batch over
    :data:`MAX_PADDING_RATIO` times the chunks' rows. Cached on ``context`` for as long as it hands out the same
    ``prefill`` list (one step)."""
    if len(prefill) < 2:
        return None
    total, longest = sum(count for _, count, _ in prefill), max(count for _, count, _ in prefill)
    if len(prefill) * longest > MAX_PADDING_RATIO * total:
        return None
    cached = getattr(context, "_mamba_prefill_batch_plan", None)
    key = (rows, kernel, device)
    if cached is not None and cached[0] is prefill and cached[1] == key:
        return cached[2]
    plan = _build(prefill, rows, kernel, device)
    context._mamba_prefill_batch_plan = (prefill, key, plan)
    return plan
