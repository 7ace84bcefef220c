"""The decode CUDA-graph runner (inference/model_inference_wrappers/cuda_graphs.py) on a GPU.

A compiled forward is captured after its warm-up and replayed on new inputs; a compiled forward that would
compile again inside the capture (its guards change on every call) raises a clear error naming the guard,
instead of invalidating the capture, and leaves the GPU usable.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.inference.model_inference_wrappers.cuda_graphs import DecodeGraphRunner

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _fn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x @ weight).sum(-1, keepdim=True) * x


def test_compiled_forward_is_captured_and_replayed():
    torch._dynamo.reset()
    x, weight = torch.randn(4, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    compiled = torch.compile(_fn, dynamic=False)
    runner = DecodeGraphRunner()
    out = runner.run(4, lambda: compiled(x, weight))
    torch.testing.assert_close(out, _fn(x, weight), rtol=1e-4, atol=1e-4)
    x.copy_(torch.randn_like(x))  # a new step in the same fixed-address input
    out = runner.run(4, lambda: compiled(x, weight))
    torch.testing.assert_close(out, _fn(x, weight), rtol=1e-4, atol=1e-4)


def test_forward_that_recompiles_on_every_call_raises_naming_the_guard():
    torch._dynamo.reset()
    x, weight = torch.randn(4, 64, device="cuda"), torch.randn(64, 64, device="cuda")
    calls = []

    def counting(x, weight):
        calls.append(1)  # traced: the compiled code is guarded on len(calls)
        return _fn(x, weight)

    compiled = torch.compile(counting, dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=64), pytest.raises(RuntimeError, match="fail_on_recompile") as err:
        DecodeGraphRunner().run(4, lambda: compiled(x, weight))
    if "guard failure" in str(err.value):  # the reasons are in the message from torch 2.8 on
        assert "len(" in str(err.value) and "calls" in str(err.value)
    torch.cuda.synchronize()  # the failed capture left no broken stream behind
    assert not torch.cuda.is_current_stream_capturing()
    stable = torch.compile(_fn, dynamic=False)
    out = DecodeGraphRunner().run(4, lambda: stable(x, weight))
    torch.testing.assert_close(out, _fn(x, weight), rtol=1e-4, atol=1e-4)
