"""Every tensor_parallel mapping: forward and backward on 4 CPU ranks (TP=4, and TP=2 x DP=2).

Each rank builds the same global tensors from a fixed seed, feeds its share to the mapping and
checks the output, then back-propagates a rank-specific output gradient and checks the input
gradient against the closed form computed from all ranks' gradients.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.testing import assert_close

from megatron_core import parallel_state
from megatron_core import tensor_parallel as tp
from tests.dist_harness import run_on_ranks

WORLD = 4


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _run(fn, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``fn(x)`` and the gradient of ``sum(fn(x) * grad)`` with respect to ``x``."""
    x = x.clone().requires_grad_(True)
    y = fn(x)
    (y * grad).sum().backward()
    return y.detach(), x.grad


def _check_mappings(tp_size: int) -> None:
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size)
    r = parallel_state.get_tensor_model_parallel_rank()
    n = tp_size
    group = parallel_state.get_tensor_model_parallel_group()
    s, b, h = 4 * n, 2, 3 * n
    xs = _rand(n, s, b, h, seed=1)  # xs[k]: the input held by TP rank k
    gs = _rand(n, s, b, h, seed=2)  # gs[k]: the output gradient on TP rank k

    # copy: identity / all-reduce
    y, g = _run(tp.copy_to_tensor_model_parallel_region, xs[r], gs[r])
    assert_close(y, xs[r])
    assert_close(g, gs.sum(0))

    # reduce: all-reduce / identity (explicit group argument)
    y, g = _run(lambda x: tp.reduce_from_tensor_model_parallel_region(x, group=group), xs[r], gs[r])
    assert_close(y, xs.sum(0))
    assert_close(g, gs[r])

    # scatter last dim: split / all-gather
    grads = gs[:, :, :, : h // n]
    y, g = _run(tp.scatter_to_tensor_model_parallel_region, xs[0], grads[r])
    assert_close(y, xs[0].chunk(n, dim=-1)[r])
    assert_close(g, torch.cat(list(grads), dim=-1))

    # gather last dim: all-gather / split
    parts = xs[:, :, :, : h // n]
    y, g = _run(tp.gather_from_tensor_model_parallel_region, parts[r], gs[r])
    assert_close(y, torch.cat(list(parts), dim=-1))
    assert_close(g, gs[r].chunk(n, dim=-1)[r])

    # scatter sequence: split dim 0 / all-gather dim 0
    grads = gs[:, : s // n]
    y, g = _run(tp.scatter_to_sequence_parallel_region, xs[0], grads[r])
    assert_close(y, xs[0].chunk(n, dim=0)[r])
    assert_close(g, torch.cat(list(grads), dim=0))

    # gather sequence: all-gather dim 0 / reduce-scatter (or split) dim 0
    parts = xs[:, : s // n]
    for tp_output_grad in (True, False):
        fn = functools.partial(tp.gather_from_sequence_parallel_region, tensor_parallel_output_grad=tp_output_grad)
        y, g = _run(fn, parts[r], gs[r])
        assert_close(y, torch.cat(list(parts), dim=0))
        expected = gs.sum(0) if tp_output_grad else gs[r]
        assert_close(g, expected.chunk(n, dim=0)[r])

    # gather sequence with uneven pieces (output_split_sizes): rank k holds k + 1 rows
    sizes = [k + 1 for k in range(n)]
    pieces = [xs[k, : sizes[k]] for k in range(n)]
    full_grads = gs[:, : sum(sizes)]
    y, g = _run(lambda x: tp.gather_from_sequence_parallel_region(x, output_split_sizes=sizes),
                pieces[r], full_grads[r])
    assert_close(y, torch.cat(pieces, dim=0))
    assert_close(g, full_grads.sum(0).split(sizes, dim=0)[r])

    # reduce-scatter sequence: reduce-scatter dim 0 / all-gather dim 0
    grads = gs[:, : s // n]
    y, g = _run(tp.reduce_scatter_to_sequence_parallel_region, xs[r], grads[r])
    assert_close(y, xs.sum(0).chunk(n, dim=0)[r])
    assert_close(g, torch.cat(list(grads), dim=0))

    # reduce-scatter sequence, uneven (input_split_sizes)
    grads_uneven = [gs[k, : sizes[r]] for k in range(n)]
    y, g = _run(lambda x: tp.reduce_scatter_to_sequence_parallel_region(x, input_split_sizes=sizes),
                xs[r, : sum(sizes)], grads_uneven[r])
    assert_close(y, xs[:, : sum(sizes)].sum(0).split(sizes, dim=0)[r])
    assert_close(g, torch.cat([gs[k, : sizes[k]] for k in range(n)], dim=0))

    # all-gather last dim / reduce-scatter last dim
    parts = xs[:, :, :, : h // n]
    y, g = _run(tp.all_gather_last_dim_from_tensor_parallel_region, parts[r], gs[r])
    assert_close(y, torch.cat(list(parts), dim=-1))
    assert_close(g, gs.sum(0).chunk(n, dim=-1)[r])

    # reduce-scatter last dim / all-gather last dim
    grads = gs[:, :, :, : h // n]
    y, g = _run(tp.reduce_scatter_last_dim_to_tensor_parallel_region, xs[r], grads[r])
    assert_close(y, xs.sum(0).chunk(n, dim=-1)[r])
    assert_close(g, torch.cat(list(grads), dim=-1))

    # all-to-all over dim 0: rank r receives chunk r of every rank's input
    flat_x, flat_g = xs.reshape(n, s, -1), gs.reshape(n, s, -1)
    y, g = _run(lambda x: tp.all_to_all(group, x), flat_x[r], flat_g[r])
    assert_close(y, torch.cat([flat_x[k].chunk(n, dim=0)[r] for k in range(n)], dim=0))
    assert_close(g, torch.cat([flat_g[k].chunk(n, dim=0)[r] for k in range(n)], dim=0))

    # all-to-all with uneven splits: rank k sends (j + k + 1) rows to rank j
    send = [j + r + 1 for j in range(n)]
    recv = [r + k + 1 for k in range(n)]
    rows = _rand(n, sum(range(1, 2 * n)), 5, seed=3)
    grad_rows = _rand(n, sum(range(1, 2 * n)), 5, seed=4)
    x_r, g_r = rows[r, : sum(send)], grad_rows[r, : sum(recv)]
    y, g = _run(lambda x: tp.all_to_all(group, x, recv, send), x_r, g_r)
    counts = lambda k: [j + k + 1 for j in range(n)]  # rows rank k sends to (and receives from) each rank
    assert_close(y, torch.cat([rows[k, : sum(counts(k))].split(counts(k))[r] for k in range(n)], dim=0))
    assert_close(g, torch.cat([grad_rows[k, : sum(counts(k))].split(counts(k))[r] for k in range(n)], dim=0))

    # sp2hp / hp2sp: [tokens/TP, H] <-> [tokens, H/TP]
    tokens = _rand(s, h, seed=5)
    token_grads = _rand(n, s, h // n, seed=6)
    y, g = _run(tp.all_to_all_sp2hp, tokens.chunk(n, dim=0)[r], token_grads[r])
    assert_close(y, tokens.chunk(n, dim=-1)[r])
    assert_close(g, torch.cat(list(token_grads), dim=-1).chunk(n, dim=0)[r])
    seq_grads = _rand(n, s // n, h, seed=7)
    y, g = _run(tp.all_to_all_hp2sp, tokens.chunk(n, dim=-1)[r], seq_grads[r])
    assert_close(y, tokens.chunk(n, dim=0)[r])
    assert_close(g, torch.cat(list(seq_grads), dim=0).chunk(n, dim=-1)[r])


@pytest.mark.parametrize("tp_size", [2, 4])
def test_mappings_forward_and_backward(tp_size: int) -> None:
    run_on_ranks(WORLD, _check_mappings, tp_size)


def test_mappings_are_identity_without_groups() -> None:
    """With no process group registered, every mapping behaves as TP=1: identity in both directions."""
    x, grad = torch.randn(4, 6), torch.randn(4, 6)
    for fn in (tp.copy_to_tensor_model_parallel_region, tp.reduce_from_tensor_model_parallel_region,
               tp.scatter_to_tensor_model_parallel_region, tp.gather_from_tensor_model_parallel_region,
               tp.scatter_to_sequence_parallel_region, tp.gather_from_sequence_parallel_region,
               tp.reduce_scatter_to_sequence_parallel_region, tp.all_to_all_sp2hp, tp.all_to_all_hp2sp):
        y, g = _run(fn, x, grad)
        assert_close(y, x)
        assert_close(g, grad)
