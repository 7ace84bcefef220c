"""``zero_grad_buffer_on_side_stream``: the gradient buffers are zeroed on a side stream, overlapped with the forward.

A tiny GPT under DDP (one rank) accumulates two micro-batches per step for three steps, with the fused
weight-gradient GEMM; before each ``zero_grad_buffer`` every ``main_grad`` is filled with NaN (what a skipped
step may leave). With the option the gradients must equal the plain zeroing's bit for bit: the compute stream
waits for the zeroing before any accumulation. On the CPU the option is a plain zeroing.
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like


def _steps(side_stream: bool, device: str) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    model = build(llama_like(), gradient_accumulation_fusion=True).to(device)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        use_distributed_optimizer=True, zero_grad_buffer_on_side_stream=side_stream), model)
    results = []
    for step in range(3):
        for p in model.parameters():
            p.main_grad.fill_(float("nan"))
        ddp.zero_grad_buffer()
        for seed, sync in ((10 * step + 3, False), (10 * step + 4, True)):
            ids, pos, labels = (t.to(device) for t in batch(seed))
            if sync:
                ddp(ids, pos, None, labels=labels).float().mean().backward()
            else:
                with ddp.no_sync():
                    ddp(ids, pos, None, labels=labels).float().mean().backward()
        ddp.finish_grad_sync()
        results.append({name: p.main_grad.detach().cpu() for name, p in model.named_parameters()})
    return results


def _compare(device: str) -> int:
    parallel_state.initialize_model_parallel()
    try:
        side, plain = _steps(True, device), _steps(False, device)
        for side_step, plain_step in zip(side, plain):
            for name, value in plain_step.items():
                assert torch.isfinite(value).all(), name
                assert torch.equal(side_step[name], value), name
        return len(side)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_side_stream_zeroing_equals_plain_zeroing(device: str):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    assert run_on_ranks(1, _compare, device) == [3]
