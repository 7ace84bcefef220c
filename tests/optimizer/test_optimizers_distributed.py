"""Optimizer wrappers on 4 CPU ranks: loss-scaler skip and back-off, bf16 master weights, exact resume, zeros.

The model is ``TiedNetTP`` (see tests/distributed/tiny_models.py) wrapped in DDP.
"""

from __future__ import annotations

import io

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron_core.optimizer import (
    DistributedOptimizer,
    DynamicGradScaler,
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    OptimizerConfig,
    get_megatron_optimizer,
)
from tests.dist_harness import run_on_ranks
from tests.distributed import tiny_models as tm

WORLD = 4


def _build(tp, dtype=torch.float32, use_distributed_optimizer=False, seed=1234, **opt_kw):
    model = tm.TiedNetTP(tm.make_reference(seed)).to(dtype)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        grad_reduce_in_fp32=dtype != torch.float32, use_distributed_optimizer=use_distributed_optimizer), model)
    opt_kw.setdefault("clip_grad", tm.CLIP)
    config = OptimizerConfig(lr=tm.LR, weight_decay=tm.WD, bf16=dtype == torch.bfloat16,
                             fp16=dtype == torch.float16, use_distributed_optimizer=use_distributed_optimizer,
                             **opt_kw)
    return model, ddp, get_megatron_optimizer(config, [ddp])


def _backward(ddp, x, y, dtype=torch.float32):
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    ddp.zero_grad_buffer()
    for i, (xm, ym) in enumerate(tm.microbatches(x, y, dp_rank, dp_size)):
        out = ddp(xm.unsqueeze(0).to(dtype)).float()
        loss = F.mse_loss(out, ym.unsqueeze(0)) / tm.NUM_MICROBATCHES
        if i < tm.NUM_MICROBATCHES - 1:
            with ddp.no_sync():
                loss.backward()
        else:
            loss.backward()


def _snapshot(model):
    return {k: v.detach().float().clone() for k, v in model.reference_view().items()}


def _scaler_check():
    """fp16: an inf injected into one rank's local gradient makes every rank skip; the scale backs off."""
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, ddp, opt = _build(2, torch.float16, initial_loss_scale=1024.0, hysteresis=2, loss_scale_window=2)
    assert isinstance(opt, Float16OptimizerWithFloat16Params) and isinstance(opt.grad_scaler, DynamicGradScaler)
    data = tm.make_data(4)
    log = []
    for step, (x, y) in enumerate(data):
        opt.zero_grad()
        before = _snapshot(model)
        _backward(ddp, x, y, torch.float16)
        if step < 2 and dist.get_rank() == 1:
            model.l2.weight.main_grad[0, 0] = float("inf")  # one rank, before the DP reduction
        finalize_model_grads([ddp])
        ok, norm, _ = opt.step()
        changed = any(not torch.equal(before[k], v) for k, v in _snapshot(model).items())
        log.append((ok, norm, changed, opt.get_loss_scale().item()))
    assert opt.scale_loss(torch.tensor(2.0)).item() == 2.0 * log[-1][3]
    return log


def test_dynamic_scaler_skips_inf_step_on_every_rank_and_backs_off():
    for log in run_on_ranks(WORLD, _scaler_check):
        assert [entry[0] for entry in log] == [False, False, True, True]
        assert log[0][1] is None and log[0][2] is False and log[1][2] is False  # weights untouched
        assert log[2][2] and log[3][2]
        # hysteresis 2: the first overflow keeps 1024, the second halves it; two clean steps double it.
        assert [entry[3] for entry in log] == [1024.0, 512.0, 512.0, 1024.0]


def _bf16_train(use_distributed_optimizer):
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, ddp, opt = _build(2, torch.bfloat16, use_distributed_optimizer)
    expected_type = DistributedOptimizer if use_distributed_optimizer else Float16OptimizerWithFloat16Params
    assert isinstance(opt, expected_type)
    assert all(p.dtype == torch.float32 for p in opt.get_parameters())
    for x, y in tm.make_data(5):
        opt.zero_grad()
        _backward(ddp, x, y, torch.bfloat16)
        finalize_model_grads([ddp])
        assert opt.step()[0]
    if not use_distributed_optimizer:
        for model_group, main_group in zip(opt.float16_groups, opt.fp32_from_float16_groups):
            for model_param, main_param in zip(model_group, main_group):
                assert model_param.dtype == torch.bfloat16
                assert torch.equal(model_param, main_param.to(torch.bfloat16))
    return {"params": _snapshot(model), "tp_rank": parallel_state.get_tensor_model_parallel_rank()}


@pytest.mark.parametrize("use_distributed_optimizer", [False, True])
def test_bf16_master_weights_track_fp32_reference(use_distributed_optimizer):
    ref, _ = tm.train_reference(5)
    start = dict(tm.make_reference().named_parameters())
    for result in run_on_ranks(WORLD, _bf16_train, use_distributed_optimizer):
        for name, value in result["params"].items():
            expected, initial = ref[name], start[name].detach()
            if value.shape != expected.shape:
                dim = 1 if name == "l2.weight" else 0
                expected = expected.chunk(2, dim=dim)[result["tp_rank"]]
                initial = initial.chunk(2, dim=dim)[result["tp_rank"]]
            rel = (value - expected).norm() / expected.norm()
            assert rel < 2e-2, f"{name}: relative error {rel:.3e}"
            assert not torch.equal(value, initial.to(torch.bfloat16).float()), f"{name} did not train"


