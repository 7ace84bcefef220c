"""``T5Model`` at TP=2 equals one process on the same weights: loss and every gradient (fp32, gloo).

Each rank loads its shard of the TP=1 weights (column-parallel and vocab-parallel rows, row-parallel
columns, the rest replicated); the gradients, gathered back to the TP=1 layout, must match.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.T5 import t5_test_utils as t5

TP = 2
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_q.weight", "linear_q.bias", "linear_kv.weight",
          "linear_kv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight", "output_layer.weight",
          "output_layer.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")
CASES = {
    "untied_learned": dict(share_embeddings_and_output_weights=False),
    "tied_relative": dict(share_embeddings_and_output_weights=True, position_embedding_type="relative",
                          relative_attention_num_buckets=8, relative_attention_max_distance=16),
}


def _split_dim(name: str) -> int | None:
    return 0 if name.endswith(COLUMN) else 1 if name.endswith(ROW) else None


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    loss = model(**t5.inputs(seed=3))
    weights = torch.rand(loss.shape, generator=torch.Generator().manual_seed(4))
    (loss * weights).sum().backward()
    return loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _check_tp() -> list[str]:
    references = {}
    for case, kwargs in CASES.items():
        model = t5.model(t5.config(), **kwargs)
        t5.randomize(model, seed=5)
        references[case] = ({k: v.detach().clone() for k, v in model.named_parameters()}, *_run(model))
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    checked = []
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        for case, kwargs in CASES.items():
            ref_state, ref_loss, ref_grads = references[case]
            model = t5.model(t5.config(tensor_model_parallel_size=TP), **kwargs)
            with torch.no_grad():
                for name, param in model.named_parameters():
                    dim = _split_dim(name)
                    full = ref_state[name]
                    param.copy_(full if dim is None else full.chunk(TP, dim=dim)[rank])
            loss, grads = _run(model)
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
            assert grads.keys() == ref_grads.keys()
            for name, grad in grads.items():
                dim = _split_dim(name)
                if dim is not None:
                    pieces = [torch.empty_like(grad) for _ in range(TP)]
                    dist.all_gather(pieces, grad.contiguous(), group=group)
                    grad = torch.cat(pieces, dim=dim)
                ref = ref_grads[name]
                torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                           msg=lambda m, n=name, c=case: f"{c} {n}: {m}")
            checked.append(case)
    finally:
        parallel_state.destroy_model_parallel()
    return checked


def test_tp2_matches_single_process():
    assert run_on_ranks(TP, _check_tp) == [sorted(CASES, key=list(CASES).index)] * TP
