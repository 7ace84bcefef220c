"""Section 7, check 11: an Inf in the loss on one rank stops the step on every rank, weights unchanged.

On 2 ranks (data, tensor or pipeline parallel) rank 1's loss is multiplied by ``inf``. The
gradients become non-finite, the optimizer's global grad norm is non-finite on every rank, and
``optimizer.step()`` reports no update everywhere; a SHA-256 over every parameter is unchanged.
With ``DistributedDataParallelConfig.check_for_nan_in_grad`` (what Megatron's
``--check-for-nan-in-loss-and-grad`` turns on in the library) the non-finite gradients raise
before the data-parallel reduction, naming NaN/Inf.
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from megatron_core import parallel_state
from megatron_core.pipeline_parallel import get_forward_backward_func
from tests.dist_checkpointing.gpt_training import MBS, NUM_MICROBATCHES, SEQ, _batches, _forward_step, build
from tests.dist_harness import run_on_ranks


def _weights_sha(chunks) -> str:
    sha = hashlib.sha256()
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            sha.update(name.encode())
            sha.update(p.detach().float().contiguous().numpy().tobytes())
    return sha.hexdigest()


def _step_with_inf_loss(tp: int, pp: int, check_grads: bool = False):
    chunks, optimizer, _ = build(tp, pp)
    if check_grads:
        chunks[0].ddp_config.check_for_nan_in_grad = True
    before = _weights_sha(chunks)
    poison = torch.distributed.get_rank() == torch.distributed.get_world_size() - 1

    def forward_step(data_iterator, model):
        output, loss_func = _forward_step(data_iterator, model)

        def poisoned(per_token):
            loss, logged = loss_func(per_token)
            return (loss * float("inf") if poison else loss), logged

        return output, poisoned

    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    try:
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(_batches(1)),
                                    model=chunks[0], num_microbatches=NUM_MICROBATCHES, seq_length=SEQ,
                                    micro_batch_size=MBS)
        success, grad_norm, _ = optimizer.step()
        return success, grad_norm, before == _weights_sha(chunks)
    except RuntimeError as e:
        return str(e), None, before == _weights_sha(chunks)
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_inf_loss_on_one_rank_skips_the_step_everywhere(tp: int, pp: int) -> None:
    for rank, (success, grad_norm, unchanged) in enumerate(run_on_ranks(2, _step_with_inf_loss, tp, pp)):
        assert success is False, f"rank {rank}: the optimizer stepped (grad norm {grad_norm})"
        assert unchanged, f"rank {rank}: weights changed"


def test_check_for_nan_in_grad_raises_before_the_reduction() -> None:
    message, _, unchanged = run_on_ranks(1, _step_with_inf_loss, 1, 1, True)[0]
    assert isinstance(message, str) and "found NaN or Inf in local gradients" in message, message
    assert unchanged
