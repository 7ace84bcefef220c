"""The pipeline schedules' point-to-point traffic is safe on NCCL, checked on gloo by replaying it.

Gloo buffers sends and matches messages by tag, so a schedule whose ranks post their operations in an order
NCCL cannot serve still passes every CPU test. Each rank here records the operations it posts (exchange,
peer, send or receive, tag); the test then replays the four ranks' records under NCCL's rules: operations
on one stream run one after another, a send completes only together with the matching receive, the k-th
message from one rank to another matches the k-th receive posted for it, and a batched exchange
(``batch_isend_irecv``) runs its operations together. Replayed with one stream per pair of ranks and with one
stream per rank (the stricter), every message must complete and carry the tag its receiver expects
(an activation where an activation is awaited).
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist

from megatron_core import parallel_state
from megatron_core.pipeline_parallel import get_forward_backward_func, p2p_communication
from tests.dist_harness import run_on_ranks
from tests.pipeline_parallel import toy_model
from tests.pipeline_parallel.toy_model import ToyConfig, ToyStage, make_batches, stage_layer_ids

WORLD = 4


def _record(pp: int, vpp: int | None, num_microbatches: int, options: dict) -> list[tuple]:
    """Run the schedule once, returning ``(exchange, peer, is_send, tag, batched)`` per operation, in the order
    the rank posted them to ``torch.distributed`` (``isend``/``irecv`` alone, or ``batch_isend_irecv``)."""
    parallel_state.initialize_model_parallel(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    num_chunks = vpp or 1
    config = ToyConfig(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                       pipeline_dtype=torch.float32, **options)
    chunks = [ToyStage(config, stage_layer_ids(pp_rank, pp, c, num_chunks), pre_process=pp_rank == 0 and c == 0)
              for c in range(num_chunks)]
    batches = make_batches(num_microbatches, seed=3)
    log: list[tuple] = []

    def single(is_send: bool):
        def post(tensor, peer, group=None, tag=0):
            log.append((len(log), peer, is_send, tag, False))
            return (dist.isend if is_send else dist.irecv)(tensor, peer, group=group, tag=tag)
        return post

    send, recv = single(True), single(False)

    def batch(p2p_ops):
        exchange = len(log)
        log.extend((exchange, op.peer, op.op is dist.isend, op.tag, True) for op in p2p_ops)
        return dist.batch_isend_irecv(p2p_ops)

    def p2p_op(op, *args):
        return dist.P2POp(dist.isend if op is send else dist.irecv, *args)

    # The module's view of torch.distributed, with its sends and receives recorded.
    recorded = types.SimpleNamespace(**{**vars(dist), "isend": send, "irecv": recv, "batch_isend_irecv": batch,
                                        "P2POp": p2p_op})
    p2p_communication.dist = recorded
    try:
        iterators = [iter(batches) for _ in chunks]
        get_forward_backward_func()(
            forward_step_func=toy_model.forward_step, data_iterator=iterators if vpp else iterators[0],
            model=chunks if vpp else chunks[0], num_microbatches=num_microbatches, seq_length=4, micro_batch_size=2,
        )
    finally:
        p2p_communication.dist = dist
    return log


def _groups(rank: int, log: list[tuple], per_pair: bool) -> dict[tuple, list[list[dict]]]:
    """Each stream's groups of operations: a batched exchange is one group, an unbatched operation its own."""
    streams: dict[tuple, list[list[dict]]] = {}
    counts: dict[tuple, int] = {}
    last_group: dict[tuple, tuple] = {}
    for index, (exchange, peer, is_send, tag, batched) in enumerate(log):
        direction = (rank, peer) if is_send else (peer, rank)
        k = counts.get(direction, 0)
        counts[direction] = k + 1
        op = {"rank": rank, "peer": peer, "send": is_send, "tag": tag, "key": (*direction, k), "done": False}
        stream = (rank, peer) if per_pair else (rank,)
        group_id = (exchange,) if batched else (exchange, index)
        groups = streams.setdefault(stream, [])
        if last_group.get(stream) == group_id:
            groups[-1].append(op)
        else:
            groups.append([op])
            last_group[stream] = group_id
    return streams


