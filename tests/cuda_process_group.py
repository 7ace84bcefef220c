"""A one-rank NCCL process group in the test process, for GPU tests that drive DDP and the distributed optimizer."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

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
