"""Distributed Megatron-Core names on gloo ranks: HyperCommGrid against parallel_state, the TP batch
broadcast, parameter-hash checks, StragglerDetector and Timers reports, pipeline-stage predicates,
parallel_state's extra group helpers and the fully parallel load."""

from __future__ import annotations

import logging
import time
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

from megatron_core import _straggler, parallel_state, timers, utils
from megatron_core.dist_checkpointing import load, save
from megatron_core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks
from megatron_core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper
from megatron_core.dist_checkpointing.strategies.torch_dist import TorchDistLoadShardedStrategy
from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.pipeline_parallel import utils as pp_utils
from tests.dist_checkpointing.sharded_fixtures import assert_same, build_state_dict, expected_state_dict
from tests.dist_harness import run_on_ranks

_PS_GETTERS = {
    "tp": parallel_state.get_tensor_model_parallel_group,
    "pp": parallel_state.get_pipeline_model_parallel_group,
    "dp": parallel_state.get_data_parallel_group,
    "cp": parallel_state.get_context_parallel_group,
    ("cp", "dp"): lambda: parallel_state.get_data_parallel_group(with_context_parallel=True),
    ("tp", "pp"): parallel_state.get_model_parallel_group,
    ("tp", "cp"): parallel_state.get_tensor_and_context_parallel_group,
}


def _grid_matches_parallel_state(order, tp, cp, pp):
    world = dist.get_world_size()
    dp = world // (tp * cp * pp)
    names = order.split("-")
    sizes = {"tp": tp, "cp": cp, "pp": pp, "dp": dp}
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             context_parallel_size=cp, order=order + "-ep" if "ep" not in order
                                             else order)
    grid = HyperCommGrid([sizes[n] for n in names], names)
    out = {}
    for dims, getter in _PS_GETTERS.items():
        pg = grid.create_pg(list(dims) if isinstance(dims, tuple) else dims)
        ours = dist.get_process_group_ranks(pg)
        theirs = dist.get_process_group_ranks(getter())
        out[str(dims)] = (ours, theirs)
        assert grid.get_pg(list(dims) if isinstance(dims, tuple) else dims) is pg
    try:
        grid.create_pg("tp")
    except KeyError:
        out["recreate"] = "KeyError"
    assert grid.is_current_rank_in_grid()
    grid.destroy()
    return out


def test_hyper_comm_grid_groups_equal_parallel_state():
    for order, tp, cp, pp in (("tp-cp-dp-pp", 2, 1, 2), ("tp-pp-cp-dp", 2, 2, 1)):
        per_rank = run_on_ranks(4, _grid_matches_parallel_state, order, tp, cp, pp)
        for rank, result in enumerate(per_rank):
            assert result.pop("recreate") == "KeyError"
            for dims, (ours, theirs) in result.items():
                assert ours == theirs, (order, rank, dims, ours, theirs)


