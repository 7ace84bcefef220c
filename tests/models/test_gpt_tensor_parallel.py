"""GPTModel under TP=2/4 (with and without sequence parallelism, with full and selective recompute)
matches the TP=1 model on the same weights: per-token loss and every gradient, fp32 on gloo."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, gpt2_like, llama_like, shard, unshard

WORLD = 4

CASES = [
    ("llama", 2, dict()),
    ("llama", 2, dict(sequence_parallel=True)),
    ("llama", 4, dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                      recompute_num_layers=1)),
    ("llama", 4, dict()),
    ("llama", 2, dict(recompute_granularity="selective")),
    ("llama", 2, dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"],
                      sequence_parallel=True)),
    ("gpt2", 2, dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1)),
    ("gpt2", 4, dict(sequence_parallel=True)),
    ("gpt2", 2, dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform",
                     recompute_num_layers=2)),
]


def _spec(kind: str) -> dict:
    return llama_like() if kind == "llama" else gpt2_like()


def _reference(kind: str) -> tuple[dict, torch.Tensor, dict]:
    """TP=1 weights, loss and grads, computed before any model-parallel group exists."""
    torch.manual_seed(1234)
    model = build(_spec(kind))
    ids, pos, labels = batch()
    loss = model(ids, pos, None, labels=labels)
    loss.sum().backward()
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    grads = {k: v.grad.detach().clone() for k, v in model.named_parameters()}
    return state, loss.detach(), grads


def _check_cases(cases: list) -> list[str]:
    checked = []
    for kind, tp, overrides in cases:
        ref_state, ref_loss, ref_grads = _reference(kind)
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
        try:
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
            spec = _spec(kind)
            gated = spec["config"].get("gated_linear_unit", False)
            model = build(spec, tensor_model_parallel_size=tp, **overrides)
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            group = parallel_state.get_tensor_model_parallel_group()
            with torch.no_grad():
                for name, param in model.named_parameters():
                    param.copy_(shard(name, ref_state[name], tp, tp_rank, gated))
            ids, pos, labels = batch()
            loss = model(ids, pos, None, labels=labels)
            loss.sum().backward()
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
            for name, param in model.named_parameters():
                grad = param.grad.clone()
                if getattr(param, "sequence_parallel", False):
                    dist.all_reduce(grad, group=group)
                pieces = [torch.empty_like(grad) for _ in range(tp)]
                dist.all_gather(pieces, grad.contiguous(), group=group)
                full = unshard(name, pieces, gated)
                torch.testing.assert_close(full, ref_grads[name], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
            checked.append(f"{kind} tp={tp} {overrides}")
        finally:
            parallel_state.destroy_model_parallel()
    return checked


def test_tensor_parallel_matches_single_process():
    results = run_on_ranks(WORLD, _check_cases, CASES)
    assert all(len(r) == len(CASES) for r in results)
