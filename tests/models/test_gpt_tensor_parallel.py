"""GPTModel under TP=2/4 (with and without sequence parallelism, with full and selective recompute)
matches the TP=1 model on the same weights: per-token loss and every gradient, fp32 on gloo.

Also: with dropout on (hidden and attention), full and selective recompute reproduce the run
without recompute exactly: the same loss, every gradient, and the same dropout masks.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import batch, build, gpt2_like, llama_like, loss_and_grads, shard, unshard

WORLD = 4

# Split into several calls so that each stays far below the harness's per-call limit on a busy CI machine.
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
    return loss_and_grads(model)


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


@pytest.mark.parametrize("start", range(0, len(CASES), 3))
def test_tensor_parallel_matches_single_process(start: int):
    cases = CASES[start:start + 3]
    results = run_on_ranks(WORLD, _check_cases, cases)
    assert all(len(r) == len(cases) for r in results)


_RECOMPUTE = {
    "none": dict(),
    "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn", "mlp"]),
}


def _run_with_dropout(spec: dict, state: dict, overrides: dict) -> tuple[torch.Tensor, dict, list]:
    """Loss, gradients and every hidden-dropout keep-mask drawn (forward and recompute) for one run."""
    tensor_parallel.model_parallel_cuda_manual_seed(99)
    torch.manual_seed(99)
    model = build(spec, tensor_model_parallel_size=2, sequence_parallel=True, **overrides)
    model.load_state_dict(state)
    masks = []
    dropout = F.dropout

    def recording_dropout(x, p=0.5, training=True, inplace=False):
        out = dropout(x, p, training, inplace)
        masks.append(out != 0)
        return out

    F.dropout = recording_dropout
    try:
        ids, pos, labels = batch()
        loss = model(ids, pos, None, labels=labels)
        loss.sum().backward()
    finally:
        F.dropout = dropout
    return loss.detach(), {k: v.grad for k, v in model.named_parameters()}, masks


def _check_recompute_with_dropout() -> dict:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    spec = llama_like(hidden_dropout=0.2, attention_dropout=0.2)
    tensor_parallel.model_parallel_cuda_manual_seed(5)
    state = build(spec, tensor_model_parallel_size=2, sequence_parallel=True).state_dict()
    ref_loss, ref_grads, ref_masks = _run_with_dropout(spec, state, _RECOMPUTE["none"])
    # The embedding dropout, then two residual dropouts per layer; each really drops something.
    layer_draws = 2 * spec["config"]["num_layers"]
    assert len(ref_masks) == 1 + layer_draws
    assert all(0 < int(m.sum()) < m.numel() for m in ref_masks)
    drawn = {}
    for name in ("full", "selective"):
        loss, grads, masks = _run_with_dropout(spec, state, _RECOMPUTE[name])
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for key, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[key], rtol=1e-6, atol=1e-7, msg=lambda m, k=key: f"{k}: {m}")
        # Forward masks first, then the masks the recompute draws again: each equals its original.
        forward, recomputed = masks[:len(ref_masks)], masks[len(ref_masks):]
        assert all(torch.equal(a, b) for a, b in zip(forward, ref_masks))
        # Backward recomputes one layer at a time, last layer first; selective recompute draws no hidden dropout.
        per_layer = [ref_masks[1 + 2 * i: 3 + 2 * i] for i in range(spec["config"]["num_layers"])]
        expected_recomputed = [m for layer in reversed(per_layer) for m in layer] if name == "full" else []
        assert len(recomputed) == len(expected_recomputed)
        assert all(torch.equal(a, b) for a, b in zip(recomputed, expected_recomputed))
        drawn[name] = len(recomputed)
    # Without recompute the loss differs from a different dropout draw (the masks matter).
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    other = build(spec, tensor_model_parallel_size=2, sequence_parallel=True)
    other.load_state_dict(state)
    ids, pos, labels = batch()
    assert not torch.equal(other(ids, pos, None, labels=labels).detach(), ref_loss)
    return drawn


def test_recompute_reproduces_dropout_masks_and_gradients():
    results = run_on_ranks(WORLD, _check_recompute_with_dropout)
    assert all(r == {"full": 4, "selective": 0} for r in results)
