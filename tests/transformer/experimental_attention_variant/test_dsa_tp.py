"""DeepSeek sparse attention under tensor (and sequence) parallelism equals one process (2 gloo ranks, fp32).

A 2-layer DSA GPT in training mode (indexer KL loss on, dense and sparse) with TP=2, with and without sequence
parallelism: the per-token loss and every gradient (gathered over TP; the duplicated indexer's gradients equal
on both ranks) match the single-process run on the same weights.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.transformer.experimental_attention_variant.dsa_common import (
    TOL,
    batch,
    dsa_config,
    dsa_gpt,
    reset_dsa_globals,
    shard_tp,
    unshard_tp,
)


def _run(model: torch.nn.Module) -> torch.Tensor:
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    return loss.detach()


def _check_tp(overrides: dict) -> str:
    reset_dsa_globals()
    single = {k: v for k, v in overrides.items() if k != "sequence_parallel"}
    ref = dsa_gpt(dsa_config(**single)).train()
    ref_loss = _run(ref)
    state = {k: v.detach().clone() for k, v in ref.named_parameters()}
    ref_grads = {k: v.grad.detach().clone() for k, v in ref.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = dsa_gpt(dsa_config(tensor_model_parallel_size=2, **overrides)).train()
        rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard_tp(name, state[name], 2, rank))
        torch.testing.assert_close(_run(model), ref_loss, **TOL)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(unshard_tp(name, pieces), ref_grads[name], **TOL,
                                       msg=lambda m, n=name: f"{n}: {m}")
        return f"tp=2 {overrides}"
    finally:
        parallel_state.destroy_model_parallel()
        reset_dsa_globals()


@pytest.mark.parametrize("overrides", [dict(), dict(sequence_parallel=True),
                                       dict(sequence_parallel=True, dsa_indexer_use_sparse_loss=True)],
                         ids=["tp2", "tp2_sp", "tp2_sp_sparse_loss"])
def test_tp_matches_single_process(overrides: dict):
    assert len(run_on_ranks(2, _check_tp, overrides)) == 2
