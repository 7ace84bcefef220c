"""``inference.shards``: an inference model's groups at another parallel layout, and one set per shard of a
multi-shard layout.

On 4 gloo ranks the collection built for a layout must hold, role by role, the same ranks as ``parallel_state``
initialised at that layout (``ProcessGroupCollection.use_mpu_process_groups``), and a window of ranks must get
groups inside the window only.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.inference.shards import (
    build_inference_pg_collection,
    build_inference_pg_collections_for_shards,
)
from megatron_core.process_groups_config import ProcessGroupCollection
from tests.dist_harness import run_on_ranks

WORLD = 4
ROLES = ["tp", "cp", "pp", "dp", "mp", "tp_cp", "dp_cp", "tp_dp_cp", "ep", "expt_tp", "expt_dp", "tp_ep", "tp_ep_pp",
         "embd", "pos_embd"]


def _ranks(group) -> list[int] | None:
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    return sorted(dist.get_process_group_ranks(group))


def _both(sizes: dict, order: str) -> dict[str, tuple]:
    """Per role: (ranks in the built collection, ranks in parallel_state's) on this rank."""
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=sizes["tp"], pipeline_model_parallel_size=sizes["pp"],
        context_parallel_size=sizes["cp"], expert_model_parallel_size=sizes["ep"],
        expert_tensor_parallel_size=sizes["expt_tp"], order=order)
    reference = ProcessGroupCollection.use_mpu_process_groups()
    tp_pp_dp = order.endswith("pp-dp")
    built = build_inference_pg_collection(WORLD, sizes["tp"], sizes["pp"], sizes["cp"], sizes["ep"], sizes["expt_tp"],
                                          use_tp_pp_dp_mapping=tp_pp_dp)
    defaults = build_inference_pg_collection(WORLD, use_tp_pp_dp_mapping=tp_pp_dp)  # sizes from parallel_state
    return {role: (_ranks(getattr(built, role)), _ranks(getattr(reference, role)), _ranks(getattr(defaults, role)))
            for role in ROLES}


@pytest.mark.parametrize("sizes, order", [
    (dict(tp=2, pp=2, cp=1, ep=1, expt_tp=2), "tp-cp-ep-dp-pp"),
    (dict(tp=1, pp=1, cp=2, ep=2, expt_tp=1), "tp-cp-ep-dp-pp"),
    (dict(tp=2, pp=1, cp=1, ep=2, expt_tp=1), "tp-cp-ep-dp-pp"),
    (dict(tp=1, pp=2, cp=1, ep=1, expt_tp=1), "tp-cp-ep-pp-dp"),
], ids=["tp2_pp2", "cp2_ep2", "tp2_ep2_etp1", "pp2_tp_pp_dp_order"])
def test_groups_match_parallel_state_at_the_same_layout(sizes, order):
    for rank, per_role in enumerate(run_on_ranks(WORLD, _both, sizes, order)):
        for role, (built, reference, defaults) in per_role.items():
            assert built == reference, f"rank {rank} {role}: built {built}, parallel_state {reference}"
            assert defaults == reference, f"rank {rank} {role} with sizes from parallel_state: {defaults}"


def _window() -> dict[str, list[int] | None]:
    parallel_state.initialize_model_parallel()
    built = build_inference_pg_collection(2, tp_size=2, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=1,
                                          rank_offset=2)
    return {role: _ranks(getattr(built, role)) for role in ("tp", "dp", "pp", "embd", "ep")}


def test_a_window_of_ranks_gets_groups_inside_it_only():
    per_rank = run_on_ranks(WORLD, _window)
    for rank in (0, 1):
        assert per_rank[rank] == {"tp": None, "dp": None, "pp": None, "embd": None, "ep": None}, per_rank[rank]
    for rank in (2, 3):
        assert per_rank[rank] == {"tp": [2, 3], "dp": [rank], "pp": [rank], "embd": [rank], "ep": [rank]}


def _bad(world_size: int, sizes: dict) -> str:
    parallel_state.initialize_model_parallel()
    try:
        build_inference_pg_collection(world_size, **sizes)
    except ValueError as error:
        return str(error)
    return "no error"


def test_sizes_that_do_not_divide_are_named():
    message = run_on_ranks(WORLD, _bad, 3, dict(tp_size=2, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=1))[0]
    assert message == "build_inference_pg_collection: world_size 3 is not divisible by the dense layers' tp 2 x cp 1 x " \
                      "pp 1 = 2"
    message = run_on_ranks(WORLD, _bad, 4, dict(tp_size=1, pp_size=1, cp_size=1, ep_size=3, expt_tp_size=1))[0]
    assert "expert layers' expt_tp 1 x ep 3 x pp 1 = 3" in message



def _shards(spec: str) -> list[tuple]:
    shards = build_inference_pg_collections_for_shards(WORLD, spec)
    return [(s.spec.role, s.rank_offset, s.world_size, None if s.pg_collection is None else
             {role: _ranks(getattr(s.pg_collection, role)) for role in ("tp", "pp", "dp", "ep", "expt_tp")})
            for s in shards]


def test_shards_take_consecutive_windows_and_each_rank_gets_its_own_groups():
    """``tp=2,role=prefill+tp=1,dp=2,role=decode`` on 4 ranks: ranks 0-1 a TP=2 prefill shard, ranks 2-3 two
    TP=1 data-parallel decode replicas; each rank's groups only for its own shard."""
    per_rank = run_on_ranks(WORLD, _shards, "tp=2,role=prefill+tp=1,dp=2,role=decode")
    for rank, shards in enumerate(per_rank):
        (role0, offset0, size0, mine0), (role1, offset1, size1, mine1) = shards
        assert (role0, offset0, size0, role1, offset1, size1) == ("prefill", 0, 2, "decode", 2, 2)
        if rank < 2:
            assert mine1 is None
            assert mine0 == {"tp": [0, 1], "pp": [rank], "dp": [rank], "ep": [rank], "expt_tp": [0, 1]}
        else:
            assert mine0 is None
            assert mine1 == {"tp": [rank], "pp": [rank], "dp": [2, 3], "ep": [rank], "expt_tp": [rank]}


def test_shards_refuse_a_layout_that_does_not_use_every_rank():
    with pytest.raises(ValueError, match=r"the shards use 2 \+ 1 = 3 ranks but world_size is 4"):
        build_inference_pg_collections_for_shards(WORLD, "tp=2+tp=1")
