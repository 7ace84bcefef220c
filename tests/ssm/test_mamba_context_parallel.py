"""Context and sequence parallelism of the Mamba mixer, against one process (CPU ranks, gloo).

A hybrid model (Mamba, attention, Mamba, MLP) at TP x CP (x SP) matches the single-process model on the same
weights and tokens: logits, per-token loss and every gradient (fp32, 1e-5). The all-to-alls of
:mod:`megatron_core.ssm.mamba_context_parallel` are checked against the global tensor, and the splits the CP
group cannot take raise ``ValueError`` naming the rule.
"""

from __future__ import annotations

import pytest

from tests.dist_harness import run_on_ranks
from tests.ssm import mamba_cp_checks


@pytest.mark.parametrize("tp,cp,sp", [(1, 2, False), (2, 1, True), (2, 2, False), (2, 2, True)],
                         ids=["cp2", "tp2-sp", "tp2-cp2", "tp2-cp2-sp"])
def test_hybrid_model_matches_one_process(tp: int, cp: int, sp: bool) -> None:
    results = run_on_ranks(tp * cp, mamba_cp_checks.check_hybrid_parallel, tp, cp, sp)
    n_params = results[0]["grads"]
    assert n_params > 20 and all(r["grads"] == n_params and r["mamba_layers"] == 2 for r in results)
    # 8 Mamba heads in 2 groups: with TP=2 and CP=2 each CP rank scans 2 heads of a group it shares.
    assert {r["heads_here"] for r in results} == {8 // (tp * cp)}
    assert {r["group_repeat"] for r in results} == {2 if tp * cp == 4 else 1}


@pytest.mark.parametrize("cp", [2, 4])
def test_all_to_all_round_trip(cp: int) -> None:
    assert sorted(run_on_ranks(cp, mamba_cp_checks.check_all_to_all, cp)) == list(range(cp))


@pytest.mark.parametrize("cp,ngroups,repeat", [(2, 2, 1), (4, 2, 2), (4, 1, 4)])
def test_pre_conv_ssm_slices(cp: int, ngroups: int, repeat: int) -> None:
    results = run_on_ranks(cp, mamba_cp_checks.check_pre_conv_ssm, cp, ngroups)
    assert [r["rank"] for r in results] == list(range(cp))
    assert {r["group_repeat"] for r in results} == {repeat}


def test_bad_configs_raise() -> None:
    messages = run_on_ranks(4, mamba_cp_checks.check_bad_configs, 4)[0]
    no_group, heads, groups, fewer_groups, length = messages
    assert "context_parallel_size is 2" in no_group and "no group is set up" in no_group
    assert "(5)" in heads and "tensor_model_parallel_size * context_parallel_size" in heads
    assert "(5)" in groups and "mamba_num_groups" in groups
    assert "context-parallel size (4)" in fewer_groups and "groups of a tensor-parallel rank (3)" in fewer_groups
    assert "sequence length (12)" in length and "2 * context_parallel_size (8)" in length