def _serialize(obj):
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _resume(kind):
    parallel_state.initialize_model_parallel()
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    distopt = kind == "distopt"
    data = tm.make_data(5)

    def train(ddp, opt, batches):
        for x, y in batches:
            opt.zero_grad()
            _backward(ddp, x, y, dtype)
            finalize_model_grads([ddp])
            assert opt.step()[0]

    model, ddp, opt = _build(1, dtype, distopt)
    train(ddp, opt, data[:3])
    saved = _serialize({"model": ddp.state_dict(), "optimizer": opt.state_dict()})
    train(ddp, opt, data[3:])
    straight = _snapshot(model)

    model2, ddp2, opt2 = _build(1, dtype, distopt, seed=7)
    ddp2.load_state_dict(saved["model"])
    opt2.load_state_dict(saved["optimizer"])
    train(ddp2, opt2, data[3:])
    resumed = _snapshot(model2)
    mismatch = [k for k in straight if not torch.equal(straight[k], resumed[k])]
    error = None
    if distopt:
        others = [None] * WORLD
        dist.all_gather_object(others, saved["optimizer"])
        try:
            opt2.load_state_dict(others[(dist.get_rank() + 1) % WORLD])
        except ValueError as exc:
            error = str(exc)
    return {"mismatch": mismatch, "error": error, "type": type(opt).__name__}


@pytest.mark.parametrize("kind", ["fp32", "bf16", "distopt"])
def test_state_dict_resume_is_bit_exact(kind):
    for result in run_on_ranks(WORLD, _resume, kind):
        assert result["mismatch"] == [], result
        if kind == "distopt":
            assert result["type"] == "DistributedOptimizer"
            assert result["error"] is not None and "shard layout" in result["error"]
        elif kind == "fp32":
            assert result["type"] == FP32Optimizer.__name__


def _zeros_and_norm():
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    model, ddp, opt = _build(2, log_num_zeros_in_grad=True, clip_grad=1e9)
    x, y = tm.make_data(1)[0]
    _backward(ddp, x, y)
    model.l1.weight.main_grad[0].zero_()  # a TP-sharded param: zeros on each TP rank count separately
    model.ln.bias.main_grad[:3].zero_()  # a replicated param: counted once
    finalize_model_grads([ddp])
    opt.prepare_grads()
    counted, norm = opt.count_zeros(), opt.get_grad_norm()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    full = {}
    for name, param in model.reference_view().items():
        grad = param.main_grad
        if getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(parts, grad.contiguous(), group=tp_group)
            grad = torch.cat(parts, dim=param.partition_dim)
        full[name] = grad
    expected_zeros = sum(int((g == 0).sum()) for g in full.values())
    expected_norm = torch.cat([g.flatten() for g in full.values()]).norm().item()
    return counted, expected_zeros, norm, expected_norm


def test_count_zeros_and_norm_count_tp_replicas_once():
    for counted, expected_zeros, norm, expected_norm in run_on_ranks(WORLD, _zeros_and_norm):
        assert counted == expected_zeros >= 2 * tm.HIDDEN // 2 + 3
        assert norm == pytest.approx(expected_norm, rel=1e-6)


def _shard_layout():
    parallel_state.initialize_model_parallel()
    model, ddp, opt = _build(1, torch.bfloat16, use_distributed_optimizer=True)
    x, y = tm.make_data(1)[0]
    opt.zero_grad()
    _backward(ddp, x, y, torch.bfloat16)
    finalize_model_grads([ddp])
    assert opt.step()[0]
    owned = [(e.name, e.param_range.start, e.param_range.end) for e in opt._entries()]
    main_numel = sum(e.main_param.numel() for e in opt._entries())
    state_numel = sum(t.numel() for s in opt.optimizer.state.values() for k, t in s.items() if k != "step")
    sizes = {name: p.numel() for name, p in model.named_parameters()}
    return owned, main_numel, state_numel, sizes, sum(b.numel for b in ddp.buffers)


def test_distributed_optimizer_shards_cover_every_element_once():
    """ZeRO-1 on DP=4: the ranks' fp32 main-param slices partition every parameter; Adam state is 2x a slice."""
    per_rank = run_on_ranks(WORLD, _shard_layout)
    sizes = per_rank[0][3]
    covered = {name: torch.zeros(numel, dtype=torch.int) for name, numel in sizes.items()}
    for owned, main_numel, state_numel, _, padded_numel in per_rank:
        assert state_numel == 2 * main_numel
        assert main_numel <= padded_numel // WORLD  # one equal shard of the (padded) buffer per rank
        for name, start, end in owned:
            covered[name][start:end] += 1
    for name, count in covered.items():
        assert bool((count == 1).all()), f"{name}: elements owned {count.tolist()} times"
