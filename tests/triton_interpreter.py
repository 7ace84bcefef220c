"""Run a Triton kernel's check on the CPU, in Triton's interpreter, in a fresh Python process.

A fresh process because Triton builds its library functions (``tl.sum``'s combine, for one) for the interpreter
only when ``TRITON_INTERPRET`` is set before Triton is imported.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs Triton (its interpreter runs on CPU)")

DONE = "interpreted kernel ok"


def run_in_triton_interpreter(script: str, timeout: float = 300) -> None:
    """Run ``script`` (its checks: assertions) with ``TRITON_INTERPRET=1``; assert that it ran to its end."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", f"{script}\nprint({DONE!r})\n"], env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert done.returncode == 0 and DONE in done.stdout, done.stderr[-3000:]
