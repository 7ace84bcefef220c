"""The first-write registry of ``wgrad_accumulation``: a pending ``main_grad`` is overwritten by its first GEMM.

Every pending tensor here starts as NaN: ``beta = 0`` must not read it, so one NaN left in a result
means the stale memory was read.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core.tensor_parallel import wgrad_accumulation as wa


@pytest.fixture(autouse=True)
def _empty_registry():
    wa.zero_pending_first_writes()
    yield
    wa.zero_pending_first_writes()


def _operands(tokens: int = 6, out: int = 4, inp: int = 3, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(tokens * 100 + out)
    return (torch.randn(tokens, out, generator=gen).to(dtype), torch.randn(tokens, inp, generator=gen).to(dtype))


def _nan(*shape: int) -> torch.Tensor:
    return torch.full(shape, float("nan"))


def test_first_write_overwrites_nan_exactly_then_accumulates():
    grad_output, inputs = _operands()
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    assert [t.data_ptr() for t in wa.pending_first_writes()] == [main_grad.data_ptr()]
    wa.accumulate_weight_gradient(main_grad, grad_output, inputs)
    product = grad_output.t() @ inputs
    assert torch.equal(main_grad, product)
    assert wa.pending_first_writes() == []
    wa.accumulate_weight_gradient(main_grad, grad_output, inputs)  # no longer pending: adds
    torch.testing.assert_close(main_grad, 2 * product, rtol=0, atol=1e-6)


def test_registered_custom_op_takes_the_first_write_too():
    grad_output, inputs = _operands()
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    torch.ops.megatron_core.accumulate_weight_gradient(main_grad, grad_output, inputs)
    assert torch.equal(main_grad, grad_output.t() @ inputs)


def test_tensor_not_registered_accumulates():
    grad_output, inputs = _operands()
    start = torch.randn(4, 3)
    main_grad = start.clone()
    other = _nan(4, 3)
    wa.expect_first_write([other])  # another tensor pending: this one still adds
    wa.accumulate_weight_gradient(main_grad, grad_output, inputs)
    torch.testing.assert_close(main_grad, start + grad_output.t() @ inputs, rtol=0, atol=1e-6)
    assert [t.data_ptr() for t in wa.pending_first_writes()] == [other.data_ptr()]


def test_the_registry_does_not_keep_a_dropped_tensor():
    """A model dropped between zero_grad_buffer() and the sync must not keep its gradient buffer alive here."""
    buffer = _nan(12)
    wa.expect_first_write([buffer[:6], buffer[6:]])  # views made on the fly: nothing else holds them
    assert wa.pending_first_writes() == []
    wa.expect_first_write([buffer])
    del buffer
    assert wa.pending_first_writes() == [] and not wa._PENDING_FIRST_WRITES


def test_first_write_with_low_precision_operands_and_fp32_main_grad():
    """bf16 operands into an fp32 main_grad: on CPU the fallback path (GEMM in bf16, then a copy)."""
    grad_output, inputs = _operands(dtype=torch.bfloat16)
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    wa.accumulate_weight_gradient(main_grad, grad_output, inputs)
    assert torch.equal(main_grad, (grad_output.t() @ inputs).float())


def test_first_write_of_a_gemm_without_tokens_writes_zeros():
    grad_output, inputs = _operands(tokens=0)
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    wa.accumulate_weight_gradient(main_grad, grad_output, inputs)
    assert torch.equal(main_grad, torch.zeros(4, 3))


def test_zero_pending_first_writes_restricted_to_a_subset_then_all():
    first, second, empty = _nan(4, 3), _nan(2, 2), torch.empty(0)
    wa.expect_first_write([first, second, empty])  # the empty tensor is skipped
    assert len(wa.pending_first_writes()) == 2
    wa.zero_pending_first_writes([first, empty])
    assert torch.equal(first, torch.zeros(4, 3))
    assert torch.isnan(second).all()
    assert [t.data_ptr() for t in wa.pending_first_writes()] == [second.data_ptr()]
    wa.zero_pending_first_writes([first])  # idempotent: first is no longer pending
    wa.zero_pending_first_writes()
    assert torch.equal(second, torch.zeros(2, 2))
    assert wa.pending_first_writes() == []


def test_a_slice_starting_at_a_pending_tensor_zeroes_it_and_accumulates():
    grad_output, inputs = _operands(out=2)
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    wa.accumulate_weight_gradient(main_grad[:2], grad_output, inputs)
    assert torch.equal(main_grad[2:], torch.zeros(2, 3))
    torch.testing.assert_close(main_grad[:2], grad_output.t() @ inputs, rtol=0, atol=1e-6)
    assert wa.pending_first_writes() == []


def test_pending_first_write_under_cuda_graph_capture_raises(monkeypatch):
    """The one-shot choice must not be baked into a captured graph (capture simulated; see the GPU test)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    grad_output, inputs = _operands()
    accumulated = torch.zeros(4, 3)
    wa.accumulate_weight_gradient(accumulated, grad_output, inputs)  # nothing pending: capture is fine
    main_grad = _nan(4, 3)
    wa.expect_first_write([main_grad])
    with pytest.raises(RuntimeError, match="CUDA graph"):
        wa.accumulate_weight_gradient(main_grad, grad_output, inputs)
    assert torch.isnan(main_grad).all()
    assert [t.data_ptr() for t in wa.pending_first_writes()] == [main_grad.data_ptr()]
