"""MambaModel ("M*M-") under TP=2 matches one process on the same weights: per-token loss and every gradient."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.mamba.mamba_test_utils import batch, build

PATTERN = "M*M-"
ROW = ("out_proj.weight", "linear_proj.weight", "linear_fc2.weight")
REPLICATED = ("layernorm.weight", ".norm.weight", "final_norm.weight")
D_INNER, BC, HEADS = 32, 16, 4  # z/x sizes, B/C sizes (groups * state), heads of the tiny config


def _sections(name: str) -> list[int] | None:
    """Global sizes of the TP-split parts stacked along dim 0 of a fused Mamba tensor."""
    if name.endswith("in_proj.weight"):
        return [D_INNER, D_INNER, BC, BC, HEADS]
    if name.endswith(("conv1d_weight", "conv1d_bias")):
        return [D_INNER, BC, BC]
    return None


def shard(name: str, full: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    if name.endswith(REPLICATED) and "mixer.norm" not in name:
        return full
    if name.endswith(ROW):
        return full.chunk(tp, dim=1)[rank]
    sections = _sections(name)
    if sections:
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in full.split(sections, dim=0)], dim=0)
    return full.chunk(tp, dim=0)[rank]


def unshard(name: str, pieces: list[torch.Tensor]) -> torch.Tensor:
    if name.endswith(REPLICATED) and "mixer.norm" not in name:
        return pieces[0]
    if name.endswith(ROW):
        return torch.cat(pieces, dim=1)
    sections = _sections(name)
    if sections:
        local = [s // len(pieces) for s in sections]
        parts = [p.split(local, dim=0) for p in pieces]
        return torch.cat([torch.cat([p[i] for p in parts], dim=0) for i in range(len(sections))], dim=0)
    return torch.cat(pieces, dim=0)


def _check(tp: int, sequence_parallel: bool) -> str:
    torch.manual_seed(1234)
    ref = build(PATTERN)
    ids, pos, labels = batch(seq=12 if sequence_parallel else 11)
    ref_loss = ref(ids, pos, None, labels=labels)
    ref_loss.sum().backward()
    ref_state = {k: v.detach() for k, v in ref.named_parameters()}
    ref_grads = {k: v.grad for k, v in ref.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(PATTERN, tensor_model_parallel_size=tp, sequence_parallel=sequence_parallel)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "mixer." in name and not name.endswith("proj.weight"):
                    # CPU initialization draws the mixer's own tensors at full size and slices them, so the
                    # TP model starts from the single-process values whatever the RNG tracker holds.
                    torch.testing.assert_close(param, shard(name, ref_state[name], tp, rank), rtol=0, atol=0)
                param.copy_(shard(name, ref_state[name], tp, rank))
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(tp)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            torch.testing.assert_close(unshard(name, pieces), ref_grads[name], rtol=1e-5, atol=1e-5,
                                       msg=lambda m, n=name: f"{n}: {m}")
    finally:
        parallel_state.destroy_model_parallel()
    return "ok"


def test_tp2_matches_single_process():
    assert run_on_ranks(2, _check, 2, False) == ["ok", "ok"]



def test_tp2_sequence_parallel_matches_single_process():
    """Runs right after the plain TP=2 check in the same rank pool, so state left by it must not leak."""
    assert run_on_ranks(2, _check, 2, True) == ["ok", "ok"]
