"""One model chunk's offload groups (Megatron-Core's ``OffloadTensorGroup`` and ``ChunkOffloadHandler``).

A *group* is the set of activations autograd saves inside one module scope (``attn_norm``, ``core_attn``,
...). While the scope runs, a saved-tensor hook hands each saved tensor to :meth:`ChunkOffloadHandler.tensor_push`,
which keeps it under a tag; at the group's commit (after the module) every large enough tensor is copied to
a host buffer and the device copy is dropped. In the backward, the start marker of each group reloads the
previous group ahead of use, and :meth:`~ChunkOffloadHandler.tensor_pop` hands autograd its tensor back.

Surprises, each a deliberate safety rule this library adds to Megatron-Core's design:

- a tag carries its handler, so a saved tensor comes back from the chunk that saved it whatever order the
  schedule runs backward passes in;
- a tensor not reloaded yet when autograd needs it is copied back right there (after its offload finished),
  and the compute stream always waits for a reload before using its tensors;
- a commit's ``forced_released_tensors`` are freed (``untyped_storage().resize_(0)``) only when this group
  offloaded their storage and no other group of the chunk still holds it on the device.

On CUDA the copies run on side streams into pinned buffers; a CPU run copies synchronously into separate
host buffers (:mod:`.streams`), so the mechanism and its numerics are the same on both.
"""

from __future__ import annotations

from collections import defaultdict, deque
from typing import Any, NamedTuple

import torch

from megatron_core import device
from megatron_core._activation_offload.streams import current_stream, new_event, new_stream, use_stream
from megatron_core._activation_offload.tensor_pool import OffloadTensorPool
from megatron_core._nvtx import nvtx_range_pop, nvtx_range_push

__all__ = ["ChunkOffloadHandler", "OffloadTensorGroup"]

# MoE groups change shape with the routing, so their buffers are not pooled.
_UNPOOLED_GROUPS = ("expert_fc1", "moe_act", "fused_group_mlp")


class _Offloaded(NamedTuple):
    """A saved tensor that lives in ``host`` now; it goes back to ``device``."""

    device: torch.device
    host: torch.Tensor
    from_pool: bool


