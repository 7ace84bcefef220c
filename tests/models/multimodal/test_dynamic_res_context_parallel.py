"""Dynamic-resolution context parallelism (``split_to_context_parallel_ranks_dynamic_res`` /
``gather_from_context_parallel_ranks_dynamic_res``) on CP=2 gloo ranks against one process on the same images:
the split gives whole images (or whole tubelets) to each rank, a per-token layer applied to each rank's share and
gathered equals the layer on all images (fp32, 1e-5), and the gradients summed over CP equal one process's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_core import parallel_state
from megatron_core.models.multimodal.context_parallel import (
    gather_from_context_parallel_ranks_dynamic_res,
    split_to_context_parallel_ranks_dynamic_res,
)
from megatron_core.models.multimodal.dynamic_res_context_parallel import _tubelet_split_points
from megatron_core.packed_seq_params import PackedSeqParams
from tests.dist_harness import run_on_ranks

WORLD, PATCH = 2, 2
HIDDEN = 3 * PATCH * PATCH
TOL = dict(rtol=1e-5, atol=1e-5)


def _images(seqlens: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, PackedSeqParams]:
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randn(1, sum(seqlens), HIDDEN, generator=gen)
    sizes = torch.tensor([[PATCH * n, PATCH] for n in seqlens], dtype=torch.int32)
    cu = torch.tensor([0] + torch.tensor(seqlens).cumsum(0).tolist(), dtype=torch.int32)
    return tokens, sizes, PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)


def _check_split_gather(seqlens: list[int], fp8: bool, num_frames: list[int] | None, tubelet: int) -> dict:
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD)
    try:
        rank, group = torch.distributed.get_rank(), parallel_state.get_context_parallel_group()
        tokens, sizes, params = _images(seqlens)
        weight = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(5))
        probe = torch.randn(sum(seqlens), HIDDEN, generator=torch.Generator().manual_seed(6))
        ref_tokens, ref_weight = tokens.clone().requires_grad_(), weight.clone().requires_grad_()
        reference = F.linear(ref_tokens[0], ref_weight)
        (reference * probe).sum().backward()

        tokens.requires_grad_()
        weight.requires_grad_()
        local_t, local_sizes, local_params, has_padding, padded_ranks, local_frames = \
            split_to_context_parallel_ranks_dynamic_res(
                tokens, sizes, params, patch_dim=PATCH, fp8_enabled=fp8, num_frames=num_frames,
                temporal_patch_size=tubelet)
        cu = local_params.cu_seqlens_q.tolist()
        assert local_t.shape == (1, cu[-1], HIDDEN) and local_sizes.shape == (len(cu) - 1, 2)
        assert local_params.qkv_format == "thd" and (cu[-1] % 16 == 0 if fp8 else True)
        real = cu[-2] if has_padding else cu[-1]
        if has_padding:
            assert local_sizes[-1].tolist() == [PATCH, PATCH * (cu[-1] - cu[-2])]
            assert torch.count_nonzero(local_t[0, real:]) == 0
        output = F.linear(local_t[0, :real], weight)
        gathered = gather_from_context_parallel_ranks_dynamic_res(output, num_padded_imgs=padded_ranks)
        torch.testing.assert_close(gathered, reference.detach(), **TOL)
        (gathered * probe).sum().div(WORLD).backward()  # every rank holds the whole output: each counts 1 / CP
        for grad in (tokens.grad, weight.grad):
            torch.distributed.all_reduce(grad, group=group)
        torch.testing.assert_close(tokens.grad, ref_tokens.grad, **TOL)
        torch.testing.assert_close(weight.grad, ref_weight.grad, **TOL)
        return dict(rank=rank, cu=cu, sizes=local_sizes[:, 0].tolist(), padded_ranks=padded_ranks,
                    has_padding=has_padding,
                    frames=None if local_frames is None else local_frames.tolist())
    finally:
        parallel_state.destroy_model_parallel()


@pytest.mark.parametrize("seqlens,fp8,frames,tubelet,expected", [
    ([3, 5], False, None, 1, [dict(cu=[0, 3], padded_ranks=0), dict(cu=[0, 5], padded_ranks=0)]),
    ([3, 5, 2], False, None, 1, [dict(cu=[0, 3]), dict(cu=[0, 5, 7])]),  # the last rank takes the remainder
    ([4], False, None, 1, [dict(cu=[0, 4], padded_ranks=1), dict(cu=[0, 1], padded_ranks=1)]),  # a dummy image
    ([3, 5, 2], True, None, 1, [dict(cu=[0, 3, 16], has_padding=True), dict(cu=[0, 5, 7, 16], has_padding=True)]),
    ([1] * 8, False, [4, 4], 2, [dict(cu=[0, 1, 2, 3, 4], frames=[4]), dict(cu=[0, 1, 2, 3, 4], frames=[4])]),
    ([2] * 6, False, [6], 2, [dict(cu=[0, 2, 4, 6, 8], frames=[4]), dict(cu=[0, 2, 4], frames=[2])]),
    ([3, 3], False, [2], 2, [dict(cu=[0, 3, 6], frames=[2], padded_ranks=1), dict(cu=[0, 1], frames=[1])]),
], ids=["two_images", "uneven", "dummy", "fp8_padding", "two_videos", "one_video_tubelets", "video_and_dummy"])
def test_split_then_gather_matches_one_process(seqlens, fp8, frames, tubelet, expected):
    results = run_on_ranks(WORLD, _check_split_gather, seqlens, fp8, frames, tubelet)
    for result, want in zip(results, expected):
        assert {key: result[key] for key in want} == want, result


def _check_gather_sizes() -> list[list[float]]:
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD)
    try:
        rank = torch.distributed.get_rank()
        local = torch.full((rank + 1, 2, 3), float(rank))
        whole = gather_from_context_parallel_ranks_dynamic_res(local)
        first = gather_from_context_parallel_ranks_dynamic_res(local, num_padded_imgs=1)
        assert whole.shape == (3, 2, 3) and first.shape == (1, 2, 3)
        with pytest.raises(ValueError, match="num_padded_imgs \\(2\\)"):
            gather_from_context_parallel_ranks_dynamic_res(local, num_padded_imgs=2)
        return [whole[:, 0, 0].tolist(), first[:, 0, 0].tolist()]
    finally:
        parallel_state.destroy_model_parallel()


def test_gather_concatenates_variable_sizes_in_rank_order():
    for whole, first in run_on_ranks(WORLD, _check_gather_sizes):
        assert whole == [0.0, 1.0, 1.0] and first == [0.0]


def test_tubelet_split_points_by_hand():
    assert _tubelet_split_points([4, 4], 2, 2, 8) == [0, 4, 8]  # a medium boundary
    assert _tubelet_split_points([6], 2, 2, 6) == [0, 4, 6]  # target 3: tubelet 2 (round(1.5)), frame 4
    assert _tubelet_split_points([1, 5], 2, 2, 6) == [0, 3, 6]  # target 3 inside the 5-frame video: 1 + 2
    assert _tubelet_split_points([2, 1, 1], 2, 4, 4) == [0, 2, 2, 3, 4]  # one tubelet: its nearer end; an empty share


def test_split_refuses_bad_input():
    tokens, sizes, params = _images([2, 2])
    with pytest.raises(ValueError, match="3\\*patch_dim\\*patch_dim=27"):
        split_to_context_parallel_ranks_dynamic_res(tokens, sizes, params, patch_dim=3)
    with pytest.raises(ValueError, match="num_frames is required"):
        split_to_context_parallel_ranks_dynamic_res(tokens, sizes, params, patch_dim=PATCH, temporal_patch_size=2)
    with pytest.raises(ValueError, match="num_frames sums to 3"):
        split_to_context_parallel_ranks_dynamic_res(tokens, sizes, params, patch_dim=PATCH, num_frames=[3],
                                                    temporal_patch_size=2)
