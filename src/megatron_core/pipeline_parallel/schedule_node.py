"""Schedule nodes of the combined 1F1B schedule (Megatron-Core's ``ScheduleNode`` family in ``pipeline_parallel.utils``).

A model chunk's forward is cut into nodes (embedding, per layer: attention, MoE dispatch, experts, MoE
combine, then the output layer and loss). Each node runs its piece of forward on inputs it detaches
from the previous node, keeps its outputs, and later runs its own piece of backward from the output
gradients, leaving the input gradients on those detached inputs. The schedule can then run node ``i``
of one micro-batch's forward between nodes of another micro-batch's backward.

On CUDA a node runs on its stream (computation: the current stream; communication: a side stream from
:func:`set_streams`) and orders itself against the other nodes of its micro-batch through one event
per model chunk. Without a stream (a CPU model) every node runs in line on the caller's stream; the
order of the nodes, and so the arithmetic, is the same.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.autograd import Variable

__all__ = [
    "AbstractSchedulePlan",
    "NoopScheduleNode",
    "ScheduleNode",
    "get_comm_stream",
    "get_comp_stream",
    "make_viewless",
    "set_streams",
]

_COMM_STREAM: Any = None


def make_viewless(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself, or, for a view, a tensor on the same memory without the link to its base (so that
    releasing memory and ``deallocate_output_tensor`` treat it as a tensor of its own); gradients flow through."""
    if tensor._base is None:
        return tensor
    if tensor.requires_grad:
        return _MakeViewless.apply(tensor)
    out = torch.empty((1,), dtype=tensor.dtype, device=tensor.device)
    out.data = tensor.data
    return out


