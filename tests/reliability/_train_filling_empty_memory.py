"""Run ``examples/pretrain_gpt.py`` with every uninitialised allocation filled with NaN (or the integer max).

Run as ``python _train_filling_empty_memory.py fill|plain PRETRAIN_ARGS...``. With ``fill``, deterministic
algorithms are on (warnings only) and ``torch.utils.deterministic.fill_uninitialized_memory`` makes every
``torch.empty`` and ``empty_like`` hand out NaN-filled memory, so a read of memory that was never written
shows up as a NaN loss or a changed one.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import torch

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "pretrain_gpt.py"

if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    if mode == "fill":
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.utils.deterministic.fill_uninitialized_memory = True
    sys.argv = [str(SCRIPT), *args]
    runpy.run_path(str(SCRIPT), run_name="__main__")
