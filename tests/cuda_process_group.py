"""A one-rank NCCL process group in the test process, for GPU tests that drive DDP and the distributed optimizer."""

from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
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


def _run_with_group(fn: Callable[..., Any], args: tuple) -> Any:
    try:
        with tempfile.TemporaryDirectory() as store_dir, one_rank_nccl_group(Path(store_dir)):
            return fn(*args)
    except Exception as err:  # re-raised as text: an exception holding frames (Dynamo's) cannot be pickled back
        raise RuntimeError("in the fresh process:\n" + "".join(traceback.format_exception(err))) from None


def in_fresh_process(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` in a new (spawned) process with its own one-rank NCCL group; its result, pickled back.

    For comparisons that need each run compiled from the same process state: Inductor may compile the same model
    differently the second time in a process (seen 2026-12-04 on an H200: another fusion of an FP8 layer's RMSNorm
    and amax, first losses 4.20631 and 4.20692), so two compiled runs in one process need not be bit for bit equal."""
    with concurrent.futures.ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_run_with_group, fn, args).result()
