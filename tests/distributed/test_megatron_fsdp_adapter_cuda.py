"""Megatron-FSDP's ``FullyShardedDataParallel`` on one CUDA GPU (skipped without one): every sharding strategy
trains 3 AdamW steps (NCCL, CUDA kernels, the distributed optimizer's flat CUDA step) like the wrapper it maps
onto, built by hand from the same weights."""

from __future__ import annotations

import pytest
import torch

from tests.cuda_process_group import in_fresh_process
from tests.distributed import megatron_fsdp_gpt as mg

pytestmark = pytest.mark.gpu


def _train(strategy: str, adapter: bool) -> list[float]:
    from megatron_core import parallel_state
    from megatron_core.device import get_current_device
    from tests.distributed import fsdp_gpt as fg

    device = get_current_device()
    initial, _, _ = fg.reference(steps=0)
    model, opt, _ = mg.build_adapter(initial, 1, strategy) if adapter else mg.build_direct(initial, 1, strategy)
    positions = torch.arange(fg.SEQ, device=device).unsqueeze(0).expand(fg.GLOBAL_BATCH, fg.SEQ)
    losses = []
    for step in range(fg.STEPS):
        tokens = fg.global_batch(step).to(device)
        model.zero_grad_buffer()
        opt.zero_grad()
        loss = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:]).float().mean()
        loss.backward()
        model.finish_grad_sync()
        success, _, _ = opt.step()
        assert success
        losses.append(loss.item())
    assert parallel_state.get_data_parallel_world_size() == 1
    return losses


def _both(strategy: str) -> tuple[list[float], list[float]]:
    return _train(strategy, True), _train(strategy, False)


@pytest.mark.parametrize("strategy", mg.STRATEGIES)
def test_megatron_fsdp_on_one_gpu_trains_like_the_plain_wrapper(strategy: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    adapter, direct = in_fresh_process(_both, strategy)
    torch.testing.assert_close(torch.tensor(adapter), torch.tensor(direct), rtol=1e-5, atol=1e-5)
    assert adapter[-1] < adapter[0]