class _Reloaded(NamedTuple):
    """A saved tensor copied back to the device ahead of use; ``host`` returns to the pool once it is used."""

    tensor: torch.Tensor
    host: torch.Tensor
    from_pool: bool


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _do_not_offload(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` (or a Transformer Engine tensor's data) was marked to stay on the device."""
    if getattr(tensor, "_do_not_offload", False) or getattr(tensor, "_TE_do_not_offload", False):
        return True
    get_data = getattr(tensor, "get_data_tensors", None)
    if get_data is None:
        return False
    return any(t is not None and getattr(t, "_TE_do_not_offload", False) for t in get_data())


class OffloadTensorGroup:
    """The tensors saved inside one module scope, offloaded and reloaded together."""

    def __init__(self, name: str, device_type: str | None = None) -> None:
        self._name = name
        self.device_type = device_type or ("cuda" if device.cuda_available() else "cpu")
        self._tensors: dict[Any, Any] = {}
        self._offload_event = new_event(self.device_type)
        self._reload_event = new_event(self.device_type)
        self.offload = True  # the policy (PipelineOffloadManager.post_warmup_callback) may keep it on the device
        self.total_offload_bytes = 0
        self.total_tensor_count = 0
        self.use_cpu_pool = name not in _UNPOOLED_GROUPS
        self.reload_waited = True  # whether the compute stream has waited for this group's last reload

    def push_tensor(self, tag: Any, tensor: Any) -> None:
        """Keep ``tensor`` (or its offloaded/reloaded state) under ``tag``."""
        self._tensors[tag] = tensor

    def pop_tensor(self, tag: Any) -> Any:
        """Remove and return what is kept under ``tag``."""
        return self._tensors.pop(tag)

    def record_offload_event(self, stream: Any) -> None:
        """Mark the end of this group's offload copies on ``stream``."""
        self._offload_event.record(stream)

    def wait_offload_event(self, stream: Any) -> None:
        """Make ``stream`` wait until the offload copies are done."""
        stream.wait_event(self._offload_event)

    def record_reload_event(self, stream: Any) -> None:
        """Mark the end of this group's reload copies on ``stream``."""
        self._reload_event.record(stream)

    def wait_reload_event(self, stream: Any) -> None:
        """Make ``stream`` wait until the reload copies are done."""
        stream.wait_event(self._reload_event)
        self.reload_waited = True

    def update_offload_info(self, tensor: torch.Tensor) -> None:
        """Count ``tensor`` in this group's offloaded bytes and tensors (first iteration only)."""
        self.total_offload_bytes += tensor.numel() * tensor.element_size()
        self.total_tensor_count += 1

    def __repr__(self) -> str:
        return f"OffloadTensorGroup({self._name!r}, offload={self.offload}, bytes={self.total_offload_bytes})"


class ChunkOffloadHandler:
    """The offload groups of one model chunk for one micro-batch: records them, copies and reloads them.

    ``manager`` is the :class:`~megatron_core._activation_offload.manager.PipelineOffloadManager` that orders
    chunks (its streams, the next backward chunk); without one the handler works alone (tests, one chunk).
    """

    def __init__(self, min_offloaded_tensor_size: int, cpu_tensor_pool: OffloadTensorPool,
                 max_inflight_offloads: int | None = None, *, manager: Any = None) -> None:
        self.do_offload = True
        self.offload_groups: list[OffloadTensorGroup] = []
        self._offloaded_group_index = 0  # 1-based index of the group opened last in this forward
        self._groups_to_offload: list[OffloadTensorGroup] = []  # opened, not committed yet
        self._groups_to_reload: list[OffloadTensorGroup] = []  # offloaded, reloaded last-first in the backward
        self._tensor_count_current_group = 0
        self._max_group_size = 0
        self._reloading_group: list[OffloadTensorGroup] = []  # reloads the compute stream has not waited for
        self.min_offloaded_tensor_size = min_offloaded_tensor_size
        self.cpu_tensor_pool = cpu_tensor_pool
        self.is_warmup = True
        self.vpp_rank = 0
        self.device_type: str | None = None  # the device of the activations, known at the first group
        self._manager = manager
        self._streams: tuple[Any, Any] | None = None
        self._max_inflight_offloads = max_inflight_offloads
        self._offload_pending_by_name: dict[str, deque] = defaultdict(deque)
        self._device_holds: dict[int, int] = defaultdict(int)  # storage -> tensors of groups kept on the device

    # ----- streams -----------------------------------------------------------------------------------------
    def _transfer_streams(self) -> tuple[Any, Any]:
        if self._streams is None:
            device_type = self.device_type or "cpu"
            if self._manager is not None:
                self._streams = self._manager.transfer_streams(device_type)
            else:
                self._streams = (new_stream(device_type), new_stream(device_type))
        return self._streams

    @property
    def d2h_stream(self) -> Any:
        """The stream offload copies run on."""
        return self._transfer_streams()[0]

    @property
    def h2d_stream(self) -> Any:
        """The stream reload copies run on."""
        return self._transfer_streams()[1]

    def _current_stream(self) -> Any:
        return current_stream(self.device_type or "cpu")

    # ----- state -------------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Rewind for the next iteration (the groups and their policy are kept)."""
        self._offloaded_group_index = 0
        self._groups_to_offload = []
        self._groups_to_reload = []
        self._tensor_count_current_group = 0
        self._reloading_group = []
        self._offload_pending_by_name.clear()
        self._device_holds.clear()
        for group in self.offload_groups:  # a forward without backward leaves tensors behind
            group._tensors.clear()
            group.reload_waited = True

    @staticmethod
    def find_group_with_name(groups: list[OffloadTensorGroup], name: str, start_index: int = 0
                             ) -> OffloadTensorGroup | None:
        """The first group named ``name`` in ``groups[start_index:]``."""
        return next((g for g in groups[start_index:] if g._name == name), None)

    def is_empty_chunk(self, name: str | None = None) -> bool:
        """Whether this chunk has no group (named ``name``, when given)."""
        if name is not None:
            return self.find_group_with_name(self.offload_groups, name) is None
        return self._max_group_size == 0

    def finish_all_groups(self, name: str | None = None) -> bool:
        """Whether this chunk's forward is past its last group (named ``name``)."""
        if not self._groups_to_reload and not self._groups_to_offload and self._offloaded_group_index > 0:
            return True
        if name is None:
            raise ValueError("ChunkOffloadHandler.finish_all_groups: name is required while groups are pending")
        return self.find_group_with_name(self.offload_groups, name, self._offloaded_group_index) is None

    def find_next_group(self, name: str) -> OffloadTensorGroup | None:
        """The next group named ``name`` after the one opened last."""
        return self.find_group_with_name(self.offload_groups, name, self._offloaded_group_index)

    def get_max_deduplicated_groups(self) -> int:
        """The number of distinct group names of this chunk."""
        return len({g._name for g in self.offload_groups})

    # ----- which tensors move ------------------------------------------------------------------------------
    def _can_manage_tensor_for_offload(self, tensor: torch.Tensor) -> bool:
        """A saved activation on this chunk's device (not a parameter, not a fake/functional tensor)."""
        stray = isinstance(tensor, (torch._subclasses.fake_tensor.FakeTensor,
                                    torch._subclasses.functional_tensor.FunctionalTensor))
        return (not isinstance(tensor, torch.nn.Parameter) and not stray
                and tensor.device.type == (self.device_type or tensor.device.type))

    def tensor_need_offloading_checker(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` moves to the host: managed, not marked to stay, at least
        ``min_offloaded_tensor_size`` elements."""
        return (self._can_manage_tensor_for_offload(tensor) and not _do_not_offload(tensor)
                and tensor.numel() >= self.min_offloaded_tensor_size)

    # ----- saved-tensor hooks ------------------------------------------------------------------------------
    def tensor_push(self, tensor: torch.Tensor) -> Any:
        """Keep a tensor autograd saves inside the open group; returns its tag (or the tensor, if unmanaged)."""
        if not self._can_manage_tensor_for_offload(tensor):
            return tensor
        tag = (self, self._offloaded_group_index, self._tensor_count_current_group)
        self._tensor_count_current_group += 1
        self.offload_groups[self._offloaded_group_index - 1].push_tensor(tag, tensor)
        self._device_holds[_storage_key(tensor)] += 1
        return tag

    def tensor_pop(self, tensor_tag: Any) -> torch.Tensor:
        """The saved tensor of ``tensor_tag`` on the device, for autograd's backward."""
        if isinstance(tensor_tag, torch.Tensor):
            return tensor_tag
        _, group_index, _ = tensor_tag
        group = self.offload_groups[group_index - 1]
        item = group.pop_tensor(tensor_tag)
        stream = self._current_stream()
        if isinstance(item, _Offloaded):  # not reloaded ahead: copy it back now, after its offload finished
            group.wait_offload_event(stream)
            tensor = self.reload(item)
            self._return_host_buffer(item.host, item.from_pool)
            return tensor
        if isinstance(item, _Reloaded):
            if not group.reload_waited:
                group.wait_reload_event(stream)
            if item.tensor.device.type == "cuda":
                item.tensor.record_stream(stream)  # allocated on the reload stream, used on this one
            self._return_host_buffer(item.host, item.from_pool)
            return item.tensor
        self._release_hold(item)  # kept on the device all along
        return item

    def _release_hold(self, tensor: torch.Tensor) -> None:
        key = _storage_key(tensor)
        self._device_holds[key] -= 1
        if self._device_holds[key] <= 0:
            del self._device_holds[key]

    def _return_host_buffer(self, host: torch.Tensor, from_pool: bool) -> None:
        # Safe to reuse now: the compute stream has waited for the reload, and later offloads wait for it.
        if from_pool:
            self.cpu_tensor_pool.free(host)

    # ----- copies ------------------------------------------------------------------------------------------
    def offload(self, src_tensor: torch.Tensor, pin_memory: bool = True, use_cpu_pool: bool = True) -> _Offloaded:
        """Copy ``src_tensor`` into a host buffer (asynchronously from CUDA into pinned memory).

        The buffer keeps the tensor's strides when it is dense (a transpose, say), so the backward sees the
        same layout and sums in the same order; other views are copied contiguous.
        """
        stride = torch.empty_like(src_tensor, device="meta").stride()
        on_cuda = src_tensor.device.type == "cuda"
        if use_cpu_pool:
            host = self.cpu_tensor_pool.allocate(src_tensor.shape, dtype=src_tensor.dtype, stride=stride)
        else:
            host = torch.empty_strided(src_tensor.shape, stride, dtype=src_tensor.dtype, device="cpu",
                                       pin_memory=pin_memory and on_cuda)
        host.copy_(src_tensor, non_blocking=on_cuda and host.is_pinned())
        return _Offloaded(src_tensor.device, host, use_cpu_pool)

    def reload(self, state: _Offloaded, non_blocking: bool | None = None) -> torch.Tensor:
        """A new device tensor (same strides) holding ``state``'s host copy (asynchronous from pinned memory)."""
        dev, host, _ = state
        if non_blocking is None:
            non_blocking = dev.type == "cuda" and host.is_pinned()
        tensor = torch.empty_strided(host.size(), host.stride(), dtype=host.dtype, device=dev)
        tensor.copy_(host, non_blocking=non_blocking)
        return tensor

    def bulk_offload_group(self, group_to_offload: OffloadTensorGroup) -> set[int]:
        """Offload every large enough tensor of the group; returns the storages it moved."""
        moved: set[int] = set()
        msg = "activation offloading " + group_to_offload._name
        nvtx_range_push(msg)
        d2h = self.d2h_stream
        with use_stream(d2h):
            for tag, tensor in list(group_to_offload._tensors.items()):
                if not isinstance(tensor, torch.Tensor) or not self.tensor_need_offloading_checker(tensor):
                    continue
                state = self.offload(tensor, use_cpu_pool=group_to_offload.use_cpu_pool)
                if self.is_warmup:
                    group_to_offload.update_offload_info(tensor)
                if tensor.device.type == "cuda":
                    tensor.record_stream(d2h)  # the copy reads it after this thread lets go of it
                moved.add(_storage_key(tensor))
                self._release_hold(tensor)
                group_to_offload.push_tensor(tag, state)
            group_to_offload.record_offload_event(d2h)
        nvtx_range_pop(msg)
        if self._max_inflight_offloads is not None:
            name = group_to_offload._name
            self._offload_pending_by_name[name].append(group_to_offload._offload_event)
            self._drain_offload_pending(name)
        return moved

    def _drain_offload_pending(self, group_name: str) -> None:
        """Make the compute stream wait for the oldest offloads of ``group_name`` beyond
        ``max_inflight_offloads`` (0: wait for each one)."""
        if self._max_inflight_offloads is None:
            return
        stream = self._current_stream()
        pending = self._offload_pending_by_name[group_name]
        while len(pending) > self._max_inflight_offloads:
            stream.wait_event(pending.popleft())

    def bulk_reload_group(self) -> None:
        """Reload the last offloaded group not reloaded yet, on the reload stream."""
        group = self._groups_to_reload.pop()
        msg = "activation reloading " + group._name
        nvtx_range_push(msg)
        h2d = self.h2d_stream
        with use_stream(h2d):
            group.wait_offload_event(h2d)
            for tag, state in list(group._tensors.items()):
                if isinstance(state, _Offloaded):
                    group.push_tensor(tag, _Reloaded(self.reload(state), state.host, state.from_pool))
            group.record_reload_event(h2d)
        group.reload_waited = False
        self._reloading_group.append(group)
        nvtx_range_pop(msg)

    def pre_reload_last_layer(self) -> None:
        """Reload this chunk's last offloaded group early (before its backward starts)."""
        if self._groups_to_reload:
            self.bulk_reload_group()

    # ----- policy ------------------------------------------------------------------------------------------
    def should_bulk_offload(self, group: OffloadTensorGroup) -> bool:
        """Whether to offload ``group`` now: always in the first iteration, then as the policy says, and never
        the last group of its name when this chunk's backward comes next (it would be reloaded at once)."""
        if self.is_warmup:
            return True
        if not group.offload:
            return False
        if self._manager is not None and self._manager.front_backward_chunk(group._name) is self:
            return self.find_next_group(group._name) is not None
        return True

    def bulk_offload(self, name: str, forced_released_tensors: list[torch.Tensor]) -> None:
        """Commit the open group ``name``: offload it (if the policy says so) and free the storages of
        ``forced_released_tensors`` that it moved and no other group keeps on the device."""
        group = self.find_group_with_name(self._groups_to_offload, name)
        if group is None:
            raise RuntimeError(f"fine-grained activation offloading: no open group {name!r} to commit "
                               f"(open: {[g._name for g in self._groups_to_offload]})")
        if self.should_bulk_offload(group):
            self._groups_to_reload.append(group)
            moved = self.bulk_offload_group(group)
            stream = self._current_stream()
            for tensor in forced_released_tensors:
                key = _storage_key(tensor)
                if (key in moved and self._device_holds.get(key, 0) == 0
                        and self.tensor_need_offloading_checker(tensor)):
                    if tensor.device.type == "cuda":
                        tensor.record_stream(stream)
                    tensor.untyped_storage().resize_(0)
        self._groups_to_offload.remove(group)

    # ----- group markers -----------------------------------------------------------------------------------
    def on_group_start_forward(self, name: str, device_type: str | None = None) -> None:
        """A group ``name`` opens (forward): a new group in the first iteration, else the recorded one."""
        if not self.do_offload:
            return
        if self.device_type is None:
            self.device_type = device_type
        self._offloaded_group_index += 1
        if self.is_warmup:
            self.offload_groups.append(OffloadTensorGroup(name, self.device_type))
            self._max_group_size = max(self._max_group_size, self._offloaded_group_index)
        else:
            while (self._offloaded_group_index <= len(self.offload_groups)
                   and self.offload_groups[self._offloaded_group_index - 1]._name != name):
                self._offloaded_group_index += 1
            if self._offloaded_group_index > len(self.offload_groups):
                raise RuntimeError(f"fine-grained activation offloading: group {name!r} was not seen in the first "
                                   "iteration; every iteration must run the same layers and micro-batches")
        self._tensor_count_current_group = 0
        self._groups_to_offload.append(self.offload_groups[self._offloaded_group_index - 1])

    def on_group_commit_forward(self, name: str, forced_released_tensors: list[torch.Tensor]) -> None:
        """The group ``name`` closes (forward): offload it after the compute that produced it."""
        if not self.do_offload:
            return
        self.d2h_stream.wait_stream(self._current_stream())
        self.bulk_offload(name, forced_released_tensors)

    def bulk_reload(self) -> None:
        """Reload the next group of this chunk, or prefetch the next backward chunk's last group."""
        if self._groups_to_reload:
            self.bulk_reload_group()
            return
        if self._manager is None:
            return
        nxt = self._manager.front_backward_chunk()
        if nxt is not None and nxt is not self and nxt._offloaded_group_index == nxt._max_group_size:
            nxt.pre_reload_last_layer()

    def on_group_commit_backward(self, name: str) -> None:
        """The backward reaches the end of group ``name``: make this the backward chunk and wait for the
        group's reload."""
        if not self.do_offload:
            return
        if self._manager is not None:
            self._manager.activate_backward_chunk(self, name)
        for group in self._reloading_group:
            if group._name == name:
                if not group.reload_waited:
                    group.wait_reload_event(self._current_stream())
                self._reloading_group.remove(group)
                break

    def on_group_start_backward(self) -> None:
        """The backward passes the start of a group: reload the next group ahead of use."""
        if not self.do_offload:
            return
        self.h2d_stream.wait_stream(self._current_stream())
        self.bulk_reload()
