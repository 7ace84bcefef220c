"""``megatron_core.jit.shared_kernel_input``: one buffer for the Triton kernels of a compiled graph that read a tensor.

On CPU: the identity eagerly and for a tensor autograd tracks, the same values under ``torch.compile`` (whole
graph, Inductor and AOT eager). On a GPU: an FP8 expert layer's activation, read by the row-wise cast (two kernel
arguments) and the column-wise cast (two kernels), is stored once by the kernel that computes it, where Inductor
stores a copy for each argument without it.
"""

from __future__ import annotations

import re

import pytest
import torch

from megatron_core.jit import shared_kernel_input


def test_eagerly_the_tensor_itself():
    t = torch.randn(4, 3)
    assert shared_kernel_input(t) is t


def test_a_tensor_autograd_tracks_is_passed_through_under_compile():
    def fn(x: torch.Tensor) -> torch.Tensor:
        return shared_kernel_input(x * 2).sum()

    x = torch.randn(5, 3, requires_grad=True)
    torch.compile(fn, backend="aot_eager", fullgraph=True)(x).backward()
    torch.testing.assert_close(x.grad, torch.full_like(x, 2.0))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_values_unchanged_in_a_whole_graph(backend):
    def fn(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = shared_kernel_input(torch.sigmoid(x) * 3)
        return a.sum(-1), a.amax(0)

    torch._dynamo.reset()
    x = torch.randn(64, 48)
    out = torch.compile(fn, backend=backend, fullgraph=True)(x)
    for got, want in zip(out, fn(x)):
        torch.testing.assert_close(got, want)


def _stores_of_the_activation_kernel(fn, *args) -> int:
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    _, codes = run_and_get_code(torch.compile(fn, fullgraph=True), *args)
    code = "\n".join(codes)
    kernels = [m for m in re.finditer(r"def (triton_\w*silu\w*)\(", code)]
    assert kernels, "no fused SiLU kernel in the generated code"
    body = code[kernels[0].end():code.find("''', device_str", kernels[0].end())]
    return body.count("tl.store")


@pytest.mark.gpu
def test_gpu_the_activation_is_stored_once_for_every_cast_kernel():
    from megatron_core.fp8.cast_kernels import (
        fp8_cast_kernels_available,
        group_columnwise_cast_transposed,
        rowwise_cast,
    )

    rows, ffn = 256, 512
    h = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    probs = torch.rand(rows, 1, device="cuda", dtype=torch.bfloat16)
    ends = torch.tensor([64, 128, 192, 256], device="cuda", dtype=torch.int32)
    row_groups = torch.arange(rows, device="cuda", dtype=torch.int32) // 64
    if not fp8_cast_kernels_available(h):
        pytest.skip("the Triton casts need Triton and torch.library.triton_op")

    def casts(activation: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*rowwise_cast(activation), *group_columnwise_cast_transposed(activation, ends, row_groups))

    def activation(h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(h[:, :ffn].float()) * h[:, ffn:].float() * probs.float()).to(h.dtype)

    def unshared(h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return casts(activation(h, probs))

    def shared(h: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return casts(shared_kernel_input(activation(h, probs)))

    # rowwise_cast shares its own input (two arguments of one kernel); the column-wise cast's two kernels still
    # take a copy each unless the caller shares the tensor across the ops.
    assert _stores_of_the_activation_kernel(unshared, h, probs) > 1
    assert _stores_of_the_activation_kernel(shared, h, probs) == 1
    want = casts(activation(h, probs))
    got = torch.compile(shared, fullgraph=True)(h, probs)
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                           w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)