def _replay(logs: list[list[tuple]], per_pair: bool) -> None:
    streams: dict[tuple, list[list[dict]]] = {}
    for rank, log in enumerate(logs):
        streams.update(_groups(rank, log, per_pair))
    heads = {stream: 0 for stream in streams}

    def head_ops(rank: int) -> list[dict]:
        return [op for stream, groups in streams.items() if stream[0] == rank and heads[stream] < len(groups)
                for op in groups[heads[stream]]]

    progress = True
    while progress:
        progress = False
        for stream, groups in streams.items():
            if heads[stream] >= len(groups):
                continue
            for op in groups[heads[stream]]:
                if op["done"]:
                    continue
                partner = next((o for o in head_ops(op["peer"]) if not o["done"] and o["key"] == op["key"]
                                and o["send"] != op["send"] and o["peer"] == op["rank"]), None)
                if partner is None:
                    continue
                assert partner["tag"] == op["tag"], f"message {op['key']} sent with tag {op['tag'] if op['send'] else partner['tag']} " \
                                                    f"but received as tag {partner['tag'] if op['send'] else op['tag']}"
                op["done"] = partner["done"] = True
                progress = True
            if all(op["done"] for op in groups[heads[stream]]):
                heads[stream] += 1
                progress = True
    stuck = {stream: groups[heads[stream]] for stream, groups in streams.items() if heads[stream] < len(groups)}
    assert not stuck, "deadlock under NCCL's ordering: " + "; ".join(
        f"stream {stream} waits on {[(o['key'], 'send' if o['send'] else 'recv') for o in ops if not o['done']]}"
        for stream, ops in list(stuck.items())[:4])


CASES = {
    "1f1b_pp4": (4, None, 8, {}),
    "1f1b_pp4_unbatched": (4, None, 8, {"batch_p2p_comm": False}),
    "interleaved_pp4": (4, 2, 8, {}),
    "interleaved_pp4_unbatched": (4, 2, 8, {"batch_p2p_comm": False}),
    "interleaved_pp4_overlap": (4, 2, 8, {"overlap_p2p_comm": True, "batch_p2p_comm": False}),
    "interleaved_pp4_overlap_batched": (4, 2, 8, {"overlap_p2p_comm": True}),
    "interleaved_pp4_overlap_all_warmup": (4, 2, 4, {"overlap_p2p_comm": True, "batch_p2p_comm": False}),
    "interleaved_pp2_overlap": (2, 2, 4, {"overlap_p2p_comm": True, "batch_p2p_comm": False}),
    "interleaved_pp2_overlap_batched": (2, 2, 8, {"overlap_p2p_comm": True}),
    "interleaved_pp4_overlap_variable_lengths": (4, 2, 4, {"overlap_p2p_comm": True, "batch_p2p_comm": False,
                                                           "variable_seq_lengths": True}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_point_to_point_traffic_replays_under_nccl_ordering(case: str) -> None:
    pp, vpp, num_microbatches, options = CASES[case]
    logs = run_on_ranks(WORLD, _record, pp, vpp, num_microbatches, options)
    if pp < WORLD:  # PP=2 x DP=2: replay each pipeline (global ranks 0, 2 and 1, 3 under parallel_state's order)
        pipelines = {}
        for rank, log in enumerate(logs):
            peers = {entry[1] for entry in log}
            pipelines.setdefault(frozenset(peers | {rank}), []).append(rank)
        groups = [sorted(ranks) for ranks in pipelines.values()]
    else:
        groups = [list(range(WORLD))]
    assert sum(len(g) for g in groups) == WORLD and all(logs[r] for g in groups for r in g)
    for per_pair in (True, False):
        for ranks in groups:
            renumber = {rank: i for i, rank in enumerate(ranks)}
            _replay([[(e, renumber[p], s, t, b) for e, p, s, t, b in logs[r]] for r in ranks], per_pair)


def test_replay_finds_a_deadlock_and_a_swapped_message() -> None:
    # Two ranks that both send first on one stream, unbatched: each send waits for a receive posted behind the
    # other's send (what posting every exchange in one fixed order would do between two stages).
    both_send_first = [[(0, 1, True, 0, False), (0, 1, False, 0, False)],
                       [(0, 0, True, 0, False), (0, 0, False, 0, False)]]
    with pytest.raises(AssertionError, match="deadlock"):
        _replay(both_send_first, per_pair=True)
    # Batched, the same operations run together and complete.
    _replay([[(0, 1, True, 0, True), (0, 1, False, 0, True)], [(0, 0, True, 0, True), (0, 0, False, 0, True)]],
            per_pair=True)
    # An activation (tag 0) sent where the receiver posted its gradient receive (tag 1) first.
    swapped = [[(0, 1, True, 0, False), (1, 1, True, 1, False)], [(0, 0, False, 1, False), (1, 0, False, 0, False)]]
    with pytest.raises(AssertionError, match="received as tag"):
        _replay(swapped, per_pair=True)
    # Odd stages receiving first: the parity order completes.
    _replay([[(0, 1, True, 0, False), (0, 1, False, 0, False)], [(0, 0, False, 0, False), (0, 0, True, 0, False)]],
            per_pair=False)