def test_hyper_comm_grid_enumeration_and_views(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    grid = HyperCommGrid([2, 2, 2], ["a", "b", "c"])
    assert grid.get_rank_enum(["a", "b"]) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.get_rank_enum("b") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.get_rank_enum(["b", "a"]) == grid.get_rank_enum(["a", "b"])
    assert grid.get_rank_enum("c") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    grid.register_view("flat", [4, 2], ["ab", "c"], shared_dims=["c"])
    assert grid.get_rank_enum("ab", view="flat") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    try:
        grid.register_view("bad", [2, 4], ["x", "c"], shared_dims=["c"])
    except ValueError as e:
        assert "group ranks" in str(e)
    else:
        raise AssertionError("a view whose shared dim differs from the base grid was accepted")
    for bad in (([2, 2], ["a"]), ([2, 0], ["a", "b"]), ([4, 4], ["a", "b"])):
        try:
            HyperCommGrid(*bad)
        except (ValueError, RuntimeError):
            pass
        else:
            raise AssertionError(f"HyperCommGrid{bad} was accepted")
    try:
        grid.get_pg("a")
    except KeyError as e:
        assert "create_pg" in str(e)


def _broadcast_batch(stage):
    parallel_state.initialize_model_parallel(2, 1)
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    mbs, seq = 2, 4
    batch = {}
    if tp_rank == 0:
        g = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())
        batch = {
            "tokens": torch.randint(0, 50, (mbs, seq), generator=g),
            "labels": torch.randint(0, 50, (mbs, seq), generator=g),
            "loss_mask": torch.rand(mbs, seq, generator=g),
            "position_ids": torch.arange(seq).repeat(mbs, 1),
            "attention_mask": torch.rand(mbs, 1, seq, seq, generator=g) > 0.5,
            "cu_seqlens": torch.tensor([[0, 2, 4], [0, 1, 4]], dtype=torch.int32),
            "max_seqlen": torch.tensor([2, 3], dtype=torch.int32),
        }
    pp_size, first, last = {"all": (1, True, True), "first": (2, True, False), "last": (2, False, True)}[stage]
    out = utils.get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=True, is_hybrid_cp=False, create_attention_mask_in_dataloader=True,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(), cp_size=1, tp_rank=tp_rank,
        micro_batch_size=mbs, seq_length=seq, mtp_on_this_rank=False, pipeline_model_parallel_size=pp_size,
        is_pipeline_first_stage=first, is_pipeline_last_stage=last)
    return {k: (v.reshape(-1).tolist() if isinstance(v, torch.Tensor) else v) for k, v in out.items()
            if k in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen")}


def test_get_batch_on_this_tp_rank():
    for stage, present in (("all", {"tokens", "labels", "loss_mask", "position_ids"}),
                           ("first", {"tokens", "position_ids"}), ("last", {"labels", "loss_mask"})):
        results = run_on_ranks(4, _broadcast_batch, stage)
        for src, dst in ((0, 1), (2, 3)):  # TP pairs
            assert results[src] == results[dst], stage
        assert results[0] != results[2]  # DP ranks hold different data
        for key in ("tokens", "labels", "loss_mask", "position_ids"):
            assert (results[1][key] is not None) == (key in present), (stage, key)
        assert results[1]["cu_seqlens"] == [0, 2, 4, 0, 1, 4] and results[1]["max_seqlen"] == [2, 3]


def _param_hashes(perturb_rank):
    parallel_state.initialize_model_parallel(1, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
    model[1].weight.allreduce = False  # an "expert" parameter: checked over the expert DP group
    if dist.get_rank() == perturb_rank:
        with torch.no_grad():
            model[1].weight[0, 0] += 1e-3
    return (utils.check_param_hashes_across_dp_replicas([model]),
            utils.check_param_hashes_across_dp_replicas([model], cross_check=True))


def test_check_param_hashes_across_dp_replicas():
    assert run_on_ranks(2, _param_hashes, -1) == [(True, True), (True, True)]
    assert run_on_ranks(2, _param_hashes, 1) == [(True, False), (False, False)]


def _straggler_two_ranks():
    warnings.simplefilter("ignore")
    _straggler.StragglerDetector._configured = False
    if "_instance" in _straggler.StragglerDetector.__dict__:
        del _straggler.StragglerDetector._instance
    detector = _straggler.StragglerDetector()
    rank = dist.get_rank()
    detector.configure(world=2, rank=rank, mmcnt=1, enabled=True)
    with detector:
        time.sleep(0.01 if rank == 0 else 0.12)
    records = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger("megatron_core._straggler").addHandler(handler)
    logging.getLogger("megatron_core._straggler").setLevel(logging.INFO)
    try:
        reported = detector.report(total_flops=1e9, log_interval=1)
        if rank == 0:
            detector.toggle = True
        detector.report(total_flops=1e9, log_interval=1)
    finally:
        logging.getLogger("megatron_core._straggler").removeHandler(handler)
    return reported, records, detector.enabled


def test_straggler_detector_finds_the_slow_rank():
    (rep0, logs0, on0), (rep1, logs1, on1) = run_on_ranks(2, _straggler_two_ranks)
    assert rep0 and not rep1 and not logs1
    line = logs0[0]
    slowest = line.split("MxRtt/Rnk: ")[1].split(" |")[0]
    fastest = line.split("MnRtt/Rnk: ")[1].split(" |")[0]
    assert slowest.endswith("ms/1") and fastest.endswith("ms/0"), line
    assert float(slowest.split("ms")[0]) > 100 > float(fastest.split("ms")[0])
    assert not on0 and not on1  # rank 0's toggle reached rank 1


def _timers_two_ranks(option):
    t = timers.Timers(log_level=2, log_option=option)
    t("step").set_elapsed(0.1 * (dist.get_rank() + 1))
    return t.get_all_timers_string(["step"], reset=False), t._get_global_min_max_time(["step"], False, False, 1.0)


def test_timers_report_across_ranks():
    (text, extremes), _ = run_on_ranks(2, _timers_two_ranks, "minmax")
    assert extremes == {"step": (0.1, 0.2)}
    assert "(100.00, 200.00)" in text
    (text, _), _ = run_on_ranks(2, _timers_two_ranks, "max")
    assert text.rstrip().endswith("200.00")
    (text, _), _ = run_on_ranks(2, _timers_two_ranks, "all")
    assert "rank  0: 100.00" in text and "rank  1: 200.00" in text


def _pp_predicates():
    parallel_state.initialize_model_parallel(1, 2)
    pp = parallel_state.get_pipeline_model_parallel_group()
    return (pp_utils.is_pp_first_stage(pp), pp_utils.is_pp_last_stage(pp), pp_utils.get_pp_first_rank(pp),
            pp_utils.get_pp_last_rank(pp), pp_utils.get_pp_next_rank(pp), pp_utils.get_pp_prev_rank(pp),
            parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage())


def test_pipeline_stage_predicates_on_groups():
    r0, r1 = run_on_ranks(2, _pp_predicates)
    assert r0 == (True, False, 0, 1, 1, None, True, False)
    assert r1 == (False, True, 0, 1, None, 0, False, True)


def _extra_groups():
    parallel_state.initialize_model_parallel(1, 1)
    dp_ag, expt_ag = parallel_state.create_all_gather_groups(for_expert_parallelism=True)
    same = (dist.get_process_group_ranks(dp_ag) == dist.get_process_group_ranks(parallel_state.get_data_parallel_group(
        with_context_parallel=True)) and dp_ag is not parallel_state.get_data_parallel_group(with_context_parallel=True))
    t = torch.ones(1)
    dist.all_reduce(t, group=dp_ag)
    group = parallel_state.create_group([0, 1])
    parallel_state.update_pg_timeout(timedelta(seconds=90))
    parallel_state.update_pg_timeout(timedelta(seconds=60), group)
    parallel_state.destroy_global_memory_buffer()
    try:
        parallel_state.get_global_memory_buffer()
        buffer_gone = False
    except RuntimeError:
        buffer_gone = True
    dist.destroy_process_group(group)
    return same, expt_ag is not None, t.item(), buffer_gone


def test_parallel_state_extra_group_helpers():
    assert run_on_ranks(2, _extra_groups) == [(True, True, 2.0, True)] * 2


class _CountingLoad(TorchDistLoadShardedStrategy):
    """Counts the tensor shards this rank reads from storage."""

    read = 0

    def load(self, sharded_state_dict, checkpoint_dir):
        from megatron_core.dist_checkpointing.dict_utils import nested_values
        from megatron_core.dist_checkpointing.mapping import ShardedTensor

        _CountingLoad.read += sum(isinstance(x, ShardedTensor) for x in nested_values(sharded_state_dict))
        return super().load(sharded_state_dict, checkpoint_dir)


def _fully_parallel_load(ckpt_dir):
    parallel_state.initialize_model_parallel(2, 1)  # 4 ranks: TP=2 x DP=2, DP replicas share shards
    save(build_state_dict(), ckpt_dir)
    _CountingLoad.read = 0
    plain = load(build_state_dict(empty=True), ckpt_dir, _CountingLoad())
    plain_reads = _CountingLoad.read
    _CountingLoad.read = 0
    wrapper = FullyParallelLoadStrategyWrapper(_CountingLoad(), parallel_state.get_data_parallel_group(),
                                               do_cache_distribution=True)
    fast = load(build_state_dict(empty=True), ckpt_dir, wrapper)
    fast_reads = _CountingLoad.read
    again = load(build_state_dict(empty=True), ckpt_dir, wrapper)
    expected = expected_state_dict()
    assert_same(plain, expected)
    assert_same(fast, expected)
    assert_same(again, expected)
    return plain_reads, fast_reads


def test_fully_parallel_load_reads_each_shard_once_per_group(tmp_path):
    counts = run_on_ranks(4, _fully_parallel_load, str(tmp_path / "ckpt"))
    for plain_reads, fast_reads in counts:
        assert fast_reads < plain_reads
    # the two DP replicas of each TP rank split the reads between them
    assert counts[0][1] + counts[2][1] == counts[0][0] and counts[1][1] + counts[3][1] == counts[1][0]


def test_distribute_shards_balances_bytes():
    a, b, c = ("a", (0,), None), ("b", (0,), None), ("c", (0,), None)
    sizes = {a: 400, b: 400, c: 200}
    assignment = distribute_shards_to_ranks({a: [0, 1], b: [0, 1], c: [0, 1]}, sizes, 2, set())
    assert sorted(assignment.values()) == [0, 0, 1] or sorted(assignment.values()) == [0, 1, 1]
    assert assignment[a] != assignment[b]
    assert distribute_shards_to_ranks({a: [0], b: [1]}, {a: 4, b: 4}, 2, set()) == {a: 0, b: 1}
