"""A one-rank NCCL process group in the test process, for GPU tests that drive DDP and the distributed optimizer."""

from __future__ import annotations

import contextlib
import multiprocessing
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from megatron_core import parallel_state


@contextlib.contextmanager
def one_rank_nccl_group(tmp_path: Path) -> Iterator[None]:
    """Initialize NCCL (one rank, a file store under ``tmp_path``) and ``parallel_state``; tear both down after.
    Skips the test when a process group already exists."""
    if torch.distributed.is_initialized():
        pytest.skip("needs a process group of its own")
    torch.distributed.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        parallel_state.initialize_model_parallel()
        yield
    finally:
        parallel_state.destroy_model_parallel()
        torch.distributed.destroy_process_group()


def _run_with_group(results: Any, fn: Callable[..., Any], args: tuple, nccl_group: bool) -> None:
    try:
        with tempfile.TemporaryDirectory() as store_dir, (
                one_rank_nccl_group(Path(store_dir)) if nccl_group else contextlib.nullcontext()):
            # pickled here, by value: a tensor put on the queue as it is would be shared through memory that this
            # process frees when it exits
            results.put((True, pickle.dumps(fn(*args))))
    except Exception as err:  # sent as text: an exception holding frames (Dynamo's) cannot be pickled back
        results.put((False, "in the fresh process:\n" + "".join(traceback.format_exception(err))))


def in_fresh_process(fn: Callable[..., Any], *args: Any, timeout: float = 600, nccl_group: bool = True) -> Any:
    """``fn(*args)`` in a new (spawned) process with its own one-rank NCCL group (unless ``nccl_group=False``); its
    result, pickled back; its exception re-raised as a ``RuntimeError`` with the child's traceback; a
    ``TimeoutError`` after ``timeout`` seconds, the process then killed.

    For comparisons that need each run compiled from the same process state: Inductor may compile the same model
    differently the second time in a process (seen 2026-12-04 on an H200: another fusion of an FP8 layer's RMSNorm
    and amax, first losses 4.20631 and 4.20692), so two compiled runs in one process need not be bit for bit equal."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(target=_run_with_group, args=(results, fn, args, nccl_group))
    child.start()
    try:
        ok, value = results.get(timeout=timeout)
    except queue.Empty:
        child.kill()
        raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s in its fresh process") from None
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    if not ok:
        raise RuntimeError(value)
    return pickle.loads(value)  # from the child this test spawned
