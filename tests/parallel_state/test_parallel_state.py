"""parallel_state: group membership on up to 8 CPU ranks against an independent oracle, getters, errors."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_core import parallel_state as ps
from megatron_core.parallel_state import (
    ParallelConfigError,
    RankGenerator,
    generate_masked_orthogonal_rank_groups,
)
from megatron_core.process_groups_config import ProcessGroupCollection
from tests.dist_harness import run_on_ranks
from tests.parallel_state.rank_oracle import expected_groups

WORLD = 8

# (order, tp, pp, cp, ep, etp, vpp): at least six layouts mixing every axis and non-default orders.
LAYOUTS = [
    ("tp-cp-ep-dp-pp", 2, 2, 1, 1, 2, None),
    ("tp-cp-ep-dp-pp", 2, 1, 2, 1, 2, None),
    ("tp-cp-ep-dp-pp", 1, 2, 1, 2, 1, None),
    ("tp-cp-ep-dp-pp", 2, 2, 1, 2, 1, None),
    ("tp-cp-ep-dp-pp", 4, 2, 1, 1, 4, 2),
    ("tp-pp-dp", 2, 2, 1, 1, 2, None),
    ("tp-cp-ep-dp-pp", 2, 2, 2, 1, 2, None),
    ("tp-cp-ep-dp-pp", 1, 1, 1, 4, 2, None),
    ("tp-dp-pp", 2, 4, 1, 1, 2, 2),
    ("pp-tp-dp", 2, 2, 1, 1, 1, None),
]

_GETTERS = {
    "tp": ps.get_tensor_model_parallel_group,
    "pp": ps.get_pipeline_model_parallel_group,
    "dp": ps.get_data_parallel_group,
    "dp_cp": lambda: ps.get_data_parallel_group(with_context_parallel=True),
    "cp": ps.get_context_parallel_group,
    "mp": ps.get_model_parallel_group,
    "tp_dp": ps.get_tensor_and_data_parallel_group,
    "tp_dp_cp": lambda: ps.get_tensor_and_data_parallel_group(with_context_parallel=True),
    "tp_cp": ps.get_tensor_and_context_parallel_group,
    "ep": ps.get_expert_model_parallel_group,
    "expt_tp": ps.get_expert_tensor_parallel_group,
    "tp_ep": ps.get_expert_tensor_and_model_parallel_group,
    "tp_ep_pp": ps.get_expert_tensor_model_pipeline_parallel_group,
    "expt_dp": ps.get_expert_data_parallel_group,
    "embd": lambda: ps.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: ps.get_position_embedding_group(check_initialized=False),
}


def _observe_layouts(layouts):
    """On every rank: for each layout, the members of every group and the scalar getters."""
    observed = []
    for order, tp, pp, cp, ep, etp, vpp in layouts:
        ps.initialize_model_parallel(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
            expert_model_parallel_size=ep, expert_tensor_parallel_size=etp,
            virtual_pipeline_model_parallel_size=vpp, order=order, distributed_timeout_minutes=1,
        )
        groups = {name: get() for name, get in _GETTERS.items()}
        groups = {name: None if g is None else dist.get_process_group_ranks(g) for name, g in groups.items()}
        pgs = ProcessGroupCollection.use_mpu_process_groups()
        scalars = {
            "tp_rank": ps.get_tensor_model_parallel_rank(),
            "tp_size": ps.get_tensor_model_parallel_world_size(),
            "tp_src": ps.get_tensor_model_parallel_src_rank(),
            "pp_rank": ps.get_pipeline_model_parallel_rank(),
            "pp_size": ps.get_pipeline_model_parallel_world_size(),
            "pp_first": ps.get_pipeline_model_parallel_first_rank(),
            "pp_last": ps.get_pipeline_model_parallel_last_rank(),
            "pp_next": ps.get_pipeline_model_parallel_next_rank(),
            "pp_prev": ps.get_pipeline_model_parallel_prev_rank(),
            "dp_rank": ps.get_data_parallel_rank(),
            "dp_size": ps.get_data_parallel_world_size(),
            "dp_cp_size": ps.get_data_parallel_world_size(with_context_parallel=True),
            "dp_src": ps.get_data_parallel_src_rank(),
            "cp_rank": ps.get_context_parallel_rank(),
            "cp_size": ps.get_context_parallel_world_size(),
            "ep_rank": ps.get_expert_model_parallel_rank(),
            "ep_size": ps.get_expert_model_parallel_world_size(),
            "etp_size": ps.get_expert_tensor_parallel_world_size(),
            "edp_size": ps.get_expert_data_parallel_world_size(),
            "mp_src": ps.get_model_parallel_src_rank(),
            "first": ps.is_pipeline_first_stage(),
            "last": ps.is_pipeline_last_stage(),
            "in_embd": ps.is_rank_in_embedding_group(),
            "in_pos_embd": ps.is_rank_in_position_embedding_group(),
            "vpp": ps.get_virtual_pipeline_model_parallel_world_size(),
            "pgs_tp": dist.get_process_group_ranks(pgs.tp),
            "pgs_dp_cp": dist.get_process_group_ranks(pgs.dp_cp),
        }
        if vpp:
            scalars["first_by_vp"] = [ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=v) for v in range(vpp)]
            scalars["last_by_vp"] = [ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=v) for v in range(vpp)]
        observed.append((groups, scalars))
        ps.destroy_model_parallel()
    return dist.get_rank(), observed


def test_group_membership_matches_independent_oracle():
    for rank, observed in run_on_ranks(WORLD, _observe_layouts, LAYOUTS):
        for (order, tp, pp, cp, ep, etp, vpp), (groups, s) in zip(LAYOUTS, observed):
            layout = f"layout order={order} tp={tp} pp={pp} cp={cp} ep={ep} etp={etp} rank={rank}"
            want = expected_groups(rank, WORLD, order, tp, pp, cp, ep, etp)
            for name, members in want.items():
                if name in ("embd", "pos_embd") and rank not in members:
                    members = None  # ranks outside the embedding groups hold no such group
                assert groups[name] == members, f"{layout}: group {name} {groups[name]} != {members}"
            dp = WORLD // (tp * pp * cp)
            assert (s["tp_size"], s["pp_size"], s["cp_size"], s["dp_size"]) == (tp, pp, cp, dp), layout
            assert s["dp_cp_size"] == dp * cp and s["ep_size"] == ep and s["etp_size"] == etp, layout
            assert s["edp_size"] == WORLD // (etp * ep * pp), layout
            assert s["tp_rank"] == want["tp"].index(rank) and s["tp_src"] == want["tp"][0], layout
            assert s["pp_rank"] == want["pp"].index(rank), layout
            assert (s["pp_first"], s["pp_last"]) == (want["pp"][0], want["pp"][-1]), layout
            assert s["pp_next"] == want["pp"][(s["pp_rank"] + 1) % pp], layout
            assert s["pp_prev"] == want["pp"][(s["pp_rank"] - 1) % pp], layout
            assert s["dp_rank"] == want["dp"].index(rank) and s["dp_src"] == want["dp"][0], layout
            assert s["cp_rank"] == want["cp"].index(rank) and s["ep_rank"] == want["ep"].index(rank), layout
            assert s["mp_src"] == want["mp"][0], layout
            assert s["first"] == (s["pp_rank"] == 0) and s["last"] == (s["pp_rank"] == pp - 1), layout
            assert s["in_embd"] == (rank in want["embd"]) and s["in_pos_embd"] == (rank in want["pos_embd"]), layout
            assert s["pgs_tp"] == want["tp"] and s["pgs_dp_cp"] == want["dp_cp"], layout
            assert s["vpp"] == vpp, layout
            if vpp:
                assert s["first_by_vp"] == [s["pp_rank"] == 0 and v == 0 for v in range(vpp)], layout
                assert s["last_by_vp"] == [s["pp_rank"] == pp - 1 and v == vpp - 1 for v in range(vpp)], layout


def test_megatron_documented_example_16_ranks():
    """Megatron's docstring: 16 ranks, TP=2, PP=4 -> TP [0,1],[2,3].., DP [0,2],[1,3],[4,6].., PP [0,4,8,12].."""
    gen = RankGenerator(tp=2, ep=1, dp=2, pp=4, cp=1, order="tp-cp-ep-dp-pp")
    assert gen.get_ranks("tp") == [[2 * i, 2 * i + 1] for i in range(8)]
    assert gen.get_ranks("dp") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert gen.get_ranks("pp") == [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]
    for name, axes in {"tp": "tp", "dp": "dp", "pp": "pp", "mp": "tp-pp", "tp_dp": "tp-dp"}.items():
        for rank in range(16):
            want = expected_groups(rank, 16, "tp-cp-ep-dp-pp", 2, 4, 1, 1, 2)[name]
            assert want in gen.get_ranks(axes), (name, rank)


