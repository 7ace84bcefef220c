"""``LLaVAModel`` at TP=2 (with and without sequence parallelism) and at CP=2 equals one process on the same
weights: per-token loss, expanded loss mask and every gradient (fp32, gloo). The combined sequence (41
positions) is odd, so SP and CP pad it. Also the CP split / gather of image batches round-trips, forward
and backward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_core import parallel_state, tensor_parallel
from megatron_core.models.multimodal.context_parallel import (
    gather_from_context_parallel_ranks,
    split_to_context_parallel_ranks,
)
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import shard, unshard
from tests.models.multimodal.llava_fixture import IMAGE_TOKEN_ID, IMG_SEQ, build, images, randomize

WORLD = 2
TEXT_LEN = 11
LENGTH = TEXT_LEN - 2 + 2 * IMG_SEQ  # the longer sample: 41 positions


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(1, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    ids[0, 1] = ids[0, 6] = ids[1, 0] = IMAGE_TOKEN_ID
    labels = torch.randint(0, IMAGE_TOKEN_ID, (2, TEXT_LEN), generator=gen)
    loss_mask = (torch.rand(2, TEXT_LEN, generator=gen) > 0.2).float()
    return ids, labels, loss_mask


def _run(model) -> tuple[torch.Tensor, torch.Tensor, dict]:
    ids, labels, loss_mask = _batch()
    loss, mask = model(images(3, seed=9), ids, None, None, labels=labels, loss_mask=loss_mask)
    (loss * mask).sum().backward()
    return loss.detach(), mask, {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _reference() -> tuple[dict, torch.Tensor, torch.Tensor, dict]:
    torch.manual_seed(1)
    model = build()
    randomize(model, seed=2)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    return (state, *_run(model))


def _gated(name: str) -> bool:
    return name.startswith("language_model.")


def _check_tp(sequence_parallel: bool) -> int:
    state, ref_loss, ref_mask, ref_grads = _reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        model = build(tp=WORLD, language=dict(sequence_parallel=sequence_parallel))
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], WORLD, rank, _gated(name)))
        loss, mask, grads = _run(model)
        padded = LENGTH + 1 if sequence_parallel else LENGTH
        assert loss.shape == mask.shape == (2, padded)
        assert not mask[:, LENGTH:].any()
        torch.testing.assert_close(mask[:, :LENGTH], ref_mask, rtol=0, atol=0)
        # IGNORE_INDEX positions (all masked out) are 0 at TP=1 (torch's cross entropy) but the log-sum-exp at
        # TP>1 (Megatron's vocab-parallel formula): compare the others.
        valid = ref_loss != 0
        torch.testing.assert_close(loss[:, :LENGTH][valid], ref_loss[valid], rtol=1e-5, atol=1e-5)
        for name, grad in grads.items():
            if getattr(dict(model.named_parameters())[name], "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(WORLD)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            full, ref = unshard(name, pieces, _gated(name)), ref_grads[name]
            torch.testing.assert_close(full, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        return len(grads)
    finally:
        parallel_state.destroy_model_parallel()


def _check_cp() -> int:
    state, ref_loss, ref_mask, ref_grads = _reference()
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        model = build(language=dict(context_parallel_size=WORLD))
        model.load_state_dict({**model.state_dict(), **state})
        loss, mask, grads = _run(model)
        pad = 4 - LENGTH % 4  # to a multiple of 2 * cp
        want = get_batch_on_this_cp_rank({"loss": F.pad(ref_loss, (0, pad)), "mask": F.pad(ref_mask, (0, pad))})
        torch.testing.assert_close(mask, want["mask"], rtol=0, atol=0)
        torch.testing.assert_close(loss, want["loss"], rtol=1e-5, atol=1e-5)
        group = parallel_state.get_context_parallel_group()
        for name, grad in grads.items():
            dist.all_reduce(grad, group=group)  # each rank's loss covers its chunks only
            ref = ref_grads[name]
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, n=name: f"{n}: {m}")
        return len(grads)
    finally:
        parallel_state.destroy_model_parallel()


def _check_cp_split_gather() -> list[list[float]]:
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD)
    try:
        full = torch.arange(5.0).reshape(5, 1).requires_grad_()
        local, global_pad = split_to_context_parallel_ranks(full)
        assert global_pad == 1 and local.shape == (3, 1)
        gathered = gather_from_context_parallel_ranks(local.transpose(0, 1), global_pad)  # samples on dim 1
        torch.testing.assert_close(gathered, full.detach().transpose(0, 1))
        (gathered * torch.arange(1.0, 6.0)).sum().backward()
        # Every rank's gathered copy feeds the loss: each rank's samples get the summed (WORLD x) gradient.
        return full.grad.reshape(-1).tolist()
    finally:
        parallel_state.destroy_model_parallel()


def test_tp2_matches_single_process():
    counts = run_on_ranks(WORLD, _check_tp, False)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_tp2_sequence_parallel_matches_single_process():
    counts = run_on_ranks(WORLD, _check_tp, True)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_cp2_matches_single_process():
    counts = run_on_ranks(WORLD, _check_cp)
    assert counts[0] > 0 and len(set(counts)) == 1


def test_cp_split_and_gather_round_trip():
    grads = run_on_ranks(WORLD, _check_cp_split_gather)
    assert grads[0] == [2.0, 4.0, 6.0, 0.0, 0.0] and grads[1] == [0.0, 0.0, 0.0, 8.0, 10.0]
