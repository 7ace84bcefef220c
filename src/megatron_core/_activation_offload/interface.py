"""The offload group markers the layers call (Megatron-Core's ``FineGrainedActivationOffloadingInterface``).

A layer wraps a module in a group::

    manager = FineGrainedActivationOffloadingInterface(self.offload_core_attn, query, "core_attn")
    with manager as query:                      # group start; tensors autograd saves now go to the group
        out = self.core_attention(query, key, value, mask)
    out = manager.group_offload(out, forced_released_tensors=[query, key, value])   # group commit

The start and the commit are identity autograd functions: in the forward they open and offload the group,
in the backward the commit waits for the group's reload and the start reloads the group before it. With
``offload`` False (or gradients off: nothing is saved then) the manager is a no-op.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from megatron_core import device
from megatron_core._activation_offload.chunk_handler import ChunkOffloadHandler
from megatron_core._activation_offload.manager import PipelineOffloadManager
from megatron_core._activation_offload.streams import current_stream

__all__ = [
    "FineGrainedActivationOffloadingInterface",
    "FineGrainedOffloadingBackwardRecordFunction",
    "FineGrainedOffloadingGroupCommitFunction",
    "FineGrainedOffloadingGroupStartFunction",
    "fine_grained_offloading_disable_offload",
    "fine_grained_offloading_enable_offload",
    "fine_grained_offloading_group_flush_delayed_groups",
    "fine_grained_offloading_group_offload",
    "fine_grained_offloading_group_start",
    "start_model_chunk",
]


def _manager() -> PipelineOffloadManager:
    return PipelineOffloadManager.get_instance()


def fine_grained_offloading_disable_offload() -> None:
    """Stop offloading until :func:`fine_grained_offloading_enable_offload`."""
    _manager().disable_offload()


def fine_grained_offloading_enable_offload() -> None:
    """Offload again."""
    _manager().enable_offload()


def fine_grained_offloading_group_flush_delayed_groups() -> None:
    """Run the group commits queued during a CUDA-graph replay."""
    _manager().flush_delayed_groups()


class FineGrainedOffloadingGroupCommitFunction(torch.autograd.Function):
    """Identity at the end of a group: offloads it in the forward, waits for its reload in the backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cur_forward_chunk: ChunkOffloadHandler, name: str,
                forced_released_tensors: list[torch.Tensor], delay_offload: bool) -> torch.Tensor:
        """Commit (or, replaying a CUDA graph with ``delay_offload``, queue) the group ``name``."""
        manager = _manager()
        if delay_offload and manager._in_replay:
            manager.push_offload_groups(cur_forward_chunk.on_group_commit_forward, name, forced_released_tensors)
        else:
            cur_forward_chunk.on_group_commit_forward(name, forced_released_tensors)
        ctx.cpu_offload_handler = cur_forward_chunk
        ctx.name = name
        return tensor

    @staticmethod
    def backward(ctx: Any, *grad_output: torch.Tensor) -> tuple:
        """Wait for the group's reload before its backward uses it."""
        ctx.cpu_offload_handler.on_group_commit_backward(ctx.name)
        return (*grad_output, None, None, None, None)


class FineGrainedOffloadingGroupStartFunction(torch.autograd.Function):
    """Identity at the start of a group: opens it in the forward, reloads the next group in the backward."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, cpu_offload_handler: ChunkOffloadHandler, name: str) -> torch.Tensor:
        """Open the group ``name`` on the chunk."""
        ctx.cpu_offload_handler = cpu_offload_handler
        cpu_offload_handler.on_group_start_forward(name, tensor.device.type)
        return tensor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        """The group's backward is done: reload the group before it."""
        ctx.cpu_offload_handler.on_group_start_backward()
        return grad_output, None, None


