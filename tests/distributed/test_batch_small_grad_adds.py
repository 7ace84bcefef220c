"""``batch_small_grad_adds``: DDP adds the small ``.grad``s (norm weights, biases) a backward pass at a time.

A tiny GPT (RMSNorm weights: small; the linear layers: fused or not) accumulates two micro-batches (the first under
``no_sync``) with the flag on and off, on 2 gloo ranks, from the same weights and data. Every ``main_grad`` must be
bitwise the same right after each ``backward()`` returns (the end-of-backward flush) and after the reduction, with
and without overlapped reduction and the distributed optimizer, in fp32 and in bf16 with fp32 gradient buffers.
"""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.distributed.deferred_grad_adds import DeferredGradAdds
from megatron_core.transformer import Float16Module
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, llama_like

MODES = {
    "plain": {},
    "distopt_overlap": {"use_distributed_optimizer": True, "overlap_grad_reduce": True, "bucket_size": 3000},
}


def _main_grads(batched: bool, mode: str, bf16: bool, fusion: bool) -> list[dict[str, torch.Tensor]]:
    torch.manual_seed(1234)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    overrides = dict(gradient_accumulation_fusion=fusion)
    if bf16:
        overrides.update(bf16=True, params_dtype=torch.bfloat16)
    model = build(llama_like(), **overrides)
    module = Float16Module(model.config, model) if bf16 else model
    config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, batch_small_grad_adds=batched, **MODES[mode])
    ddp = DistributedDataParallel(model.config, config, module)
    ddp.zero_grad_buffer()
    snapshots = []
    dp_rank = parallel_state.get_data_parallel_rank()
    for micro in range(2):
        ids, pos, labels = batch(10 * dp_rank + micro)
        with ddp.no_sync() if micro == 0 else nullcontext():
            ddp(ids, pos, None, labels=labels).float().mean().backward()
        if micro == 0:  # complete once backward() has returned
            snapshots.append({n: p.main_grad.detach().clone() for n, p in model.named_parameters()})
    ddp.finish_grad_sync()
    snapshots.append({n: p.main_grad.detach().clone() for n, p in model.named_parameters()})
    return snapshots


def _compare(mode: str, bf16: bool, fusion: bool) -> int:
    parallel_state.initialize_model_parallel()
    held_back: list[int] = []
    add = DeferredGradAdds.add
    DeferredGradAdds.add = lambda self, main_grad, grad: (held_back.append(1), add(self, main_grad, grad))[1]
    try:
        on = _main_grads(True, mode, bf16, fusion)
        deferred = len(held_back)  # every small unfused param of the tiny model (all of them are small here)
        assert deferred > 0 and deferred % 2 == 0, deferred  # the same set in each of the two micro-batches
        off = _main_grads(False, mode, bf16, fusion)
        assert len(held_back) == deferred
        compared = 0
        for got, want in zip(on, off):
            for name in want:
                assert torch.equal(got[name], want[name]), name
                compared += 1
        return compared
    finally:
        DeferredGradAdds.add = add
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("mode,bf16,fusion", [("plain", False, False), ("distopt_overlap", False, True),
                                              ("plain", True, True)])
def test_batched_small_grad_adds_give_the_same_main_grads(mode, bf16, fusion):
    counts = run_on_ranks(2, _compare, mode, bf16, fusion)
    assert counts[0] == counts[1] > 0


def test_deferred_adds_pack_mixed_dtypes_into_one_cast():
    mains = [torch.zeros(3, 2), torch.zeros(4)]
    grads = [torch.arange(6, dtype=torch.bfloat16).view(3, 2), torch.full((4,), 0.5, dtype=torch.bfloat16)]
    adds = DeferredGradAdds()
    for main, grad in zip(mains, grads):
        adds.add(main, grad)
    assert len(adds) == 2
    adds.flush()
    adds.flush()  # nothing left: a second flush adds nothing
    assert len(adds) == 0
    assert torch.equal(mains[0], torch.arange(6.0).view(3, 2)) and torch.equal(mains[1], torch.full((4,), 0.5))
