"""``FileSystemWriterAsync``: a DCP file-system writer whose writing is split from its planning.

Megatron-Core's protocol: ``prepare_write_data(plan, planner)`` stages this rank's data (tensors
detached, views cloned, so training may go on), ``get_save_function_and_args()`` returns the function
that writes the files (to run in the background, e.g. as an ``AsyncRequest``), a function that moves
staged tensors to CPU, and that function's arguments; ``retrieve_write_results()`` then hands the
write results to ``finish``. The writing itself is DCP's ``FileSystemWriter.write_data`` on the staged
data (``thread_count`` files per rank), so the files are ordinary DCP files.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StoragePrefix
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from megatron_core.dist_checkpointing import collectives

logger = logging.getLogger(__name__)

_results_queue: queue.Queue | None = None

# (file path, file name, (bytes items, tensor items)) of one rank: what this rank writes.
WriteBucket = tuple[str, str, tuple[list, list]]


def get_write_results_queue(mp_mode: str = "spawn") -> queue.Queue:
    """The process-wide queue the write functions put their results on (created on first use).

    ``mp_mode`` is accepted for Megatron-Core's signature; the writers here are threads, so the queue
    is a ``queue.Queue``, not a multiprocessing one.
    """
    global _results_queue
    if _results_queue is None:
        _results_queue = queue.Queue()
    return _results_queue


class _StagedPlanner:
    """Answers ``resolve_data`` from data staged by ``prepare_write_data`` (so the model may change meanwhile)."""

    def __init__(self, staged: dict[Any, Any]) -> None:
        self.staged = staged

    def resolve_data(self, write_item: Any) -> Any:
        return self.staged[write_item.index]


def _stage(data: Any) -> Any:
    if not isinstance(data, torch.Tensor):
        return data
    data = data.detach()
    if data.device.type != "cpu":
        return data  # copied to CPU by preload_tensors
    is_view = data.untyped_storage().nbytes() != data.numel() * data.element_size()
    return data.clone() if is_view or not data.is_contiguous() else data


class FileSystemWriterAsync(FileSystemWriter):
    """A ``FileSystemWriter`` whose file writing can run outside the call that plans it (see the module doc).

    Args:
        path: the checkpoint directory.
        separation_hint: accepted for Megatron-Core's signature; needs ``thread_count >= 2`` as there.
        use_msc: Multi-Storage Client paths are not supported (``ValueError``).
        *args, **kwargs: ``FileSystemWriter``'s arguments; ``single_file_per_rank`` must stay True.
    """

    def __init__(self, path: str | os.PathLike, *args: Any, separation_hint: str | None = None,
                 use_msc: bool = False, **kwargs: Any) -> None:
        if use_msc:
            raise ValueError("FileSystemWriterAsync(use_msc=True): Multi-Storage Client is not supported by "
                             "megatron_core")
        self.checkpoint_dir = path
        self.use_msc = use_msc
        super().__init__(path, *args, **kwargs)
        if not self.single_file_per_rank:
            raise NotImplementedError("single_file_per_rank flag not supported for FileSystemWriterAsync")
        if separation_hint is not None and self.thread_count < 2:
            raise ValueError("thread_count must be at least 2 if separation_hint is provided")
        self.separation_hint = separation_hint
        self.can_run_decentralized_global_plan = True
        self.write_buckets: list[WriteBucket] | None = None
        self.results_queue: queue.Queue | None = None
        self._plan: SavePlan | None = None
        self._staged: dict[Any, Any] = {}

    def prepare_write_data(self, plan: SavePlan, planner: SavePlanner) -> None:
        """Stage this rank's items of ``plan`` (detached tensors, views cloned) into ``self.write_buckets``."""
        self._plan = plan
        self._staged = {item.index: _stage(planner.resolve_data(item)) for item in plan.items}
        bytes_data = [(item, self._staged[item.index]) for item in plan.items if item.type == WriteItemType.BYTE_IO]
        tensor_data = [(item, self._staged[item.index]) for item in plan.items if item.type != WriteItemType.BYTE_IO]
        prefix = getattr(plan.storage_data, "prefix", "")
        self.write_buckets = []
        if bytes_data or tensor_data:
            name = f"{prefix}0.distcp"
            self.write_buckets.append((os.path.join(str(self.checkpoint_dir), name), name, (bytes_data, tensor_data)))
        self.results_queue = get_write_results_queue() if self.write_buckets else None

    def get_save_function_and_args(self) -> tuple[Callable | None, Callable | None, list]:
        """``(write function, preload function, write arguments)``, or ``(None, None, [])`` with nothing to write.

        Call the write function as ``fn(*args)``; it puts this rank's write results on the results queue.
        """
        if not self.write_buckets:
            return None, None, []
        return (self._write_staged, partial(self.preload_tensors, self.write_buckets, True),
                [collectives.get_rank(), self.write_buckets, self.results_queue])

    @staticmethod
    def preload_tensors(write_buckets: list[WriteBucket], non_blocking: bool = True) -> list[WriteBucket]:
        """The buckets with every staged tensor copied to CPU memory."""
        out = []
        for path, name, (bytes_data, tensor_data) in write_buckets:
            tensors = [(item, t.to("cpu", non_blocking=non_blocking)) for item, t in tensor_data]
            out.append((path, name, (bytes_data, tensors)))
        if non_blocking and torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.synchronize()
        return out

    def _write_staged(self, rank: int, write_buckets: list[WriteBucket], results_queue: queue.Queue) -> None:
        for _, _, (bytes_data, tensor_data) in write_buckets:  # preloaded CPU copies, if any
            for item, data in bytes_data + tensor_data:
                self._staged[item.index] = data
        start = time.monotonic()
        try:
            results: Any = FileSystemWriter.write_data(self, self._plan, _StagedPlanner(self._staged)).wait()
            logger.debug("rank %d: checkpoint files written in %.3f s", rank, time.monotonic() - start)
        except Exception as e:  # noqa: BLE001 - handed to retrieve_write_results
            logger.error("rank %d: writing checkpoint files to %s failed: %s", rank, self.checkpoint_dir, e)
            results = e
        results_queue.put((id(self), results))

    def retrieve_write_results(self) -> list[WriteResult]:
        """This rank's write results; ``RuntimeError`` when the write failed or has not run."""
        if self.write_buckets is None:
            raise RuntimeError("prepare_write_data was not called")
        if self.results_queue is None:
            return []
        pending, found = [], None
        while found is None:
            try:
                owner, results = self.results_queue.get_nowait()
            except queue.Empty:
                break
            if owner == id(self):
                found = results
            else:
                pending.append((owner, results))
        for entry in pending:  # results of other writers sharing the queue
            self.results_queue.put(entry)
        if found is None:
            raise RuntimeError("results_queue should not be empty: the write function has not run")
        if isinstance(found, Exception):
            raise RuntimeError(f"Worker failure: {found}") from found
        return list(found)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> torch.futures.Future:
        """Stage and write ``plan`` now (the synchronous path); a completed future of the results."""
        self.prepare_write_data(plan, planner)
        fn, _, args = self.get_save_function_and_args()
        future: torch.futures.Future = torch.futures.Future()
        if fn is None:
            future.set_result([])
            return future
        fn(*args)
        future.set_result(self.retrieve_write_results())
        return future

    def prepare_decentralized_global_plan(self, local_plan: SavePlan) -> SavePlan:
        """The global plan of this rank without the coordinator: file prefix ``__<rank>_``."""
        return dataclasses.replace(local_plan, storage_data=_StoragePrefix(f"__{collectives.get_rank()}_"))

    @property
    def checkpoint_id(self) -> str:
        """The checkpoint directory."""
        return str(self.checkpoint_dir)


__all__ = ["FileSystemWriterAsync", "get_write_results_queue"]
