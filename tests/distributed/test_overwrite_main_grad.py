"""``overwrite_main_grad_on_first_wgrad``: DDP skips zeroing fused-wgrad ``main_grad``s; their first GEMM writes.

A tiny GPT with ``gradient_accumulation_fusion`` trains 3 steps of 2 micro-batches (the first under
``no_sync``) with the flag on and off, from the same weights and data; the gradient buffers are filled
with NaN before every ``zero_grad_buffer()``, so any read of the memory left unzeroed shows up. Every
``main_grad`` (after the first micro-batch and after the reduction), every loss and the final weights
must agree. Also: what ``zero_grad_buffer()`` zeroes and leaves, and that a marked weight that got no
gradient in a step reads zero once its bucket is synchronised.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.wgrad_accumulation import pending_first_writes
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

STEPS, MICROBATCHES = 3, 2
MODES = {
    "plain": {},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 3000},
}


def _poison_and_zero(ddp: DistributedDataParallel) -> None:
    for buffer in ddp.buffers + ddp.expert_parallel_buffers:
        buffer.grad_data.fill_(float("nan"))
    ddp.zero_grad_buffer()


def _main_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.main_grad.detach().clone() for name, p in model.named_parameters()}


def _train(tp: int, mode: str, overwrite: bool, compiled: bool = False) -> dict:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(llama_like(), gradient_accumulation_fusion=True, tensor_model_parallel_size=tp)
    ddp_config = DistributedDataParallelConfig(overwrite_main_grad_on_first_wgrad=overwrite, **MODES[mode])
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(lr=1e-2, use_distributed_optimizer=ddp_config.use_distributed_optimizer), [ddp])
    if compiled:
        for layer in model.decoder.layers:
            layer.compile()
    dp_rank = parallel_state.get_data_parallel_rank()
    record: dict = {"losses": [], "grads": [], "eligible": sum(
        bool(getattr(p, "wgrad_fused_into_main_grad", False)) for p in model.parameters())}
    for step in range(STEPS):
        _poison_and_zero(ddp)
        optimizer.zero_grad()
        for micro in range(MICROBATCHES):
            ids, pos, labels = batch(100 * step + 10 * dp_rank + micro)
            with ddp.no_sync() if micro < MICROBATCHES - 1 else nullcontext():
                loss = ddp(ids, pos, None, labels=labels).float().mean() / MICROBATCHES
                loss.backward()
            record["losses"].append(loss.detach())
            if micro == 0:
                record["grads"].append(_main_grads(model))
        finalize_model_grads([ddp])
        assert pending_first_writes() == []
        record["grads"].append(_main_grads(model))
        ok, _, _ = optimizer.step()
        assert ok
    ddp.start_param_sync(force_sync=True)
    record["params"] = {name: p.detach().clone() for name, p in model.named_parameters()}
    return record


def _compare(tp: int, mode: str, compiled: bool = False) -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        on = _train(tp, mode, overwrite=True, compiled=compiled)
        if compiled:
            torch._dynamo.reset()
        off = _train(tp, mode, overwrite=False, compiled=compiled)
    finally:
        parallel_state.destroy_model_parallel()
    tol = dict(rtol=0, atol=1e-6)
    for i, (a, b) in enumerate(zip(on["losses"], off["losses"])):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"loss {i}: {m}")
    for i, (got, want) in enumerate(zip(on["grads"], off["grads"])):
        for name in want:
            assert torch.isfinite(got[name]).all(), f"snapshot {i}, {name}: the unzeroed memory was read"
            torch.testing.assert_close(got[name], want[name], **tol, msg=lambda m, n=name, i=i: f"{i} {n}: {m}")
    for name in off["params"]:
        torch.testing.assert_close(on["params"][name], off["params"][name], **tol, msg=lambda m, n=name: f"{n}: {m}")
    return {"eligible": on["eligible"], "snapshots": len(on["grads"])}


@pytest.mark.parametrize("tp,mode", [(1, "plain"), (1, "distopt_overlap"), (2, "plain")])
def test_overwrite_matches_zeroed_buffers_on_two_ranks(tp, mode):
    results = run_on_ranks(2, _compare, tp, mode)
    # 2 layers x (qkv, proj, fc1, fc2) + output layer + embedding; a snapshot per micro-batch 1 and per reduction.
    assert results == [{"eligible": 10, "snapshots": 2 * STEPS}] * 2


def test_overwrite_in_compiled_layers_matches_zeroed_buffers():
    """Compiled layers call the custom op on the real main_grad (no copy), so the first write is taken there too."""
    assert run_on_ranks(1, _compare, 1, "plain", True) == [{"eligible": 10, "snapshots": 2 * STEPS}]


class _TwoBranches(torch.nn.Module):
    """``l1(x) [+ l2(x)] -> l3``: fused-wgrad linears, a tied-style weight (``zero_out_wgrad``) and a plain one."""

    def __init__(self) -> None:
        super().__init__()
        self.config = ModelParallelConfig(gradient_accumulation_fusion=True, use_cpu_initialization=True)
        init = torch.nn.init.normal_
        self.l1 = ColumnParallelLinear(8, 8, config=self.config, init_method=init, bias=True)
        self.l2 = ColumnParallelLinear(8, 8, config=self.config, init_method=init, bias=False)
        self.l3 = RowParallelLinear(8, 4, config=self.config, init_method=init, bias=False, input_is_parallel=True,
                                    skip_bias_add=False)
        self.tied = ColumnParallelLinear(4, 4, config=self.config, init_method=init, bias=False)
        self.tied.weight.zero_out_wgrad = True  # marked, but the hook adds its .grad: must be zeroed
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor, use_l2: bool) -> torch.Tensor:
        h = self.l1(x)[0] + (self.l2(x)[0] if use_l2 else 0)
        return self.tied(self.l3(h)[0])[0] * self.scale


def _layout_after_zero_grad_buffer() -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = _TwoBranches()
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, overwrite_main_grad_on_first_wgrad=True), model)
        _poison_and_zero(ddp)
        (buffer,) = ddp.buffers
        left = {id(p) for p in (model.l1.weight, model.l2.weight, model.l3.weight)}
        assert {t.data_ptr() for t in pending_first_writes()} == {
            p.main_grad.data_ptr() for p in model.parameters() if id(p) in left}
        stale = torch.zeros(buffer.numel, dtype=torch.bool)
        for param in model.parameters():
            start, end, _ = buffer.param_index_map[param]
            stale[start:end] = id(param) in left
        assert torch.isnan(buffer.grad_data[stale]).all()
        assert torch.equal(buffer.grad_data[~stale], torch.zeros(int((~stale).sum())))  # gaps and padding too
        ddp.finish_grad_sync()  # no backward at all: everything still pending is zeroed
        assert pending_first_writes() == [] and torch.equal(buffer.grad_data, torch.zeros(buffer.numel))
        return {"left": len(left), "zeroed_views": len(buffer._zeroed_at_reset), "padding": buffer.numel
                - buffer.numel_unpadded}
    finally:
        parallel_state.destroy_model_parallel()


def test_zero_grad_buffer_leaves_only_fused_wgrad_main_grads():
    (result,) = run_on_ranks(1, _layout_after_zero_grad_buffer)
    assert result["left"] == 3 and result["padding"] > 0
    assert result["zeroed_views"] <= 4  # the complement of 3 ranges, adjacent ones merged


def _unused_weight_reads_zero() -> dict:
    parallel_state.initialize_model_parallel()
    try:
        torch.manual_seed(0)
        model = _TwoBranches()
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            overwrite_main_grad_on_first_wgrad=True), model)
        x = torch.randn(5, 8) + parallel_state.get_data_parallel_rank()
        for use_l2 in (True, False):
            _poison_and_zero(ddp)
            ddp(x, use_l2).square().sum().backward()
            assert len(pending_first_writes()) == (0 if use_l2 else 1)
            ddp.finish_grad_sync()
            assert pending_first_writes() == []
            for name, param in model.named_parameters():
                assert torch.isfinite(param.main_grad).all(), name
            assert model.l1.weight.main_grad.abs().sum() > 0
            assert (model.l2.weight.main_grad.abs().sum() > 0) == use_l2
        return {"dp": parallel_state.get_data_parallel_world_size()}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("world_size", [1, 2])
def test_marked_weight_without_gradient_reads_zero_after_finish_grad_sync(world_size):
    assert run_on_ranks(world_size, _unused_weight_reads_zero) == [{"dp": world_size}] * world_size
