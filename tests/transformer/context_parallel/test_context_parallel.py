"""Context parallelism (p2p ring, all_gather, a2a, a2a+p2p) equals the CP=1 model: per-token loss and
every gradient, fp32 on gloo, causal with GQA; also with TP+SP, sliding windows, packed documents."""

from __future__ import annotations

import pytest

from tests.dist_harness import run_on_ranks
from tests.transformer.context_parallel import cp_cases

WORLD = 4

GROUPS = {
    "cp2": [dict(cp=2, comm="p2p", mask=True), dict(cp=2, comm="all_gather"), dict(cp=2, comm="a2a"),
            dict(cp=2, comm="a2a+p2p", hier=[1, 2]),
            dict(cp=2, comm="p2p", extra=dict(recompute_granularity="selective"))],
    "cp4": [dict(cp=4, comm="p2p"), dict(cp=4, comm="all_gather", mask=True), dict(cp=4, comm="a2a"),
            dict(cp=4, comm="a2a+p2p", hier=[2, 2])],
    "tp_sp_window": [dict(cp=2, tp=2, sp=True, comm="p2p"), dict(cp=2, tp=2, sp=True, comm="a2a"),
                     dict(cp=4, comm="p2p", window=(5, 0)), dict(cp=2, comm="all_gather", window=(2, 0))],
}


@pytest.mark.parametrize("group", list(GROUPS))
def test_context_parallel_matches_single_process(group: str):
    cases = GROUPS[group]
    results = run_on_ranks(WORLD, cp_cases.check_cases, cases)
    assert all(len(r) == len(cases) for r in results)


@pytest.mark.parametrize("comm", ["p2p", "a2a"])
def test_packed_documents_under_context_parallelism(comm: str):
    results = run_on_ranks(WORLD, cp_cases.check_packed, 2, comm)
    assert results == [f"packed cp=2 {comm}"] * WORLD


def test_bad_input_is_refused():
    results = run_on_ranks(WORLD, cp_cases.check_bad_input)
    errors = results[0]
    assert len(errors) == 3, errors
    assert "batch['tokens'] has sequence length 6 (dim 1), not divisible by 2 * context_parallel_size (4)" in errors[0]
    assert "sequence length (6) must be divisible by 2 * context_parallel_size (4)" in errors[1]
    assert "attention_dropout (0.1) is not supported with cp_comm_type 'p2p'" in errors[2]


@pytest.mark.parametrize("pp,distopt,per_token", [(2, False, True), (1, True, False)],
                         ids=["cp2_pp2_per_token_loss", "cp2_dp2_distopt_mean_loss"])
def test_context_parallel_training_step(pp: int, distopt: bool, per_token: bool):
    """CP=2 x PP=2 and CP=2 x DP=2 (distributed optimizer): gradients and the Adam step equal CP=1's,
    with the per-token loss (finalize_model_grads divides by the DP x CP token count) and with a
    CP-global mean loss (the schedules multiply it by the CP size, DDP averages over DP x CP)."""
    results = run_on_ranks(WORLD, cp_cases.check_training, pp, distopt, per_token)
    assert all(r["checked"] > 0 for r in results)
