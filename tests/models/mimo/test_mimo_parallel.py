"""``MimoModel`` across processes equals one process on the same weights (fp32, gloo, 2 ranks).

- TP=2 (with and without sequence parallelism) and CP=2 in the language model, encoders colocated:
  per-token loss and every gradient.
- Non-colocated layout: the CLIP modality on rank 0, the language model on rank 1; the projected image
  embeddings and their gradient travel by send / recv. Loss and every gradient.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.distributed as dist

from megatron_core import parallel_state, tensor_parallel
from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.models.mimo import MimoModel
from megatron_core.process_groups_config import ProcessGroupCollection
from megatron_core.utils import get_batch_on_this_cp_rank
from tests.dist_harness import run_on_ranks
from tests.models.gpt_test_utils import shard, unshard
from tests.models.mimo import mimo_fixture as f
from tests.models.multimodal import llava_fixture as lf

WORLD = 2


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]:
    ids, images = f.batch([2, 0, 1], seed=3)
    gen = torch.Generator().manual_seed(4)
    labels = torch.randint(0, f.VOCAB - 1, ids.shape, generator=gen)
    loss_mask = (torch.rand(ids.shape, generator=gen) > 0.2).float()
    return ids, labels, loss_mask, {"images": {"clip_encoder": {"x": images}}}


def _reference() -> tuple[dict, torch.Tensor, dict]:
    torch.manual_seed(1)
    model = f.build()
    lf.randomize(model, seed=2)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    ids, labels, loss_mask, inputs = _batch()
    loss, _ = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
    (loss * loss_mask).sum().backward()
    return state, loss.detach(), {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _gated(name: str) -> bool:
    return name.startswith("language_model.")


def _close_grad(name: str, got: torch.Tensor, ref: torch.Tensor) -> None:
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                               msg=lambda m: f"{name}: {m}")


def _check_tp(sequence_parallel: bool) -> int:
    state, ref_loss, ref_grads = _reference()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=WORLD)
    try:
        tensor_parallel.model_parallel_cuda_manual_seed(1234)
        rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_tensor_model_parallel_group()
        model = f.build(tp=WORLD, sequence_parallel=sequence_parallel)
        assert (model.partition_adapter is not None) == sequence_parallel
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(shard(name, state[name], WORLD, rank, _gated(name)))
        ids, labels, loss_mask, inputs = _batch()
        loss, mask = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        (loss * mask).sum().backward()
        params = dict(model.named_parameters())
        for name, param in params.items():
            grad = param.grad.clone()
            if getattr(param, "sequence_parallel", False):
                dist.all_reduce(grad, group=group)
            pieces = [torch.empty_like(grad) for _ in range(WORLD)]
            dist.all_gather(pieces, grad.contiguous(), group=group)
            _close_grad(name, unshard(name, pieces, _gated(name)), ref_grads[name])
        return len(params)
    finally:
        parallel_state.destroy_model_parallel()


def _check_cp() -> int:
    state, ref_loss, ref_grads = _reference()
    parallel_state.initialize_model_parallel(context_parallel_size=WORLD)
    try:
        group = parallel_state.get_context_parallel_group()
        # CP cuts only the language model's combined sequence: the encoder's groups leave it out.
        encoder_groups = copy.copy(ProcessGroupCollection.use_mpu_process_groups())
        encoder_groups.cp, encoder_groups.tp_cp = None, encoder_groups.tp
        model = f.build(context_parallel_size=WORLD, encoder_groups=encoder_groups)
        model.load_state_dict(state, strict=False)
        ids, labels, loss_mask, inputs = _batch()
        loss, mask = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
        want = get_batch_on_this_cp_rank({"loss": ref_loss, "loss_mask": loss_mask}, cp_group=group)
        torch.testing.assert_close(mask, want["loss_mask"], rtol=0, atol=0)
        torch.testing.assert_close(loss, want["loss"], rtol=1e-5, atol=1e-5)
        (loss * mask).sum().backward()
        for name, param in model.named_parameters():
            grad = param.grad.clone()
            dist.all_reduce(grad, group=group)
            _close_grad(name, grad, ref_grads[name])
        return len(ref_grads)
    finally:
        parallel_state.destroy_model_parallel()


def _check_non_colocated() -> list[str]:
    state, ref_loss, ref_grads = _reference()
    rank = dist.get_rank()
    grids = {"images": HyperCommGrid([1, 1], ["tp", "dp"]), "language": HyperCommGrid([1, 1], ["tp", "dp"], 1)}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MimoModel(f.config(grid_map=grids))
    model.load_state_dict(state, strict=False)
    ids, labels, loss_mask, inputs = _batch()
    count = int((ids == f.IMAGE_TOKEN_ID).sum())
    if rank == 0:
        out, _ = model(ids, modality_inputs=inputs)
        assert set(out) == {"images"} and out["images"].shape == (count, lf.HIDDEN)
        dist.send(out["images"].detach().contiguous(), dst=1)
        grad = torch.empty_like(out["images"])
        dist.recv(grad, src=1)
        out["images"].backward(grad)
    else:
        received = torch.empty(count, lf.HIDDEN)
        dist.recv(received, src=0)
        received.requires_grad_()
        model.set_input_tensor({"images": [received]})
        loss, mask = model(ids, labels=labels, loss_mask=loss_mask)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
        (loss * mask).sum().backward()
        dist.send(received.grad.contiguous(), dst=0)
    for name, param in model.named_parameters():
        _close_grad(name, param.grad, ref_grads[name])
    return sorted(name.split(".")[0] for name, _ in model.named_parameters())[:1]


def test_tp2_matches_single_process():
    assert run_on_ranks(WORLD, _check_tp, False)[0] > 0


def test_tp2_sequence_parallel_matches_single_process():
    assert run_on_ranks(WORLD, _check_tp, True)[0] > 0


def test_cp2_matches_single_process():
    assert run_on_ranks(WORLD, _check_cp)[0] > 0


def test_non_colocated_encoder_and_language_ranks_match_single_process():
    assert run_on_ranks(WORLD, _check_non_colocated) == [["modality_submodules"], ["language_model"]]
