"""The ``examples/gpt_training`` modules imported in the test process, and the tiny ``pretrain_gpt.py`` flags."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

EXAMPLES = str(Path(__file__).resolve().parents[2] / "examples")
# A two-layer GPT on mock data, one micro-batch of 2 per step, a log line per step.
TINY = ["--model-preset", "tiny", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
        "--seq-length", "32", "--max-position-embeddings", "32", "--mock-data", "--vocab-size", "127",
        "--micro-batch-size", "2", "--global-batch-size", "2", "--log-interval", "1", "--no-progress"]


def gpt_training(module: str) -> ModuleType:
    """``examples/gpt_training/<module>``, with ``examples/`` on ``sys.path`` only while it is imported."""
    sys.path.insert(0, EXAMPLES)
    try:
        return importlib.import_module(f"gpt_training.{module}")
    finally:
        sys.path.remove(EXAMPLES)
