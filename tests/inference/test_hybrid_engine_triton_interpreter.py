"""The hybrid engine's CPU tests run again with the Mamba layers on the GPU path's kernels, in Triton's
interpreter.

``mixer_inference`` is made to take its CUDA path on CPU tensors (the fused decode step, the Triton prefill scan
from the stored states, the padded prefill batch and the gated RMSNorm kernel), and three tests of
test_hybrid_dynamic_engine.py (waiting requests; chunked prefill with pauses and evictions; the padded CUDA-graph
decode layout with the scratch slot) must still give the plain loop's greedy tokens, fp32, with the decode and
scan kernels called. The plain loop's full forward stays on the PyTorch path, so the kernels are checked against
the reference end to end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.triton_interpreter import needs_triton, run_in_triton_interpreter

_SCRIPT = """
import pytest
from megatron_core.ssm import mamba_inference

calls = {"decode": 0, "scan": 0}

class KernelsOnCpu:
    @pytest.fixture(autouse=True)
    def kernels(self, monkeypatch):
        decode, scan = mamba_inference.mamba_decode_step, mamba_inference.ssd_chunk_scan_triton

        def counted_decode(*args):
            calls["decode"] += 1
            return decode(*args)

        def counted_scan(*args, **kwargs):
            calls["scan"] += 1
            return scan(*args, **kwargs)

        monkeypatch.setattr(mamba_inference, "mamba_decode_supported", lambda *a: True)
        monkeypatch.setattr(mamba_inference, "ssd_scan_triton_supported", lambda *a: True)
        monkeypatch.setattr(mamba_inference, "gated_rmsnorm_supported", lambda *a: True)
        monkeypatch.setattr(mamba_inference, "mamba_decode_step", counted_decode)
        monkeypatch.setattr(mamba_inference, "ssd_chunk_scan_triton", counted_scan)

module = {engine_tests!r} + "::"
tests = ["test_engine_greedy_equals_plain_loop_with_waiting_requests",
         "test_engine_chunked_prefill_pauses_and_evictions",
         "test_padded_graph_decode_layout_equals_plain_loop[legacy]"]
assert pytest.main([module + t for t in tests] + ["-q", "-p", "no:cacheprovider"], plugins=[KernelsOnCpu()]) == 0
assert calls["decode"] > 0 and calls["scan"] > 0, calls
"""


@pytest.mark.slow  # about 40-70 s on 2 busy cores
@needs_triton
def test_hybrid_engine_through_the_kernels_in_the_interpreter() -> None:
    engine_tests = str(Path(__file__).with_name("test_hybrid_dynamic_engine.py"))
    run_in_triton_interpreter(_SCRIPT.replace("{engine_tests!r}", repr(engine_tests)), timeout=900)
