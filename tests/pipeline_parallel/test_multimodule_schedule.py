"""The 1F1B schedule over a multi-module pipeline (encoder ranks feeding language-model ranks) on gloo ranks.

``forward_backward_pipelining_without_interleaving`` with a ``MultiModulePipelineCommunicator`` and a
``MultiModuleProcessGroupCollection`` drives a non-colocated ``MimoModel`` (the tiny CLIP + GPT VLM of
``tests/models/mimo``) over several microbatches. Every microbatch's loss and every parameter gradient must
equal one process running the colocated model on the same weights and data (fp32):

- ``pair``: the image encoder on rank 0, the language model on rank 1;
- ``fan_in``: the encoder data-parallel over ranks 0 and 1 (each encodes half of every microbatch's samples),
  the language model on rank 2; the bridge concatenates the two halves, and the encoder's gradients summed
  over its replicas equal the reference.
"""

from __future__ import annotations

import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist

from megatron_core.hyper_comm_grid import HyperCommGrid
from megatron_core.models.mimo import MimoModel
from megatron_core.pipeline_parallel import schedules
from megatron_core.pipeline_parallel.multimodule_communicator import MultiModulePipelineCommunicator
from megatron_core.process_groups_config import MultiModuleProcessGroupCollection, ProcessGroupCollection
from tests.dist_harness import run_on_ranks
from tests.models.mimo import mimo_fixture as f
from tests.models.multimodal import llava_fixture as lf

N_MB = 3
IMAGES_PER_SAMPLE = [1, 1, 2, 0]  # two images in each half of the batch


def _microbatch(i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    ids, images = f.batch(IMAGES_PER_SAMPLE, seed=10 + i)
    gen = torch.Generator().manual_seed(20 + i)
    labels = torch.randint(0, f.VOCAB - 1, ids.shape, generator=gen)
    loss_mask = (torch.rand(ids.shape, generator=gen) > 0.2).float()
    return ids, labels, loss_mask, images


def _loss(mask: torch.Tensor, per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict]:
    loss = (per_token_loss * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def _reference() -> tuple[dict, list[torch.Tensor], dict]:
    torch.manual_seed(1)
    model = f.build()
    lf.randomize(model, seed=2)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    losses = []
    for i in range(N_MB):
        ids, labels, loss_mask, images = _microbatch(i)
        out, mask = model(ids, labels=labels, loss_mask=loss_mask,
                          modality_inputs={"images": {"clip_encoder": {"x": images}}})
        loss, _ = _loss(mask, out)
        (loss / N_MB).backward()
        losses.append(loss.detach())
    return state, losses, {k: v.grad.detach().clone() for k, v in model.named_parameters()}


def _grid(shape: list[int], offset: int) -> HyperCommGrid:
    grid = HyperCommGrid(shape, ["tp", "cp", "pp", "dp"], rank_offset=offset)
    for dims in ("tp", "cp", "pp", "dp"):
        grid.create_pg(dims)
    return grid


def _groups(grid: HyperCommGrid) -> ProcessGroupCollection:
    pgc = ProcessGroupCollection()
    for axis in ("tp", "cp", "pp", "dp"):
        setattr(pgc, axis, grid.get_pg(axis))
    return pgc


def _run(encoder_dp: int, variable_seq_lengths: bool = True) -> dict:
    state, ref_losses, ref_grads = _reference()
    rank = dist.get_rank()
    enc_grid, llm_grid = _grid([1, 1, 1, encoder_dp], 0), _grid([1, 1, 1, 1], encoder_dp)
    grids = {"images": enc_grid, "language": llm_grid}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = MimoModel(f.config(grid_map=grids, variable_seq_lengths=variable_seq_lengths))
    model.load_state_dict(state, strict=False)
    comm = MultiModulePipelineCommunicator(grids, {"images": ["language"], "language": []}, model.config,
                                           module_output_ndim={"images": 2})
    on_encoder = comm.is_current_rank_in_grid(enc_grid)
    if on_encoder:
        pgs = MultiModuleProcessGroupCollection({"images": _groups(enc_grid)})
    else:
        pgs = MultiModuleProcessGroupCollection({"language": _groups(llm_grid)}, language_model_module_name="language")

    def data():
        half = len(IMAGES_PER_SAMPLE) // encoder_dp
        for i in range(N_MB):
            ids, labels, loss_mask, images = _microbatch(i)
            if on_encoder:  # this replica's samples and their images
                lo = dist.get_group_rank(enc_grid.get_pg("dp"), rank) * half
                first = sum(IMAGES_PER_SAMPLE[:lo])
                images = images[first:first + sum(IMAGES_PER_SAMPLE[lo:lo + half])]
                ids = ids[lo:lo + half]
            yield ids, labels, loss_mask, {"images": {"clip_encoder": {"x": images}}}

    def step(data_iterator, model):
        ids, labels, loss_mask, inputs = next(data_iterator)
        out, mask = model(ids, labels=labels, loss_mask=loss_mask, modality_inputs=inputs)
        return out, partial(_loss, mask)

    logs = schedules.forward_backward_pipelining_without_interleaving(
        forward_step_func=step, data_iterator=data(), model=[model], num_microbatches=N_MB, seq_length=0,
        micro_batch_size=len(IMAGES_PER_SAMPLE), p2p_communicator=comm, pg_collection=pgs)
    try:
        result = {"encoder": on_encoder, "params": 0}
        if not on_encoder:
            assert len(logs) == N_MB
            for got, ref in zip(logs, ref_losses):
                torch.testing.assert_close(got["loss"], ref, rtol=1e-5, atol=1e-6)
        for name, param in model.named_parameters():
            grad = param.grad
            if on_encoder and encoder_dp > 1:
                grad = grad.clone()
                dist.all_reduce(grad, group=enc_grid.get_pg("dp"))
            ref = ref_grads[name]
            torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-5 * max(1.0, ref.abs().max().item()),
                                       msg=lambda m, name=name: f"{name}: {m}")
            result["params"] += 1
        return result
    finally:
        model.destroy()


def _refuses_fixed_seq_lengths() -> str:
    try:
        _run(1, variable_seq_lengths=False)
    except ValueError as err:
        return str(err)
    return "no error"


def test_encoder_and_language_ranks_match_one_process():
    results = run_on_ranks(2, _run, 1)
    assert [r["encoder"] for r in results] == [True, False]
    assert all(r["params"] > 0 for r in results)


def test_encoder_data_parallel_fan_in_matches_one_process():
    results = run_on_ranks(3, _run, 2)
    assert [r["encoder"] for r in results] == [True, True, False]
    assert all(r["params"] > 0 for r in results)


def test_multimodule_schedule_needs_variable_seq_lengths():
    messages = run_on_ranks(2, _refuses_fixed_seq_lengths)
    assert all("variable_seq_lengths" in m for m in messages)


def test_multimodule_schedule_needs_both_multimodule_arguments():
    config = lf.language_config(variable_seq_lengths=True)
    model = torch.nn.Linear(2, 2)
    model.config = config
    pgs = MultiModuleProcessGroupCollection({"language": ProcessGroupCollection()}, language_model_module_name="language")
    with pytest.raises(ValueError, match="MultiModulePipelineCommunicator"):
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=None, data_iterator=None, model=model, num_microbatches=1, seq_length=1,
            micro_batch_size=1, pg_collection=pgs)
