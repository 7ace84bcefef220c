"""The schedules never make the host wait for the device between micro-batches.

A blocking copy (a CPU token count moved with ``.to(device)``) drains the device's queue once per
micro-batch, and the host then has to load the next batch and launch its kernels while the GPU idles
(about 2 ms per micro-batch on the reference config). On CUDA the whole ``forward_backward_func``
call runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising op.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.optimizer import OptimizerConfig
from megatron_core.optimizer.optimizer import FP32Optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.pipeline_parallel.microbatch_step import add_token_count, new_token_counter
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel import toy_model
from tests.pipeline_parallel.toy_model import ToyConfig, ToyStage, make_batches


def test_scale_loss_keeps_a_scalar_loss_scalar_and_scales_it():
    model = torch.nn.Linear(2, 2)
    optimizer = FP32Optimizer(torch.optim.Adam(model.parameters()), OptimizerConfig(lr=1e-3))
    loss = model(torch.ones(1, 2)).sum()
    scaled = optimizer.scale_loss(loss)
    assert scaled.shape == loss.shape and torch.equal(scaled, loss)


def test_token_count_adds_cpu_scalars_and_device_tensors():
    total = new_token_counter()
    add_token_count(total, torch.tensor(3, dtype=torch.int))
    add_token_count(total, torch.tensor(4, dtype=torch.int, device=total.device))
    add_token_count(total, torch.tensor([5], dtype=torch.int))
    assert int(total) == 12
    with pytest.raises(ValueError, match=r"num_tokens of shape \(2,\); expected one count"):
        add_token_count(total, torch.tensor([1, 2], dtype=torch.int))
    if torch.cuda.is_available():  # a device count into a host counter (gloo) is copied over
        host_total = torch.zeros([], dtype=torch.int)
        add_token_count(host_total, torch.tensor(2, dtype=torch.int, device="cuda"))
        assert int(host_total) == 2


def _schedule_without_syncs(step_name: str) -> list[float]:
    parallel_state.initialize_model_parallel()
    try:
        config = ToyConfig(calculate_per_token_loss=step_name == "per_token")
        model = ToyStage(config, list(range(toy_model.NUM_LAYERS)), pre_process=True).cuda()
        # The loss scale as the training loops pass it: a host-side 1.0 without a grad scaler.
        optimizer = FP32Optimizer(torch.optim.Adam(model.parameters()), OptimizerConfig(lr=1e-3))
        config.grad_scale_func = optimizer.scale_loss
        batches = [{k: v.cuda() for k, v in b.items()} for b in make_batches(4, seed=0)]
        step = toy_model.forward_step if step_name == "mse" else toy_model.forward_step_per_token
        forward_backward = get_forward_backward_func()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            losses = forward_backward(forward_step_func=step, data_iterator=iter(batches), model=model,
                                      num_microbatches=4, seq_length=4, micro_batch_size=2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert all(p.grad is not None for p in model.parameters())
        return [float(d["loss"]) for d in losses]
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.gpu
def test_no_pipelining_schedule_makes_no_host_sync_on_cuda():
    # The rank pool's group is gloo, whose token counter lives on the host: a loss function that counts
    # tokens on the GPU (the per-token form) would have to copy them back, so the test uses the mean form.
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    (losses,) = run_on_ranks(1, _schedule_without_syncs, "mse")
    assert len(losses) == 4
