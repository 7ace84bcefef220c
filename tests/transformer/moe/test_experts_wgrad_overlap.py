"""``overlap_dispatch_backward_with_experts_wgrad``: the routed experts defer their weight gradients and run them
at the dispatch all-to-all's backward, in the ordinary schedule; EP=2 on 2 gloo ranks, losses and every gradient
equal the run without it."""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel.delayed_wgrad import DelayedWgradMixin, pending_delayed_wgrads
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import EP, forward_step, grads_by_key, micro_batches
from tests.transformer.moe.moe_parallel_utils import SEQ, build, global_tensors, load_globals

MICRO = 2


def _run(grouped: bool, overlap: bool, before: dict) -> tuple[list[torch.Tensor], dict]:
    model = build("deepseek", expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall",
                  moe_grouped_gemm=grouped, overlap_dispatch_backward_with_experts_wgrad=overlap)
    load_globals(model, before)
    deferring = [name for name, m in model.named_modules()
                 if isinstance(m, DelayedWgradMixin) and m.delay_wgrad_compute]
    assert bool(deferring) == overlap and all(".experts." in name for name in deferring), deferring
    rank = parallel_state.get_data_parallel_rank()
    logs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(rank, MICRO)), model=[model],
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    assert pending_delayed_wgrads(model) == 0
    return [d["lm loss"] for d in logs], grads_by_key(model)


def _check(grouped: bool) -> bool:
    torch.manual_seed(1234)
    before = global_tensors(build("deepseek", moe_grouped_gemm=grouped))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        off_losses, off_grads = _run(grouped, False, before)
        on_losses, on_grads = _run(grouped, True, before)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=1e-6, atol=1e-6)
        assert on_grads.keys() == off_grads.keys()
        for piece, (key, _, grad) in on_grads.items():
            torch.testing.assert_close(grad, off_grads[piece][2], rtol=1e-6, atol=1e-6, msg=piece)
            assert key.endswith("expert_bias") or grad.abs().sum() > 0, piece
        return True
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("grouped", [False, True])
def test_experts_wgrad_at_dispatch_backward_matches_immediate(grouped: bool):
    assert run_on_ranks(2, _check, grouped) == [True, True]


def _cuda_grads(overlap: bool, before: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build("mixtral", moe_grouped_gemm=True, overlap_dispatch_backward_with_experts_wgrad=overlap)
    load_globals(model, before)
    model.cuda()
    losses = []
    for ids, pos, labels in micro_batches(0, MICRO):
        loss = model(ids.cuda(), pos.cuda(), None, labels=labels.cuda()).float().mean()
        loss.backward()
        losses.append(loss.detach())
    torch.cuda.synchronize()
    assert pending_delayed_wgrads(model) == 0
    if overlap:  # the experts' GEMMs ran on the layer's side stream
        assert all(layer.mlp._delayed_wgrad_stream is not None for layer in model.decoder.layers)
    return losses, {name: p.grad.detach().cpu() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_experts_wgrad_on_a_side_stream_matches_immediate_on_cuda():
    torch.manual_seed(1234)
    before = global_tensors(build("mixtral", moe_grouped_gemm=True))
    off_losses, off_grads = _cuda_grads(False, before)
    on_losses, on_grads = _cuda_grads(True, before)
    torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=1e-6, atol=1e-6)
    assert on_grads.keys() == off_grads.keys() and any(".experts." in name for name in on_grads)
    for name, grad in on_grads.items():
        torch.testing.assert_close(grad, off_grads[name], rtol=1e-6, atol=1e-6, msg=name)