class FineGrainedOffloadingBackwardRecordFunction(torch.autograd.Function):
    """Identity whose backward makes the compute stream wait for the reload stream (CUDA-graph boundaries)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:
        """Nothing to do in the forward."""
        return tensor

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        """Record the graph event on the compute stream and wait for pending reloads."""
        manager = _manager()
        stream = current_stream(grad_output.device.type)
        stream.record_event(manager.cuda_graph_event)
        stream.wait_stream(manager.transfer_streams(grad_output.device.type)[1])
        return (grad_output,)


def fine_grained_offloading_group_offload(tensor: Any, name: str, forced_released_tensors: list | None = None,
                                          delay_offload: bool = False) -> Any:
    """Commit the group ``name`` on ``tensor`` (for a tuple or list: on its first tensor); the storages of
    ``forced_released_tensors`` that the group moved to the host are freed (``untyped_storage().resize_(0)``)."""
    forced = [] if forced_released_tensors is None else forced_released_tensors
    if isinstance(tensor, (tuple, list)):
        if not tensor:
            return tensor
        first = fine_grained_offloading_group_offload(tensor[0], name, forced, delay_offload)
        return type(tensor)([first, *tensor[1:]])
    chunk = _manager().cur_forward_chunk()
    if chunk is None:
        return tensor
    return FineGrainedOffloadingGroupCommitFunction.apply(tensor, chunk, name, forced, delay_offload)


def fine_grained_offloading_group_start(tensor: torch.Tensor, name: str | None = None) -> torch.Tensor:
    """Open the group ``name`` on ``tensor`` in the current forward chunk (no chunk: ``tensor`` unchanged)."""
    chunk = _manager().pop_forward_chunk(name=name)
    if chunk is None:
        return tensor
    return FineGrainedOffloadingGroupStartFunction.apply(tensor, chunk, name)


class FineGrainedActivationOffloadingInterface:
    """The context a layer wraps an offloaded module in (see the module docstring) and the manager's
    entry points the models, schedules and CUDA-graph code call."""

    def __init__(self, offload: bool, tensor: torch.Tensor, name: str) -> None:
        # Without gradients nothing is saved for a backward: no group to record.
        self.offload = bool(offload) and torch.is_grad_enabled()
        self.tensor = tensor
        self.name = name

    def __enter__(self) -> torch.Tensor:
        """Open the group; returns the tensor to feed the module (an identity of the one given)."""
        if self.offload:
            self.tensor = fine_grained_offloading_group_start(self.tensor, self.name)
            _manager().__enter__()
        return self.tensor

    def __exit__(self, *args: Any) -> None:
        """Stop collecting the group's saved tensors (the group is committed by :meth:`group_offload`)."""
        if self.offload:
            _manager().__exit__(*args)

    def group_offload(self, tensor: Any, forced_released_tensors: list | None = None,
                      delay_offload: bool = False) -> Any:
        """Commit the group on ``tensor`` (see :func:`fine_grained_offloading_group_offload`)."""
        if self.offload:
            return fine_grained_offloading_group_offload(tensor, self.name, forced_released_tensors, delay_offload)
        return tensor

    @staticmethod
    def cuda_graph_stream() -> Any:
        """The manager's stream for CUDA-graph integrations."""
        return _manager().cuda_graph_stream

    @staticmethod
    def cuda_graph_event() -> Any:
        """The manager's event for CUDA-graph integrations."""
        return _manager().cuda_graph_event

    @staticmethod
    def init_chunk_handler(pp_rank: int, vp_size: int | None, vp_stage: int | None, min_offloaded_tensor_size: int,
                           delta_offload_bytes_across_pp_ranks: int, activation_offload_fraction: float,
                           max_inflight_offloads: int | None = None) -> None:
        """Start a model chunk's micro-batch (see ``PipelineOffloadManager.init_model_chunk_offload_handler``)."""
        _manager().init_model_chunk_offload_handler(
            pp_rank, vp_size, vp_stage, min_offloaded_tensor_size, delta_offload_bytes_across_pp_ranks,
            activation_offload_fraction, max_inflight_offloads=max_inflight_offloads)

    @staticmethod
    def get_context(flag: bool) -> Any:
        """The manager as a saved-tensor context when ``flag``, else a null context."""
        return _manager() if flag else contextlib.nullcontext()

    @staticmethod
    def mark_not_offload(tensor: torch.Tensor | None) -> None:
        """Keep ``tensor`` on the device whenever it is saved."""
        _manager().mark_not_offload(tensor)

    @staticmethod
    def forward_record() -> None:
        """Record the graph event on the compute stream and make it wait for pending offloads."""
        manager = _manager()
        device_type = "cuda" if device.cuda_available() else "cpu"
        stream = current_stream(device_type)
        stream.record_event(manager.cuda_graph_event)
        stream.wait_stream(manager.transfer_streams(device_type)[0])

    @staticmethod
    def backward_record(tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` through :class:`FineGrainedOffloadingBackwardRecordFunction`."""
        return FineGrainedOffloadingBackwardRecordFunction.apply(tensor)

    @staticmethod
    def reset() -> None:
        """End of an iteration (the schedules call it)."""
        _manager().reset()

    @staticmethod
    def reset_instance() -> None:
        """Start over with a fresh manager."""
        PipelineOffloadManager.reset_instance()

    @staticmethod
    def flush_delayed_groups() -> None:
        """Run the group commits queued during a CUDA-graph replay."""
        _manager().flush_delayed_groups()

    @staticmethod
    def disable_offload() -> None:
        """Stop offloading."""
        _manager().disable_offload()

    @staticmethod
    def enable_offload() -> None:
        """Offload again."""
        _manager().enable_offload()

    @staticmethod
    def enter_replay() -> None:
        """A CUDA graph replays: commits made with ``delay_offload`` are queued."""
        _manager()._in_replay = True

    @staticmethod
    def exit_replay() -> None:
        """The replay is over."""
        _manager()._in_replay = False


def start_model_chunk(model: torch.nn.Module, config: Any, pp_rank: int, vp_stage: int | None) -> None:
    """A model chunk's forward starts a micro-batch (``GPTModel`` / ``HybridModel``'s
    ``preprocess_for_fine_grained_offloading``); the first time, every parameter of ``model`` is marked to stay
    on the device (``model.disable_param_offloading`` turns False)."""
    FineGrainedActivationOffloadingInterface.init_chunk_handler(
        pp_rank=pp_rank, vp_size=config.virtual_pipeline_model_parallel_size, vp_stage=vp_stage,
        min_offloaded_tensor_size=config.min_offloaded_tensor_size,
        delta_offload_bytes_across_pp_ranks=config.delta_offload_bytes_across_pp_ranks,
        activation_offload_fraction=config.activation_offload_fraction,
        max_inflight_offloads=config.fine_grained_offloading_max_inflight_offloads)
    if getattr(model, "disable_param_offloading", True):
        for param in model.parameters():
            FineGrainedActivationOffloadingInterface.mark_not_offload(param)
        model.disable_param_offloading = False