def test_masked_groups_cover_world_once():
    groups = generate_masked_orthogonal_rank_groups(24, [2, 3, 4], [True, False, True])
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(24)) and all(len(g) == 8 for g in groups)


def _invalid_layouts():
    messages = {}
    cases = {
        "not_divisible": dict(tensor_model_parallel_size=3),
        "below_one": dict(pipeline_model_parallel_size=0),
        "vpp_without_pp": dict(virtual_pipeline_model_parallel_size=2),
        "axis_missing": dict(context_parallel_size=2, order="tp-dp-pp"),
        "expert_not_divisible": dict(expert_model_parallel_size=3),
    }
    for name, kwargs in cases.items():
        try:
            ps.initialize_model_parallel(**kwargs)
            messages[name] = None
        except ParallelConfigError as error:
            messages[name] = str(error)
        assert not ps.model_parallel_is_initialized()
    return messages


def test_invalid_sizes_name_the_numbers():
    messages = run_on_ranks(WORLD, _invalid_layouts)[0]
    assert "world_size (8)" in messages["not_divisible"] and "(3)" in messages["not_divisible"]
    assert "pipeline_model_parallel_size" in messages["below_one"] and "0" in messages["below_one"]
    assert "virtual_pipeline_model_parallel_size (2)" in messages["vpp_without_pp"]
    assert "got 1" in messages["vpp_without_pp"]
    assert "cp size is 2" in messages["axis_missing"] and "tp-dp-pp" in messages["axis_missing"]
    assert "expert_model_parallel_size (3)" in messages["expert_not_divisible"]


def test_errors_are_runtime_and_value_errors():
    with pytest.raises(RuntimeError):
        RankGenerator(tp=2, ep=1, dp=1, pp=1, cp=2, order="tp-dp-pp")
    with pytest.raises(ValueError, match="order"):
        RankGenerator(tp=1, ep=1, dp=1, pp=1, cp=1, order="tp-xx")


def test_uninitialized_getters_default_to_single_process():
    assert not ps.model_parallel_is_initialized()
    assert ps.get_tensor_model_parallel_world_size() == 1
    assert ps.get_pipeline_model_parallel_rank() == 0
    assert ps.is_pipeline_first_stage() and ps.is_pipeline_last_stage()
    with pytest.raises(RuntimeError, match="initialize_model_parallel"):
        ps.get_tensor_model_parallel_group()
