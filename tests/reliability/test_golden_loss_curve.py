"""Section 7, check 8: a 50-step run of the reference config matches its committed golden curve exactly.

The curve (losses and grad norms, as exact float hex) is committed per torch version and device
kind under ``tests/reliability/golden/`` and is regenerated only by the explicit command
``python tools/golden_loss_curve.py --write``. Without a golden file for this torch version and
device kind the curve is compared with a golden of another device kind of the same torch version
within 5 % relative, and without any the test is skipped and says how to create one.
"""

from __future__ import annotations

import json

import pytest

from tests.dist_harness import run_on_ranks
from tests.reliability.golden_run import golden_path, run_curve, sibling_goldens


def _curve() -> dict:
    return run_on_ranks(1, run_curve)[0]


def test_matches_the_committed_golden_curve() -> None:
    """Exactly against this device kind's golden; else within 5 % of another device kind's (one test, no skip)."""
    path = golden_path()
    if path.is_file():
        _matches_exactly(path)
    elif sibling_goldens():
        _within_five_percent(sibling_goldens()[0])
    else:
        pytest.skip(f"no golden curve {path.name}; create it with: python tools/golden_loss_curve.py --write")


def _matches_exactly(path) -> None:
    golden = json.loads(path.read_text())
    curve = _curve()
    assert curve["steps"] == golden["steps"] == 50
    for name in ("lm_loss", "grad_norm"):
        for step, (got, want) in enumerate(zip(curve[name], golden[name]), start=1):
            assert got == want, (f"{name} at step {step}: {float.fromhex(got)!r} != golden {float.fromhex(want)!r} "
                                 f"({path.name}); if the change is intended, regenerate with "
                                 "python tools/golden_loss_curve.py --write")


def _within_five_percent(sibling) -> None:
    golden = json.loads(sibling.read_text())
    curve = _curve()
    for name in ("lm_loss", "grad_norm"):
        got = [float.fromhex(x) for x in curve[name]]
        want = [float.fromhex(x) for x in golden[name]]
        for step, (a, b) in enumerate(zip(got, want), start=1):
            assert abs(a - b) <= 0.05 * abs(b), f"{name} at step {step}: {a} vs {b} ({sibling.name})"


@pytest.mark.gpu
def test_gpu_curve_matches_the_committed_gpu_golden(tmp_path) -> None:
    """On a GPU: the same 50 steps under NCCL in deterministic mode equal this GPU kind's golden exactly."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    repo = Path(__file__).resolve().parents[2]
    import re

    kind = re.sub(r"[^a-z0-9]+", "_", f"cuda_{torch.cuda.get_device_name()}".lower()).strip("_")  # golden_run's
    if not list((repo / "tests" / "reliability" / "golden").glob(f"loss_curve-*-{kind}.json")):
        pytest.skip(f"no GPU golden for {kind}; create it with: python tools/golden_loss_curve.py --device cuda --write")
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join([str(repo / "src"), str(repo)])}
    done = subprocess.run([sys.executable, str(repo / "tools" / "golden_loss_curve.py"), "--device", "cuda"],
                          env=env, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "identical" in done.stdout
