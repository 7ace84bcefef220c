"""What the combined 1F1B schedule refuses, with errors that say why (single process, CPU)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from megatron_core.pipeline_parallel.combined_1f1b import (
    combined_1f1b_schedule_for_no_pipelining,
    combined_forward_backward_step,
)
from tests.pipeline_parallel.combined_1f1b_utils import micro_batches
from tests.transformer.moe.moe_parallel_utils import build


def _run(forward_step_func, model) -> None:
    combined_1f1b_schedule_for_no_pipelining(
        forward_step_func, iter(micro_batches(0, 2)), model, 2, None, None, [], model.config, False, None, False,
        contextlib.nullcontext, torch.zeros([], dtype=torch.int), lambda first: first)


def test_forward_step_without_return_schedule_plan():
    def old_style(data_iterator, model):
        raise AssertionError("must not be called")

    with pytest.raises(TypeError, match="must accept return_schedule_plan=True"):
        _run(old_style, build("mixtral"))


def test_forward_step_that_returns_no_plan():
    def runs_the_model(data_iterator, model, return_schedule_plan=False):
        ids, pos, labels = next(data_iterator)
        return model(ids, pos, None, labels=labels), lambda out: (out.mean(), {})

    with pytest.raises(TypeError, match=r"return \(model.build_schedule_plan\(...\), loss_func\)"):
        _run(runs_the_model, build("mixtral"))


def test_activation_checkpointing_per_microbatch_is_refused():
    model = build("mixtral")
    with pytest.raises(ValueError, match="checkpoint_activations_microbatch"):
        combined_forward_backward_step(None, None, model, 1, None, [], None, None, None, None, model.config,
                                       checkpoint_activations_microbatch=True)


@pytest.mark.parametrize("kwargs, match", [
    ({"inference_context": object()}, "inference_context"),
    ({"extra_block_kwargs": {"x": 1}}, "extra_block_kwargs"),
    ({"output_processor": print}, "output_processor"),
])
def test_build_schedule_plan_refuses_what_the_plan_cannot_run(kwargs, match):
    ids, pos, labels = micro_batches(0, 1)[0]
    with pytest.raises(ValueError, match=match):
        build("mixtral").build_schedule_plan(ids, pos, None, labels=labels, **kwargs)
