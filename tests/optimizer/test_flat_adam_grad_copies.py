"""The flat Adam step and the main params' gradient copies (``optimizer/distrib_optimizer.py``).

With bf16 gradient buffers and fp32 main params, the main gradients are fp32 copies. The flat step reads the
gradient buffers themselves, so on 2 CPU ranks (flat step forced on): it makes no copies when nothing reads them,
and trains bit for bit as the same run that makes them (with TP=2, where the norm reads the counted pieces in the
gradient buffers, to bf16 rounding); and it is not used where a pass before the step rewrites
the copies (a grad scaler's unscaling, clipping that cannot fold into the step), which it would not see.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.fp8 import convert_to_float8
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.optimizer.distrib_optimizer import DistributedOptimizer
from megatron_core.transformer import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import SEQ, VOCAB, build, llama_like
from tests.optimizer.dp_step import dp_train_step

STEPS = 3


def _optimizer(half: str, grad_reduce_in_fp32: bool, overrides: dict, fp8_param: bool = False, tp: int = 1):
    """A tiny GPT in ``half`` ("bf16" / "fp16") under DDP and the distributed optimizer, flat step forced on; with
    ``fp8_param`` its linear weights are FP8 parameters (emulated FP8 GEMMs)."""
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    dtype = torch.bfloat16 if half == "bf16" else torch.float16
    fp8 = dict(fp8="hybrid", fp8_recipe="tensorwise", fp8_param=True) if fp8_param else {}
    model = build(llama_like(), **{half: True, "params_dtype": dtype}, **fp8, tensor_model_parallel_size=tp)
    if fp8_param:
        convert_to_float8(model, emulate=True)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, grad_reduce_in_fp32=grad_reduce_in_fp32, fp8_param_gather=fp8_param),
        Float16Module(model.config, model))
    previous = DistributedOptimizer.flat_shard_step
    DistributedOptimizer.flat_shard_step = True
    try:
        opt = get_megatron_optimizer(OptimizerConfig(lr=3e-3, weight_decay=0.05, clip_grad=0.05, use_distributed_optimizer=True,
                                                     **{half: True}, **overrides), [ddp])
    finally:
        DistributedOptimizer.flat_shard_step = previous
    return model, ddp, opt


def _train_with_and_without_copies(fp8_param: bool, tp: int) -> dict:
    runs = {}
    for copies in (False, True):
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            model, ddp, opt = _optimizer("bf16", False, {}, fp8_param, tp)
            skipped = opt._skip_main_grad_copies
            opt._skip_main_grad_copies = not copies  # the same run, the copies made anyway
            losses, grads_after_prepare = [], []
            prepare = opt.prepare_grads

            def watch_prepare(prepare=prepare, opt=opt, seen=grads_after_prepare):
                found_inf = prepare()
                seen.append(sum(p.grad is not None for p in opt.get_parameters()))
                return found_inf

            opt.prepare_grads = watch_prepare
            for step in range(STEPS):
                gen = torch.Generator().manual_seed(700 + step)
                losses.append(dp_train_step(ddp, opt, torch.randint(0, VOCAB, (8, SEQ + 1), generator=gen)))
            runs[copies] = {"losses": losses, "skipped_by_default": skipped, "flat": opt._flat is not None,
                            "norm_over_shards": opt._norm_over_flat_shards,
                            "grads_after_prepare": grads_after_prepare, "params": len(opt.get_parameters()),
                            "weights": {k: v.detach().clone() for k, v in model.named_parameters()}}
        finally:
            parallel_state.destroy_model_parallel()
    return runs


@pytest.mark.parametrize("fp8_param, tp", [(False, 1), (True, 1), (False, 2)], ids=["bf16", "fp8_param", "bf16-tp2"])
def test_flat_step_makes_no_gradient_copies_nothing_reads_and_trains_the_same(fp8_param, tp):
    # TP=2: rank 1's replicated params do not count towards the norm, which then reads the counted pieces' views.
    for rank, runs in enumerate(run_on_ranks(2, _train_with_and_without_copies, fp8_param, tp)):
        without, with_copies = runs[False], runs[True]
        assert without["flat"] and with_copies["flat"]
        assert without["norm_over_shards"] == (tp == 1 or rank == 0)
        assert without["skipped_by_default"]
        assert without["grads_after_prepare"] == [0] * STEPS
        assert with_copies["grads_after_prepare"] == [with_copies["params"]] * STEPS
        if tp == 1:  # the same norm (the flat shard slices) and the same step: bit for bit
            assert without["losses"] == with_copies["losses"]
            for name, weight in without["weights"].items():
                assert torch.equal(weight, with_copies["weights"][name]), name
        else:  # the norm reads bf16 views instead of fp32 copies: the same sum, maybe in another order
            torch.testing.assert_close(torch.tensor(without["losses"]), torch.tensor(with_copies["losses"]),
                                       rtol=1e-5, atol=1e-5)
            for name, weight in without["weights"].items():
                torch.testing.assert_close(weight, with_copies["weights"][name], msg=name)  # bf16 tolerance


def _flat_step_used(half: str, grad_reduce_in_fp32: bool, overrides: dict) -> dict:
    parallel_state.initialize_model_parallel()
    try:
        _, _, opt = _optimizer(half, grad_reduce_in_fp32, overrides)
        return {"flat": opt._flat is not None, "skip_copies": getattr(opt, "_skip_main_grad_copies", False)}
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("half, overrides", [
    ("fp16", {"initial_loss_scale": 1024.0}),
    ("bf16", {"log_num_zeros_in_grad": True}),
    ("bf16", {"grad_norm_skip_threshold": 1e6}),
], ids=["grad-scaler", "zero-count", "skip-threshold"])
def test_flat_step_is_not_used_where_a_pass_rewrites_copied_gradients(half, overrides):
    copied, = {tuple(r.items()) for r in run_on_ranks(2, _flat_step_used, half, False, overrides)}
    assert dict(copied) == {"flat": False, "skip_copies": False}
    # With fp32 gradient buffers the main gradients are views of them: the rewrite reaches the flat step.
    viewed, = {tuple(r.items()) for r in run_on_ranks(2, _flat_step_used, half, True, overrides)}
    assert dict(viewed) == {"flat": True, "skip_copies": False}
