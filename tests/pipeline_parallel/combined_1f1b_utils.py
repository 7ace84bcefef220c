"""Helpers for the combined 1F1B tests: an EP=2 MoE GPT run with and without ``overlap_moe_expert_parallel_comm``.

The config sets ``bf16=True`` (the flag's rule) but the model is not wrapped in ``Float16Module``, so its
parameters and arithmetic stay fp32 and can be compared with an fp32 single-process reference at 1e-6;
the schedule and the nodes do not depend on the dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch

from megatron_core.models.common.model_chunk_schedule_plan import TransformerModelChunkSchedulePlan
from megatron_core.transformer.moe import MoEAuxLossAutoScaler
from tests.transformer.moe.moe_parallel_utils import batches, build, global_tensors, load_globals, shards

__all__ = ["EP", "PlanRuns", "forward_step", "global_grads", "grads_by_key", "micro_batches", "reference_grads"]

EP = 2


class PlanRuns:
    """Counts of ``TransformerModelChunkSchedulePlan.run`` calls: forward only, backward only, both."""

    def __init__(self) -> None:
        self.forward = self.backward = self.both = 0

    @classmethod
    @contextlib.contextmanager
    def record(cls) -> Iterator[PlanRuns]:
        """Count the plan runs inside the block."""
        runs = cls()
        real = TransformerModelChunkSchedulePlan.run

        def counting(f_plan, b_plan, *args, **kwargs):
            if f_plan is not None and b_plan is not None:
                runs.both += 1
            elif f_plan is not None:
                runs.forward += 1
            else:
                runs.backward += 1
            return real(f_plan, b_plan, *args, **kwargs)

        with mock.patch.object(TransformerModelChunkSchedulePlan, "run", staticmethod(counting)):
            yield runs


def forward_step(data_iterator, model, return_schedule_plan: bool = False):
    """A user's forward step that builds the schedule plan when the combined schedule asks for it."""
    ids, pos, labels = next(data_iterator)
    if return_schedule_plan:
        output = model.build_schedule_plan(ids, pos, None, labels=labels)
    else:
        output = model(ids, pos, None, labels=labels)

    def loss_func(output_tensor):
        loss = output_tensor.float().mean()
        return loss, {"lm loss": loss.detach().clone()}

    return output, loss_func


def micro_batches(data_rank: int, count: int) -> list:
    """The ``count`` micro-batches of data-parallel rank ``data_rank``."""
    return batches(count, seed=100 + data_rank)


def global_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s gradients in the global checkpoint layout (zeros where a parameter has none)."""
    params = [p for p in model.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad if p.grad is not None else torch.zeros_like(p)
        return global_tensors(model)
    finally:
        for p, data in zip(params, saved):
            p.data = data


def grads_by_key(model: torch.nn.Module) -> dict[str, tuple[str, tuple, torch.Tensor]]:
    """``{piece id: (global key, global slice, this rank's gradient piece)}`` of a (possibly expert-parallel)
    model."""
    params = [p for p in model.parameters()]
    saved = [p.data for p in params]
    try:
        for p in params:
            p.data = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        return {f"{s.key}{s.global_offset}": (s.key, s.global_slice(), s.data.detach().clone())
                for s in shards(model)}
    finally:
        for p, data in zip(params, saved):
            p.data = data


def reference_grads(flavour: str, before: dict, data_rank: int, count: int, **overrides
                    ) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Single process, all experts: per-micro-batch losses and global gradients for ``data_rank``'s data
    (each loss scaled by ``1 / count``, as the schedules scale it, aux losses likewise)."""
    model = build(flavour, **overrides)
    load_globals(model, before)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(1.0 / count))
    losses = []
    for ids, pos, labels in micro_batches(data_rank, count):
        loss = model(ids, pos, None, labels=labels).float().mean()
        (loss / count).backward()
        losses.append(loss.detach())
    return losses, global_grads(model)
