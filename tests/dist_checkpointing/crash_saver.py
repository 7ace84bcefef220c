"""Subprocess for the SIGKILL test: saves iteration 1, then starts iteration 2 and stalls at a given point.

``python -m tests.dist_checkpointing.crash_saver <save_dir> <point>`` where ``point`` is
``mid_write`` (iteration 2's data files are written, DCP's ``.metadata`` is not), ``before_publish``
(all files written into the temporary directory, not yet renamed into place) or
``before_tracker`` (directory published, tracker not moved). At that point it prints
``STALLED`` and sleeps until the parent kills it with SIGKILL.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch

from megatron_core.dist_checkpointing import serialization, sharded_state_dict_default
from megatron_core.dist_checkpointing.strategies import torch_dist
from megatron_core.training import checkpointing, save_checkpoint


class TinyModel(torch.nn.Module):
    """Two linear layers whose sharded state dict is built from their parameters."""

    def __init__(self, fill: float) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 8)
        with torch.no_grad():
            for p in self.parameters():
                p.fill_(fill)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Any = None) -> dict:
        return sharded_state_dict_default(self, prefix, sharded_offsets, metadata)


def _stall(*_: Any, **__: Any) -> None:
    print("STALLED", flush=True)
    time.sleep(600)


def main(save_dir: str, point: str) -> None:
    save_checkpoint(save_dir, 1, TinyModel(1.0), None, None)
    if point == "mid_write":
        torch_dist.FileSystemWriter.finish = _stall
    elif point == "before_publish":
        serialization.save_config = _stall
    elif point == "before_tracker":
        checkpointing.write_tracker = _stall
    else:
        raise ValueError(f"unknown point {point!r}")
    save_checkpoint(save_dir, 2, TinyModel(2.0), None, None)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
