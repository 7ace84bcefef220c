"""Distillation under pipeline parallelism: the student's and the teacher's activations travel between stages together.

Megatron-LM (through Model Optimizer's Megatron plugin) runs the teacher split into the same pipeline
stages as the student. Each stage's ``DistillationModel`` runs the teacher's layers (without gradients)
and then the student's; a stage that is not the last sends ``cat([student, teacher], dim=-1)`` on, and the
next stage splits what it receives at the student's hidden size (:func:`adjust_model_for_pipeline`). The
pipeline schedule sends and receives that wider tensor when given
:func:`get_tensor_shapes_adjust_fn_for_distillation` as its ``adjust_tensor_shapes_fn``. The losses live on
the last stage only; intermediate layers are named by their global layer number and renamed to the last
stage's local one (:func:`local_layer_name`). The teacher part of a received tensor gets no gradient.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch

from megatron_core.transformer.pipeline_layout import get_transformer_layer_offset

__all__ = ["adjust_model_for_pipeline", "get_tensor_shapes_adjust_fn_for_distillation", "local_layer_name"]

_LAYER_NUMBER = re.compile(r"(?<=^decoder\.layers\.)\d+(?=\.|$)")


def local_layer_name(name: str, config: Any) -> str:
    """``decoder.layers.<global i>...`` renamed to this stage's local layer number (other names unchanged).

    ``ValueError`` when the layer is not on this (the last) pipeline stage.
    """
    match = _LAYER_NUMBER.search(name)
    if match is None:
        return name
    local = int(match.group(0)) - get_transformer_layer_offset(config)
    if local < 0:
        raise ValueError(f"intermediate layer {name!r} is not on the last pipeline stage, where the distillation "
                         "losses are computed")
    return f"{name[:match.start()]}{local}{name[match.end():]}"


def adjust_model_for_pipeline(model: torch.nn.Module) -> torch.nn.Module:
    """Make a ``DistillationModel`` stage pass ``[student; teacher]`` activations on (module docstring)."""
    teacher = model.teacher_model
    split = model.config.hidden_size

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with torch.no_grad():
            teacher.eval()
            teacher_output = teacher(*args, **kwargs)
        with self.only_student_forward():
            student_output = type(self).forward(self, *args, **kwargs)
        if self.post_process:
            return student_output
        return torch.cat([student_output, teacher_output], dim=-1)

    def set_input_tensor(self: Any, input_tensor: Any) -> None:
        tensors = list(input_tensor) if isinstance(input_tensor, (list, tuple)) else [input_tensor]
        type(teacher).set_input_tensor(teacher, [None if t is None else t[..., split:] for t in tensors])
        type(self).set_input_tensor(self, [None if t is None else t[..., :split] for t in tensors])

    model.forward = MethodType(forward, model)
    model.set_input_tensor = MethodType(set_input_tensor, model)
    return model


def get_tensor_shapes_adjust_fn_for_distillation(model: torch.nn.Module | list[torch.nn.Module],
                                                 ) -> Callable[[list, list], tuple[list, list]] | None:
    """The schedule's ``adjust_tensor_shapes_fn``: every sent/received shape widened by the teacher's hidden size.

    ``None`` for a model that is not a distillation model (nothing to adjust).
    """
    chunk = model[0] if isinstance(model, list) else model
    while hasattr(chunk, "module"):
        chunk = chunk.module
    teacher = getattr(chunk, "teacher_model", None)
    if teacher is None:
        return None
    extra = teacher.config.hidden_size

    def adjust(recv_shapes: list, send_shapes: list) -> tuple[list, list]:
        def widen(shapes: list) -> list:
            return [(*shape[:-1], shape[-1] + extra) for shape in shapes]

        return widen(recv_shapes), widen(send_shapes)

    return adjust
