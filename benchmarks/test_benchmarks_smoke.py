"""Smoke run of the benchmarks on CPU, outside the test suite (``testpaths`` is ``tests/``).

Run it when a benchmark changes::

    .venv/bin/python -m pytest -q benchmarks/test_benchmarks_smoke.py

``benchmarks/gpt_fwd_bwd.py --tiny`` times both contenders (this library and Hugging Face's Llama,
eager, no compile) on a tiny model and must print a row for each and the closing ``RESULT`` line;
``benchmarks/hybrid_fwd_bwd.py --tiny`` does the same against Hugging Face's NemotronH.
``benchmarks/fp8_ptq_inference.py --tiny`` serves a tiny GPT in fp32 and FP8-PTQ'd with real FP8 weights.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def test_gpt_fwd_bwd_tiny_runs_on_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("--tiny is the CPU smoke mode")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["gpt_fwd_bwd.py", "--tiny", "--hf-eager"])
    runpy.run_path(str(ROOT / "benchmarks" / "gpt_fwd_bwd.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    for name in ("megatron_core eager", "HF Llama sdpa eager"):
        row = next((line for line in lines if line.startswith(name)), None)
        assert row is not None, lines
        assert "tok/s" in row and "MFU" in row
    assert lines[-1].startswith("RESULT fwd+bwd MFU: megatron_core")


def test_hybrid_fwd_bwd_tiny_runs_on_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``benchmarks/hybrid_fwd_bwd.py --tiny`` times our HybridModel and Hugging Face's NemotronH (eager)."""
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("--tiny is the CPU smoke mode")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["hybrid_fwd_bwd.py", "--tiny", "--hf-eager"])
    runpy.run_path(str(ROOT / "benchmarks" / "hybrid_fwd_bwd.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    for name in ("megatron_core HybridModel eager", "HF NemotronH (torch path) eager"):
        row = next((line for line in lines if line.startswith(name)), None)
        assert row is not None, lines
        assert "tok/s" in row and "MFU" in row
    assert lines[-1].startswith("RESULT fwd+bwd MFU: megatron_core")


def test_fp8_ptq_inference_tiny_runs_on_cpu(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``benchmarks/fp8_ptq_inference.py --tiny`` serves the bf16 and the real-FP8 model and reports agreement."""
    pytest.importorskip("modelopt")
    if torch.cuda.is_available():
        pytest.skip("--tiny is the CPU smoke mode")
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    monkeypatch.setattr(sys, "argv", ["fp8_ptq_inference.py", "--tiny"])
    runpy.run_path(str(ROOT / "benchmarks" / "fp8_ptq_inference.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    for name in ("bf16  c=  1", "fp8   c=  4"):
        row = next((line for line in lines if line.startswith(name)), None)
        assert row is not None, lines
        assert "tok/s" in row and "decode step" in row
    assert any(line.startswith("RESULT c=4: fp8") for line in lines), lines
    assert lines[-1].startswith("RESULT agreement: ")