class _MakeViewless(torch.autograd.Function):
    """A viewless alias of the input; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, view: torch.Tensor) -> torch.Tensor:  # noqa: D102
        out = torch.empty((1,), dtype=view.dtype, device=view.device)
        out.data = view.data
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return grad


def set_streams(comm_stream: Any = None, high_priority: bool = False) -> None:
    """Create (once) the CUDA stream the communication nodes run on; nothing without CUDA.

    ``high_priority`` gives it the device's highest stream priority (``high_priority_a2a_comm_stream``).
    """
    global _COMM_STREAM
    if _COMM_STREAM is not None or not torch.cuda.is_available():
        return
    if comm_stream is None:
        priority = torch.cuda.Stream.priority_range()[1] if high_priority else 0
        comm_stream = torch.cuda.Stream(device=torch.cuda.current_device(), priority=priority)
    _COMM_STREAM = comm_stream


def get_comp_stream() -> Any:
    """The stream the computation nodes run on: the current CUDA stream (None without CUDA)."""
    return torch.cuda.current_stream() if torch.cuda.is_available() else None


def get_comm_stream() -> Any:
    """The stream the communication nodes run on (set by :func:`set_streams`; None before or without CUDA)."""
    return _COMM_STREAM


class NoopScheduleNode:
    """A node with nothing to do (a dense layer's MoE dispatch and combine): passes values through."""

    def forward(self, inputs: Any) -> Any:
        """Return ``inputs`` unchanged."""
        return inputs

    def backward(self, outgrads: Any) -> Any:
        """Return ``outgrads`` unchanged."""
        return outgrads


class ScheduleNode:
    """One piece of a micro-batch's forward and backward, run on a stream in the order the schedule picks.

    Args:
        forward_func: called with the detached inputs; returns a tensor or a tuple.
        stream: a CUDA stream, a function returning one (resolved at first use), or None (run in line).
        event: the model chunk's event (a ``torch.cuda.Event``, or None without streams): each node waits for
            it before running and records it after, so the nodes of one micro-batch run in order across streams.
        backward_func: ``(outputs, output_grads) -> output_grads``; the default runs autograd from the outputs.
        free_input: release the inputs' memory after the forward (they are not needed by the backward).
        name: for profiling ranges and error messages.
    """

    def __init__(self, forward_func: Callable, stream: Any, event: Any, backward_func: Callable | None = None,
                 free_input: bool = False, name: str = "schedule_node") -> None:
        self.name = name
        self.forward_func = forward_func
        self.backward_func = backward_func if backward_func is not None else self.default_backward_func
        self.stream = stream
        self.event = event
        self.free_input = free_input
        self.inputs: list | None = None
        self.output: Any = None

    @staticmethod
    def default_backward_func(outputs: tuple, output_grad: tuple) -> tuple:
        """Run autograd from ``outputs`` with ``output_grad`` (pairs without a gradient are skipped)."""
        pairs = [(out, grad) for out, grad in zip(outputs, output_grad)
                 if isinstance(out, torch.Tensor) and out.requires_grad and grad is not None]
        if pairs:
            Variable._execution_engine.run_backward(
                tensors=tuple(p[0] for p in pairs), grad_tensors=tuple(p[1] for p in pairs), keep_graph=False,
                create_graph=False, inputs=(), allow_unreachable=True, accumulate_grad=True)
        return output_grad

    def _resolve_stream(self) -> Any:
        """The stream, calling the stream getter given at construction on first use."""
        if callable(self.stream) and not hasattr(self.stream, "wait_event"):
            self.stream = self.stream()
        return self.stream

    @contextlib.contextmanager
    def stream_acquire_context(self, name: str | None = None) -> Iterator[None]:
        """Wait for the chunk's event, run on this node's stream, record the event (in line without a stream)."""
        stream = self._resolve_stream()
        if stream is None:
            yield
            return
        if self.event is not None:
            self.event.wait(stream)
        if name:
            torch.cuda.nvtx.range_push(name)
        try:
            with torch.cuda.stream(stream):
                yield
        finally:
            if name:
                torch.cuda.nvtx.range_pop()
            if self.event is not None:
                self.event.record(stream)

    def forward(self, inputs: Any = ()) -> Any:
        """Run the forward on ``inputs`` (a tensor, or a tuple of tensors / None); returns the outputs."""
        if not isinstance(inputs, tuple):
            inputs = (inputs,)
        return self._forward(*inputs)

    def _forward(self, *inputs: Any) -> Any:
        with self.stream_acquire_context(f"{self.name} forward"):
            self.inputs = [None if e is None else _detached_leaf(e) for e in inputs]
            data = self.forward_func(*self.inputs)
            if isinstance(data, tuple):
                data = tuple(make_viewless(e) if isinstance(e, torch.Tensor) else e for e in data)
            elif isinstance(data, torch.Tensor):
                data = make_viewless(data)
            self.output = data
        if self.free_input:
            for tensor in inputs:
                if isinstance(tensor, torch.Tensor):
                    if tensor.is_cuda and self.stream is not None:
                        tensor.record_stream(self.stream)
                    tensor.untyped_storage().resize_(0)
        return self.output

    def get_output(self) -> Any:
        """The outputs of the last forward."""
        return self.output

    def backward(self, output_grad: Any) -> Any:
        """Run the backward from the gradients of the outputs; returns the gradients of the inputs."""
        if not isinstance(output_grad, tuple):
            output_grad = (output_grad,)
        return self._backward(*output_grad)

    def _backward(self, *output_grad: Any) -> Any:
        with self.stream_acquire_context(f"{self.name} backward"):
            outputs = self.output if isinstance(self.output, tuple) else (self.output,)
            if len(outputs) != len(output_grad):
                raise ValueError(f"node {self.name!r}: {len(outputs)} outputs but {len(output_grad)} output gradients")
            output_grad = self.backward_func(outputs, output_grad)
        if self.stream is not None:
            for grad in output_grad or ():
                if isinstance(grad, torch.Tensor) and grad.is_cuda:
                    grad.record_stream(self.stream)
        grads = self.get_grad()
        self._release_state()
        return grads

    def get_grad(self) -> Any:
        """The gradients of the inputs (one value for a single input, else a tuple)."""
        grad = tuple(None if e is None else e.grad for e in self.inputs)
        return grad[0] if len(grad) == 1 else grad

    def _release_state(self) -> None:
        self.inputs = None
        self.output = None
        self.forward_func = None
        self.backward_func = None


def _detached_leaf(tensor: torch.Tensor) -> torch.Tensor:
    leaf = make_viewless(tensor).detach()
    leaf.requires_grad = tensor.requires_grad
    return leaf


class AbstractSchedulePlan(ABC):
    """What a model's ``build_schedule_plan`` returns: the nodes of one micro-batch's forward and backward.

    ``run`` interleaves one plan's forward with another plan's backward (either may be None).
    """

    @staticmethod
    @abstractmethod
    def run(f_schedule_plan: Any, b_schedule_plan: Any, b_grad: Any = None, pre_forward: Callable | None = None,
            pre_backward: Callable | None = None, post_forward: Callable | None = None,
            post_backward: Callable | None = None) -> Any:
        """Run ``f_schedule_plan``'s forward interleaved with ``b_schedule_plan``'s backward from ``b_grad``;
        returns the forward's output."""
