"""``BertModel`` under TP=2, with and without sequence parallelism, matches the one-process model on the
same weights: per-token loss, binary logits and every gradient, fp32 on gloo.

Tied embeddings, token types, the binary head and right-padded samples are all on. The word table,
the output bias, QKV and fc1 are split along their rows, ``linear_proj`` and fc2 along their columns;
everything else (norms, the LM head's dense layer, pooler, binary head, position and token-type tables)
is replicated. Under sequence parallelism the gradients of parameters marked ``sequence_parallel``
are partial sums over each rank's tokens and are summed over the TP group first, as
``finalize_model_grads`` does.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from tests.dist_harness import run_on_ranks
from tests.models.bert.bert_test_utils import batch, build, config, masked_objective, randomize

TP = 2
COLUMN = ("linear_qkv.weight", "linear_qkv.bias", "linear_fc1.weight", "linear_fc1.bias", "word_embeddings.weight",
          "output_layer.weight", "output_layer.bias")
ROW = ("linear_proj.weight", "linear_fc2.weight")
MODEL = dict(num_tokentypes=2, share_embeddings_and_output_weights=True, add_binary_head=True)


def _split_dim(name: str) -> int | None:
    if name.endswith(COLUMN):
        return 0
    if name.endswith(ROW):
        return 1
    return None


def _run(model: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = batch()
    loss, binary = model(**inputs)
    masked_objective(loss, binary, inputs["attention_mask"]).backward()
    return loss.detach(), binary.detach()


def _check(sequence_parallel: bool) -> str:
    torch.manual_seed(0)
    reference = build(**MODEL)
    randomize(reference, seed=1)
    ref_loss, ref_binary = _run(reference)
    ref = {name: (param.detach(), param.grad) for name, param in reference.named_parameters()}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(config(tensor_model_parallel_size=TP, sequence_parallel=sequence_parallel), **MODEL)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        with torch.no_grad():
            for name, param in model.named_parameters():
                dim = _split_dim(name)
                full = ref[name][0]
                param.copy_(full if dim is None else full.chunk(TP, dim=dim)[rank])
        loss, binary = _run(model)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(binary, ref_binary, rtol=1e-5, atol=1e-5)
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(TP)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            dim = _split_dim(name)
            full = pieces[0] if dim is None else torch.cat(pieces, dim=dim)
            torch.testing.assert_close(full, ref[name][1], rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
        marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
    finally:
        parallel_state.destroy_model_parallel()
    return ",".join(marked)


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_matches_single_process(sequence_parallel: bool):
    marked = run_on_ranks(TP, _check, sequence_parallel)
    assert marked[0] == marked[1]
    # Under sequence parallelism the norms and the LM head's dense layer see only their rank's tokens.
    assert ("lm_head.dense.weight" in marked[0]) == sequence_parallel
    assert ("lm_head.layer_norm.weight" in marked[0]) == sequence_parallel
