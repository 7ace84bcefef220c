"""The heterogeneous GPTModel under TP=2 (with and without sequence parallelism) equals one process on the
same weights: per-token loss and every gradient, fp32 on gloo. The replacing linears are column-parallel
(split along their output) and gather their output back, across hidden channels or, with sequence
parallelism, by a reduce-scatter over the sequence. A distributed checkpoint saved at TP=2 (every layer under
its own key) loads back at TP=1 into the original weights."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_core import dist_checkpointing, parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.transformer.heterogeneous.hetero_test_utils import batch, build, config

COLUMN = ("linear_qkv.weight", "self_attention.weight", "mlp.weight", "word_embeddings.weight", "output_layer.weight")
ROW = ("linear_proj.weight", "linear_fc2.weight")


def _shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if name.endswith("linear_fc1.weight"):  # [gate_r; up_r] per rank
        gate, up = full.chunk(2, dim=0)
        return torch.cat((gate.chunk(tp)[rank], up.chunk(tp)[rank]), dim=0)
    if name.endswith(COLUMN):
        return full.chunk(tp, dim=0)[rank]
    if name.endswith(ROW):
        return full.chunk(tp, dim=1)[rank]
    return full


def _unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith("linear_fc1.weight"):
        gates, ups = zip(*(p.chunk(2, dim=0) for p in pieces))
        return torch.cat((*gates, *ups), dim=0)
    if name.endswith(COLUMN):
        return torch.cat(pieces, dim=0)
    if name.endswith(ROW):
        return torch.cat(pieces, dim=1)
    return pieces[0]


def _loss_and_grads(model: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {k: v.grad for k, v in model.named_parameters()}


def _check(sequence_parallel: bool, directory: str | None = None) -> int:
    reference = build(config())
    ref_state = {k: v.detach().clone() for k, v in reference.named_parameters()}
    ref_loss, ref_grads = _loss_and_grads(reference)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(config(tensor_model_parallel_size=2, sequence_parallel=sequence_parallel))
        rank, group = parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(_shard(name, ref_state[name], 2, rank))
        loss, grads = _loss_and_grads(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        params = dict(model.named_parameters())
        for name, grad in grads.items():
            grad = grad.clone()
            if getattr(params[name], "sequence_parallel", False):  # norm weights: per-rank partial sums
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(2)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(_unshard(name, pieces), ref_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
        if directory is not None:
            dist_checkpointing.save(model.sharded_state_dict(), directory)
        return len(grads)
    finally:
        parallel_state.destroy_model_parallel()


def _reload_at_tp1(directory: str, ref_state: dict) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    try:
        model = build(config(), seed=77)
        model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), directory, strict="raise_all"))
        for name, param in model.named_parameters():
            torch.testing.assert_close(param, ref_state[name], rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()


def _check_both(directory: str) -> list[int]:
    counts = [_check(False), _check(True, directory)]
    _reload_at_tp1(directory, {k: v.detach() for k, v in build(config()).named_parameters()})
    return counts


def test_tensor_parallel_matches_single_process(tmp_path):
    directory = os.path.join(tmp_path, "ckpt")
    os.makedirs(directory)
    results = run_on_ranks(2, _check_both, directory)
    assert all(counts == results[0] and min(counts) > 20 for counts in results)
