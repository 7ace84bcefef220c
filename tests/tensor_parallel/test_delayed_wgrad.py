"""Deferred weight gradients (``delay_wgrad_compute``): each linear's ``backward_dw()`` gradient equals its
immediate one (column / row at TP=2 with and without sequence parallelism, into ``.grad`` or, with
``gradient_accumulation_fusion``, into ``main_grad``; the grouped expert linears on every GEMM path), and DDP
reduces a deferred weight's bucket only after ``backward_dw()``."""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup
from megatron_core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel
from megatron_core.model_parallel_config import ModelParallelConfig
from megatron_core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron_core.tensor_parallel.delayed_wgrad import (
    enable_delayed_wgrad,
    pending_delayed_wgrads,
    run_delayed_wgrads,
)
from megatron_core.transformer.moe.grouped_linear import ColumnParallelGroupedLinear, RowParallelGroupedLinear
from tests.dist_harness import run_on_ranks

TP, S, B, H, OUT = 2, 4, 2, 8, 12


def _layer(kind: str, config: ModelParallelConfig, delay: bool) -> torch.nn.Module:
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    torch.manual_seed(7)
    init = torch.nn.init.normal_
    if kind == "column":
        layer = ColumnParallelLinear(H, OUT, config=config, init_method=init, bias=True)
    else:
        layer = RowParallelLinear(OUT, H, config=config, init_method=init, bias=True, input_is_parallel=True,
                                  skip_bias_add=False)
    if delay:
        enable_delayed_wgrad(layer)
    if config.gradient_accumulation_fusion:
        layer.weight.main_grad = torch.zeros_like(layer.weight, dtype=torch.float32)
        layer.weight.grad_added_to_main_grad = False
    return layer


def _inputs(kind: str, sp: bool, micro: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(11 + torch.distributed.get_rank())
    seq = S // TP if sp and kind == "column" else S
    width = H if kind == "column" else OUT // TP
    return [torch.randn(seq, B, width, generator=g, requires_grad=True) for _ in range(micro)]


def _grads(kind: str, sp: bool, fused: bool, delay: bool) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    config = ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp,
                                 gradient_accumulation_fusion=fused, use_cpu_initialization=True)
    layer = _layer(kind, config, delay)
    xs = _inputs(kind, sp, 2)
    for x in xs:
        landed = (layer.weight.main_grad if fused else layer.weight.grad)
        landed = None if landed is None else landed.clone()
        out, _ = layer(x)
        (out * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
        if delay:
            assert layer.pending_wgrads() == 1
            now = layer.weight.main_grad if fused else layer.weight.grad
            assert (now is None) if landed is None else torch.equal(now, landed), "wgrad landed before backward_dw"
            layer.backward_dw()
            assert layer.pending_wgrads() == 0
    weight_grad = layer.weight.main_grad if fused else layer.weight.grad
    return [x.grad for x in xs], weight_grad, layer.bias.grad


def _check_tp_linears() -> int:
    checked = 0
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        for kind, sp, fused in itertools.product(("column", "row"), (False, True), (False, True)):
            want = _grads(kind, sp, fused, delay=False)
            got = _grads(kind, sp, fused, delay=True)
            for a, b in zip(got[0], want[0]):
                torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(got[1], want[1], rtol=1e-6, atol=1e-6, msg=f"{kind} sp={sp} fused={fused}")
            torch.testing.assert_close(got[2], want[2], rtol=1e-6, atol=1e-6)
            assert got[1].abs().sum() > 0
            checked += 1
    finally:
        parallel_state.destroy_model_parallel()
    return checked


def test_tp_linears_deferred_wgrad_equals_immediate():
    assert run_on_ranks(TP, _check_tp_linears) == [8, 8]


def _check_grouped(counts: list[int]) -> None:
    config = ModelParallelConfig(use_cpu_initialization=True)
    results = []
    for delay in (False, True):
        torch.manual_seed(3)
        fc1 = ColumnParallelGroupedLinear(3, H, OUT, config=config, init_method=torch.nn.init.normal_, bias=True,
                                          skip_bias_add=False)
        fc2 = RowParallelGroupedLinear(3, OUT, H, config=config, init_method=torch.nn.init.normal_, bias=False,
                                       skip_bias_add=False)
        experts = torch.nn.ModuleList([fc1, fc2])
        if delay:
            enable_delayed_wgrad(experts)
        x = torch.randn(sum(counts), H, generator=torch.Generator().manual_seed(5), requires_grad=True)
        for _ in range(2):
            out, _ = fc2(torch.nn.functional.gelu(fc1(x, counts)[0]), counts)
            (out * out).sum().backward()
            if delay:
                assert pending_delayed_wgrads(experts) == 2
                run_delayed_wgrads(experts)
        results.append((x.grad, fc1.weight.grad, fc1.bias.grad, fc2.weight.grad))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("counts", [[3, 0, 5], [4, 4, 4]])  # per-expert GEMMs; the batched (bmm) path
def test_grouped_linears_deferred_wgrad_equals_immediate(counts):
    _check_grouped(counts)


class _Net(torch.nn.Module):
    def __init__(self, config: ModelParallelConfig) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.fc1 = ColumnParallelLinear(H, OUT, config=config, init_method=torch.nn.init.normal_, bias=True)
        self.fc2 = RowParallelLinear(OUT, H, config=config, init_method=torch.nn.init.normal_, bias=False,
                                     input_is_parallel=True, skip_bias_add=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.fc1(x)[0]))[0]


def _ddp_run(delay: bool, fused: bool) -> tuple[dict[str, torch.Tensor], list[str]]:
    config = ModelParallelConfig(use_cpu_initialization=True, gradient_accumulation_fusion=fused)
    net = _Net(config)
    if delay:
        enable_delayed_wgrad(net)
    ddp = DistributedDataParallel(config, DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=40),
                                  net)
    log: list[str] = []
    real_start = _ParamAndGradBucketGroup.start_grad_sync

    def start(group, *args, **kwargs):
        log.append("sync:" + ",".join(sorted(ddp.param_to_name[p] for p in group.params)))
        return real_start(group, *args, **kwargs)

    _ParamAndGradBucketGroup.start_grad_sync = start
    try:
        x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(21 + torch.distributed.get_rank()))
        (ddp(x) ** 2).sum().backward()
        if delay:
            # Only the buckets without a deferred weight may have started; those holding one wait for backward_dw.
            assert all("weight" not in entry for entry in log), log
            log.append("backward_dw")
            run_delayed_wgrads(net)
        ddp.finish_grad_sync()
    finally:
        _ParamAndGradBucketGroup.start_grad_sync = real_start
    return {name: p.main_grad.clone() for name, p in net.named_parameters()}, log


def _check_ddp() -> bool:
    parallel_state.initialize_model_parallel()
    try:
        for fused in (False, True):
            want, _ = _ddp_run(False, fused)
            got, log = _ddp_run(True, fused)
            assert "backward_dw" in log and any("weight" in e for e in log[log.index("backward_dw"):]), log
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-6, msg=name)
                assert want[name].abs().sum() > 0
        net = _Net(ModelParallelConfig(use_cpu_initialization=True))
        enable_delayed_wgrad(net)
        with pytest.raises(ValueError, match="cannot be combined with TorchFullyShardedDataParallel"):
            TorchFullyShardedDataParallel(net.fc1.config, DistributedDataParallelConfig(), net)
    finally:
        parallel_state.destroy_model_parallel()
    return True


def test_ddp_reduces_deferred_weights_only_after_backward_dw():
    assert run_on_ranks(2, _check_ddp) == [True, True]
