"""CUDA-graph batch dimensions (``inference.batch_dimensions_utils``): lists worked out by hand from the rules,
matching, errors, the expert-parallel adjustment on 2 gloo ranks, and (with ``MCORE019_PATH``) Megatron-Core 0.19."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
import torch

from megatron_core.inference.batch_dimensions_utils import (
    CUDAGraphBatchDimensionBuilder,
    InferenceBatchDimensions,
)
from megatron_core.inference.config import CudaGraphSizingDistribution
from megatron_core.inference.contexts.decode_graph_inputs import graph_batch_sizes
from tests.dist_harness import run_on_ranks

Dims = InferenceBatchDimensions
EXP, LIN = CudaGraphSizingDistribution.EXPONENTIAL, CudaGraphSizingDistribution.LINEAR
ORACLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore019_batch_dims_oracle.py")


def generate(tp: int = 1, n: int | None = -1, graph_tokens: int | None = 512, mixed: int | None = None,
             max_requests: int = 8, max_tokens: int = 512, max_seq: int = 2560, non_decode: bool = False,
             spec: int = 0, dist: CudaGraphSizingDistribution | str | None = EXP):
    return CUDAGraphBatchDimensionBuilder.generate_cuda_graph_batch_dimensions_list(
        tp, n, graph_tokens, mixed, max_requests, max_tokens, max_seq, non_decode, spec, dist)


def tuples(dims: list[Dims]) -> list[tuple[int, int, int]]:
    return [(d.token_count, d.prefill_req_count, d.decode_req_count) for d in dims]


def test_dimensions_order_hash_str_and_request_count() -> None:
    dims = Dims(token_count=8, prefill_req_count=1, decode_req_count=3)
    assert str(dims) == "[8]: 1 P + 3 D" and dims.req_count == 4
    assert Dims(8, 0, 9) < Dims(8, 1, 0) < Dims(8, 1, 2) < Dims(9, 0, 0)  # tokens, then prefills, then decodes
    assert {Dims(4, 1, 2): "a"}[Dims(4, 1, 2)] == "a" and hash(Dims(4, 1, 2)) == hash((4, 1, 2))
    assert Dims(4, 1, 2) != Dims(4, 2, 1) and Dims() == Dims(0, 0, 0) and Dims() != None  # noqa: E711


def test_is_valid_bounds_the_tokens_by_the_requests() -> None:
    # max_requests 4, max_sequence_length 8, one speculative token (2 rows per decode request).
    def valid(t, p, d):
        return Dims(t, p, d).is_valid(4, 8, 1)
    assert valid(2, 0, 1) and valid(5, 1, 2) and valid(8 + 4, 1, 2)        # 1 + 2*2 <= t <= 8 + 2*2
    assert not valid(4, 1, 2) and not valid(13, 1, 2)
    assert not valid(0, 0, 0) and not valid(10, 3, 2) and not valid(3, -1, 2)


def test_applicability_rules() -> None:
    decode_graph, mixed_graph = Dims(8, 0, 8), Dims(8, 2, 2)
    assert decode_graph.is_applicable_for_batch_dim(Dims(5, 0, 5))
    assert not mixed_graph.is_applicable_for_batch_dim(Dims(2, 0, 2))  # decode steps take decode-only graphs
    assert not decode_graph.is_applicable_for_batch_dim(Dims(9, 0, 8))
    # A step of 3 prefills and 1 decode: prefill slots may host the decode, unless strict.
    assert Dims(8, 4, 0).is_applicable_for_batch_dim(Dims(6, 3, 1))
    assert not Dims(8, 4, 0).is_applicable_for_batch_dim(Dims(6, 3, 1), strict=True)
    assert not mixed_graph.is_applicable_for_batch_dim(Dims(6, 3, 0))


def test_decode_only_exponential_auto_count() -> None:
    # decode bound 12: auto count max(4, log2(12) + 2) = 5; halving 12, 6, 3->2, 1->2, plus tp_size 1;
    # the floors 1 and 2 are there already.
    dims, tokens = generate(max_requests=12)
    assert tuples(dims) == [(12, 0, 12), (6, 0, 6), (2, 0, 2), (1, 0, 1)] and tokens == [12, 6, 2, 1]


def test_decode_only_exponential_fixed_count_and_tensor_parallel() -> None:
    # TP 2, 4 graphs, decode bound 40: 40, 20, 10, 5->4, plus tp_size 2 is 5 counts: 4 is dropped.
    dims, tokens = generate(tp=2, n=4, max_requests=40, max_tokens=1024)
    assert tuples(dims) == [(40, 0, 40), (20, 0, 20), (10, 0, 10), (2, 0, 2)] and tokens == [40, 20, 10, 2]
    # TP 4, auto, decode bound 10: top 8; halving gives 8, 4 (2 and 1 round up to 4); floors lcm(1, 4) = 4, 8.
    dims, _ = generate(tp=4, max_requests=10)
    assert tuples(dims) == [(8, 0, 8), (4, 0, 4)]
    assert CUDAGraphBatchDimensionBuilder.match_graph_config(Dims(9, 0, 9), dims) is None  # too many: eager


def test_decode_only_with_speculative_tokens() -> None:
    # 3 rows per request, decode bound 24, auto count 6: 24, 12, 6, 3->2, 1->2, tp 1; floor lcm(3, 1) = 3 added.
    # Counts 2 and 1 hold no request (0 tokens after rounding) and are dropped.
    dims, tokens = generate(max_requests=8, spec=2)
    assert tuples(dims) == [(24, 0, 8), (12, 0, 4), (6, 0, 2), (3, 0, 1)] and tokens == [24, 12, 6, 3]


def test_exponential_counts_example_and_trim() -> None:
    counts = CUDAGraphBatchDimensionBuilder._calculate_cuda_graph_token_counts
    assert counts(1, 8, 128) == [128, 64, 32, 16, 8, 4, 2, 1]
    assert counts(1, 3, 128) == [128, 64, 1]  # trimmed from the middle, tp_size kept
    assert counts(3, 1, 100) == [99]
    assert counts(1, -1, 16) == [16, 8, 4, 2, 1]


@pytest.fixture(scope="module")
def mixed_exponential() -> tuple[list[Dims], list[int] | None]:
    # graph tokens 16, max_requests 4, max_sequence_length 8. Prefill counts 16, 8, 4, 2, 1; decode counts 4, 2, 1.
    # Prefill options 1, 2, 4. Dropped by is_valid: (16, 1, 3) (16 > 1*8 + 3) and (2, 4, 0) (4 prefills > 2 tokens);
    # prefill-only shapes repeat (S, 4, 0) or (2, 2, 0); count 1 gives no prefill graph.
    return generate(graph_tokens=16, mixed=16, max_requests=4, max_tokens=64, max_seq=8, non_decode=True)


def test_mixed_exponential_list(mixed_exponential) -> None:
    dims, tokens = mixed_exponential
    assert tuples(dims) == [
        (16, 4, 0), (16, 2, 2), (8, 4, 0), (8, 2, 2), (8, 1, 3), (4, 4, 0), (4, 2, 2), (2, 2, 0), (4, 1, 3),
        (2, 1, 1), (4, 0, 4), (2, 0, 2), (1, 0, 1),
    ]
    assert tokens == [16, 8, 4, 2, 1]


def test_match_picks_the_smallest_fitting_graph(mixed_exponential) -> None:
    dims, _ = mixed_exponential
    match = CUDAGraphBatchDimensionBuilder.match_graph_config
    assert match(Dims(3, 0, 3), dims) == Dims(4, 0, 4)
    assert match(Dims(5, 1, 2), dims) == Dims(8, 1, 3) == match(Dims(5, 1, 2), dims, strict=True)
    assert match(Dims(2, 1, 1), dims) == Dims(2, 1, 1)
    assert match(Dims(4, 3, 1), dims) == Dims(4, 4, 0)
    assert match(Dims(4, 3, 1), dims, strict=True) is None
    assert match(Dims(20, 1, 0), dims) is None and match(Dims(5, 0, 5), dims) is None
    assert match(Dims(1, 0, 1), []) is None
    for real in (Dims(t, p, d) for t in range(1, 18) for p in range(3) for d in range(5) if p + d):
        for strict in (False, True):
            fits = [g for g in dims if g.is_applicable_for_batch_dim(real, strict)]
            assert match(real, dims, strict=strict) == (sorted(fits)[0] if fits else None)


def test_mixed_linear_fixed_prefill_count() -> None:
    # TP 2, 4 graphs, graph tokens 40: step 10 -> 40, 30, 20, 10; decode bound 8: step 2 -> 8, 6, 4, 2.
    # One prefill option: 3 prefills and min((S - 3) // 1, 8 - 3) = 5 decodes; prefill-only max(3, min(8, S)) = 8.
    dims, tokens = generate(tp=2, n=4, graph_tokens=40, mixed=3, max_tokens=64, max_seq=64, non_decode=True,
                            dist=LIN)
    assert tuples(dims) == [(40, 8, 0), (40, 3, 5), (30, 8, 0), (30, 3, 5), (20, 8, 0), (20, 3, 5), (10, 8, 0),
                            (10, 3, 5), (8, 0, 8), (6, 0, 6), (4, 0, 4), (2, 0, 2)]
    assert tokens == [40, 30, 20, 10, 8, 6, 4, 2]
    # The same settings without non-decode graphs keep only the decode-only shapes.
    decode_only, _ = generate(tp=2, n=4, graph_tokens=40, mixed=3, max_tokens=64, max_seq=64, dist=LIN)
    assert tuples(decode_only) == tuples(dims)[-4:]


def test_linear_auto_counts_equal_the_context_decode_sizes() -> None:
    # The one configuration where our context's decode graphs (one per padded request count) are 0.19's.
    for max_requests in (1, 2, 3, 5, 8, 40, 255, 256, 300, 517):
        dims, _ = generate(max_requests=max_requests, graph_tokens=None, max_tokens=1024, dist="linear")
        assert sorted(d.decode_req_count for d in dims) == graph_batch_sizes(max_requests, "linear")
        assert all(d.token_count == d.decode_req_count and d.prefill_req_count == 0 for d in dims)


def test_graph_count_clamps_and_no_graphs() -> None:
    assert generate(n=None, tp=0) == ([], None)  # no graphs asked: nothing is checked
    dims, tokens = generate(n=0)  # clamped to one graph: decode bound 8
    assert tuples(dims) == [(8, 0, 8)] and tokens == [8]
    # graph tokens above max_tokens (or <= 0) become max_tokens
    assert generate(n=1, graph_tokens=10_000, max_tokens=64, mixed=1, non_decode=True, max_seq=64)[1] == [64, 8]
    # no valid shape (TP 2 rounds the only decode graph of 1 request down to 0 tokens)
    assert generate(tp=2, n=1, max_requests=1) == ([], None)


def test_errors_name_the_fields() -> None:
    with pytest.raises(ValueError, match=r"cuda_graph_max_tokens \(16.*max_requests \(32\).*num_speculative_tokens"):
        generate(graph_tokens=16, max_requests=32, max_tokens=64)
    with pytest.raises(ValueError, match=r"cuda_graph_max_tokens \(64; at most max_tokens, 64\).* = 96"):
        generate(graph_tokens=512, max_requests=32, max_tokens=64, spec=2)
    with pytest.raises(ValueError, match=r"tp_size \(0\) must be >= 1"):
        generate(tp=0)
    with pytest.raises(ValueError, match=r"max_requests \(0\)"):
        generate(max_requests=0)
    with pytest.raises(ValueError, match=r"num_speculative_tokens \(-1\)"):
        generate(spec=-1)
    with pytest.raises(ValueError, match=r"sizing_distribution \('cubic'\).*'exponential', 'linear'"):
        generate(dist="cubic")
    with pytest.raises(ValueError, match=r"cuda_graph_max_tokens \(37\) must be a multiple of tp_size \(2\)"):
        generate(tp=2, graph_tokens=37, max_tokens=37, mixed=2, non_decode=True, dist=LIN)
    counts, linear = (CUDAGraphBatchDimensionBuilder._calculate_cuda_graph_token_counts,
                      CUDAGraphBatchDimensionBuilder._calculate_token_counts_linear)
    for fn in (counts, linear):
        with pytest.raises(ValueError, match=r"num_cuda_graphs \(0\) must be >= 1, or -1"):
            fn(1, 0, 64)
        with pytest.raises(ValueError, match=r"cuda_graph_max_tokens \(0\) must be > 0"):
            fn(1, 4, 0)


class _Communicator:
    """A stand-in for AsyncZMQCommunicator: the other rank holds ``other``."""

    def __init__(self, other: tuple[int, int]) -> None:
        self.other, self.calls = other, []

    def sync_all_reduce_max(self, *values: int) -> tuple[int, ...]:
        self.calls.append(values)
        return tuple(max(a, b) for a, b in zip(values, self.other))


class _Group:
    def size(self) -> int:
        return 2


def test_expert_parallel_adjustment_through_a_communicator(monkeypatch) -> None:
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    adjust = InferenceBatchDimensions.adjust_batch_dims_for_expert_parallelism
    communicator = _Communicator((6, 0))
    assert adjust(Dims(3, 0, 3), _Group(), communicator) == Dims(6, 0, 3) and communicator.calls == [(3, 0)]
    assert adjust(Dims(3, 0, 3), _Group(), _Communicator((6, 1))) is None  # the other rank prefills: eager
    assert adjust(Dims(9, 1, 3), None, communicator) == Dims(9, 1, 3)  # no group: unchanged, no exchange
    graphs = [Dims(8, 0, 8), Dims(4, 0, 4)]
    match = CUDAGraphBatchDimensionBuilder.match_graph_config
    assert match(Dims(3, 0, 3), graphs, ep_group=_Group(), ep_zmq_communicator=_Communicator((6, 0))) == graphs[0]
    assert match(Dims(3, 0, 3), graphs, ep_group=_Group(), ep_zmq_communicator=_Communicator((6, 0)),
                 match_ep_token_counts=False) == graphs[1]


def _match_over_two_ranks() -> list:
    group = torch.distributed.group.WORLD
    rank = torch.distributed.get_rank()
    graphs, _ = generate(max_requests=8)
    match = CUDAGraphBatchDimensionBuilder.match_graph_config
    decode_steps = match(Dims(3 + 2 * rank, 0, 3 + 2 * rank), graphs, ep_group=group)  # 3 and 5 decodes
    prefill_on_one = match(Dims(4, rank, 3), graphs + [Dims(8, 1, 7)], ep_group=group)
    return [decode_steps, prefill_on_one]


def test_expert_parallel_ranks_pick_graphs_of_one_token_count() -> None:
    assert run_on_ranks(2, _match_over_two_ranks) == [[Dims(8, 0, 8), None], [Dims(8, 0, 8), None]]


def _oracle_cases(count: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    cases = []
    for _ in range(count):
        max_requests = rng.choice([1, 2, 3, 5, 8, 12, 33, 40])
        spec = rng.choice([0, 0, 1, 3])
        max_tokens = rng.choice([max_requests * (spec + 1), 64, 256, 1024, 3000])
        args = [rng.choice([1, 1, 2, 3, 4, 8]), rng.choice([None, -1, -1, 0, 1, 2, 3, 5, 8, 40]),
                rng.choice([None, 0, 16, 40, 100, 512, 5000]), rng.choice([None, 0, 1, 3, 16]), max_requests,
                max_tokens, rng.choice([2, 3, 8, 64, 2560]), rng.random() < 0.7, spec,
                rng.choice(["exponential", "linear"])]
        real = [[rng.randint(1, min(max_tokens, 128)), rng.choice([0, 0, 1, 2, 5]), rng.randint(0, max_requests)]
                for _ in range(6)]
        cases.append({"args": args, "real": [r for r in real if r[1] + r[2] > 0]})
    return cases


@pytest.mark.skipif(not os.environ.get("MCORE019_PATH"), reason="needs MCORE019_PATH (an unpacked megatron-core "
                    "0.19 wheel) to compare with Megatron-Core's own module")
def test_matches_megatron_core_019() -> None:
    cases = _oracle_cases(1500, seed=19)
    done = subprocess.run([sys.executable, ORACLE], input=json.dumps(cases), capture_output=True, text=True,
                          check=True, timeout=300)
    theirs = json.loads(done.stdout)
    compared = 0
    for case, expected in zip(cases, theirs):
        if "error" in expected:
            with pytest.raises(ValueError):
                generate(*case["args"])
            continue
        dims, tokens = generate(*case["args"])
        # Same shapes and order; 0.19 orders equal sort keys by set iteration, we by first appearance.
        assert sorted(tuples(dims)) == sorted(map(tuple, expected["dims"])), case
        rows = case["args"][8] + 1
        assert [(t - d * rows, d) for t, _, d in tuples(dims)] == [(t - d * rows, d) for t, _, d in expected["dims"]]
        assert tokens == expected["tokens"], case
        for real, picks in zip(case["real"], expected["match"]):
            for strict, pick in zip((False, True), picks):
                got = CUDAGraphBatchDimensionBuilder.match_graph_config(Dims(*real), dims, strict=strict)
                assert (None if got is None else [got.token_count, got.prefill_req_count, got.decode_req_count]) \
                    == pick, (case, real, strict)
        compared += bool(dims)
    assert compared > 500  # most cases produce graphs
