"""``delay_wgrad_compute`` in the combined 1F1B schedule, EP=2 on 2 gloo ranks: the linears queue their weight
gradients and the schedule runs them through ``backward_dw``; losses and every gradient must equal the run without
deferral and the single-process reference (dense gradients from this rank's data, expert gradients summed over
both ranks' data: no DDP here)."""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.tensor_parallel.delayed_wgrad import DelayedWgradMixin, pending_delayed_wgrads
from megatron_core.transformer.moe.grouped_linear import _GroupedLinear
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import (
    EP,
    forward_step,
    grads_by_key,
    micro_batches,
    reference_grads,
)
from tests.transformer.moe.moe_parallel_utils import SEQ, build, global_tensors, load_globals

MICRO = 3
CASES = {
    "mixtral": ("mixtral", {}),
    "deepseek": ("deepseek", {}),  # shared experts: their weight gradients run in the attention slot
    "dense_and_moe": ("mixtral", {"moe_layer_freq": [0, 1]}),
    "grouped_experts": ("mixtral", {"moe_grouped_gemm": True}),
}


def _run(case: str, delay: bool, before: dict) -> tuple[list[torch.Tensor], dict]:
    flavour, overrides = CASES[case]
    model = build(flavour, expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall", bf16=True,
                  overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=delay, **overrides)
    load_globals(model, before)
    deferring = [m for m in model.modules() if isinstance(m, DelayedWgradMixin) and m.delay_wgrad_compute]
    assert bool(deferring) == delay
    if delay:  # the output layer and the embedding are outside the transformer layers: never deferred
        assert not model.output_layer.delay_wgrad_compute
        assert all(m.weight.skip_backward_post_hook for m in deferring)
        grouped = any(isinstance(m, _GroupedLinear) for m in deferring)
        assert grouped == bool(overrides.get("moe_grouped_gemm")), [type(m).__name__ for m in deferring]
    rank = parallel_state.get_data_parallel_rank()
    logs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(rank, MICRO)), model=[model],
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    assert pending_delayed_wgrads(model) == 0
    return [d["lm loss"] for d in logs], grads_by_key(model)


def _check(case: str) -> str:
    flavour, overrides = CASES[case]
    torch.manual_seed(1234)
    before = global_tensors(build(flavour, **overrides))
    refs = [reference_grads(flavour, before, r, MICRO, **overrides) for r in range(EP)]
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_data_parallel_rank()
        off_losses, off_grads = _run(case, False, before)
        on_losses, on_grads = _run(case, True, before)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(refs[rank][0]), rtol=1e-5, atol=1e-6)
        assert on_grads.keys() == off_grads.keys()
        for piece, (key, where, grad) in on_grads.items():
            torch.testing.assert_close(grad, off_grads[piece][2], rtol=1e-6, atol=1e-6,
                                       msg=lambda m, k=piece: f"{case} deferred vs immediate {k}: {m}")
            assert key.endswith("expert_bias") or grad.abs().sum() > 0, f"{case}: no gradient reached {piece}"
            sources = range(EP) if ".experts." in key else [rank]
            want = sum(refs[r][1][key] for r in sources)[where]
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=piece: f"{case} vs single process {k}: {m}")
        return case
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", list(CASES))
def test_delayed_wgrad_matches_immediate_and_single_process(case: str):
    assert run_on_ranks(2, _check, case) == [case, case]


def _ddp_run(delay: bool, before: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    model = build("deepseek", expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall", bf16=True,
                  overlap_moe_expert_parallel_comm=True, delay_wgrad_compute=delay, gradient_accumulation_fusion=True)
    load_globals(model, before)
    ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
        overlap_grad_reduce=True, bucket_size=2000, delay_wgrad_compute=delay), model)
    model.config.no_sync_func = ddp.no_sync  # what Megatron's training loop sets: reduce after the last backward
    rank = parallel_state.get_data_parallel_rank()
    logs = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro_batches(rank, MICRO)), model=[ddp],
        num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    ddp.finish_grad_sync()
    return [d["lm loss"] for d in logs], {name: p.main_grad.clone() for name, p in model.named_parameters()}


def _check_ddp() -> bool:
    torch.manual_seed(1234)
    before = global_tensors(build("deepseek"))
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        off_losses, off_grads = _ddp_run(False, before)
        on_losses, on_grads = _ddp_run(True, before)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=1e-6, atol=1e-6)
        for name, grad in on_grads.items():
            torch.testing.assert_close(grad, off_grads[name], rtol=1e-6, atol=1e-6, msg=name)
            assert name.endswith("expert_bias") or grad.abs().sum() > 0, name
        return True
    finally:
        parallel_state.destroy_model_parallel()


def test_delayed_wgrad_under_ddp_with_overlapped_grad_reduce():
    """The deferred weights' buckets (gradient_accumulation_fusion into main_grad, overlap_grad_reduce) are reduced
    after backward_dw and give the immediate run's reduced gradients."""
    assert run_on_ranks(2, _check_ddp) == [True, True]
