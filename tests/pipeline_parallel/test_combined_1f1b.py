"""The combined 1F1B schedule (``overlap_moe_expert_parallel_comm``) without pipelining, EP=2 on 2 gloo ranks.

With the flag on, ``forward_backward_no_pipelining`` runs forward ``i + 1`` interleaved with backward ``i``
node by node; the losses and every gradient must equal the flag-off run bit for bit and the single-process
reference at 1e-5 (dense gradients from this rank's data, expert gradients summed over both ranks' data: no DDP
here).
"""

from __future__ import annotations

import pytest
import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.transformer.module import Float16Module
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel.combined_1f1b_utils import (
    EP,
    PlanRuns,
    forward_step,
    grads_by_key,
    micro_batches,
    reference_grads,
)
from tests.transformer.moe.moe_parallel_utils import SEQ, build, global_tensors, load_globals

MICRO = 3
CASES = {
    "mixtral": ("mixtral", {}),
    "deepseek": ("deepseek", {}),  # shared experts with a gate: the shared output crosses nodes
    "dense_and_moe": ("mixtral", {"moe_layer_freq": [0, 1]}),  # a dense layer's no-op dispatch/combine
    "one_local_expert": ("mixtral", {"num_moe_experts": 2, "moe_router_topk": 1}),
    "early_attn_release": ("mixtral", {"ep_overlap_early_attn_memory_release": True}),
    "bf16_float16_module": ("mixtral", {"float16_module": True}),  # real bf16 arithmetic: flag on vs off only
}


def _run(case: str, overlap: bool, before: dict) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    flavour, overrides = CASES[case]
    overrides = {k: v for k, v in overrides.items() if k != "float16_module"}
    if not overlap:
        overrides = {k: v for k, v in overrides.items() if k != "ep_overlap_early_attn_memory_release"}
    model = build(flavour, expert_model_parallel_size=EP, moe_token_dispatcher_type="alltoall", bf16=True,
                  overlap_moe_expert_parallel_comm=overlap, **overrides)
    load_globals(model, before)
    inner = model
    if CASES[case][1].get("float16_module"):
        model = Float16Module(model.config, model)
    rank = parallel_state.get_data_parallel_rank()
    with PlanRuns.record() as runs:
        logs = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(micro_batches(rank, MICRO)), model=[model],
            num_microbatches=MICRO, seq_length=SEQ, micro_batch_size=1, forward_only=False)
    # Forward 0 alone, then (forward i + 1, backward i), then backward M - 1; nothing without the flag.
    expected = (1, MICRO - 1, 1) if overlap else (0, 0, 0)
    assert (runs.forward, runs.both, runs.backward) == expected, vars(runs)
    return [d["lm loss"] for d in logs], grads_by_key(inner)


def _check(case: str) -> str:
    flavour, overrides = CASES[case]
    ref_overrides = {k: v for k, v in overrides.items()
                     if k not in ("ep_overlap_early_attn_memory_release", "float16_module")}
    torch.manual_seed(1234)
    before = global_tensors(build(flavour, **ref_overrides))
    refs = [reference_grads(flavour, before, r, MICRO, **ref_overrides) for r in range(EP)]
    parallel_state.initialize_model_parallel(expert_model_parallel_size=EP)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_data_parallel_rank()
        off_losses, off_grads = _run(case, False, before)
        on_losses, on_grads = _run(case, True, before)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(off_losses), rtol=0, atol=0)
        bf16 = bool(overrides.get("float16_module"))
        ref_tol = dict(rtol=2e-2, atol=2e-2) if bf16 else dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.stack(on_losses), torch.stack(refs[rank][0]), **ref_tol)
        assert on_grads.keys() == off_grads.keys()
        for piece, (key, where, grad) in on_grads.items():
            torch.testing.assert_close(grad, off_grads[piece][2], rtol=0, atol=0,
                                       msg=lambda m, k=piece: f"{case} flag on vs off {k}: {m}")
            assert key.endswith("expert_bias") or grad.abs().sum() > 0, f"{case}: no gradient reached {piece}"
            # An expert's gradient sums both ranks' tokens; a replicated parameter's is this rank's data only.
            sources = range(EP) if ".experts." in key else [rank]
            want = sum(refs[r][1][key] for r in sources)[where]
            if not bf16:  # bf16 gradients of a tiny model are too coarse for an fp32 reference
                torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=piece: f"{case} vs single process {k}: {m}")
        return case
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("case", list(CASES))
def test_overlap_matches_flag_off_and_single_process(case: str):
    assert run_on_ranks(2, _check, case) == [case, case]
