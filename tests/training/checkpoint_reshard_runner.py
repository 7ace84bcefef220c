"""Save a feature's training state under one layout, resume it under another (rank side).

The reshard audit's two halves, each run on every rank of a rank pool for a list of features
(``parallel_step_features.FEATURES``) and a :class:`~tests.training.parallel_step_features.Layout`:

* :func:`train_save_continue` (layout A) trains ``SAVED_AT`` steps, saves model + optimizer with
  ``megatron_core.training.save_checkpoint`` (the entry point ``examples/pretrain_gpt.py`` uses) and
  trains one more step.
* :func:`load_resave_continue` (layout B) builds the model from another seed, loads the checkpoint
  with ``load_checkpoint``, records its sharded-state-dict pieces and every Adam step count, saves it
  again (so the parent can compare the optimizer state it now holds with the saved one, unsharded)
  and trains the same extra step.

Both return the pieces of the model's sharded state dict after the extra step and that step's loss
and grad norm; the parent (``test_checkpoint_reshard_features``) compares them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from megatron_core import parallel_state, tensor_parallel
from megatron_core.distributed import DistributedDataParallelConfig
from megatron_core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron_core.pipeline_parallel import get_forward_backward_func
from megatron_core.training import load_checkpoint, save_checkpoint
from megatron_core.training.model_builder import configure_model_hooks, get_model
from tests.training.parallel_step_features import FEATURES, MBS, SEQ, Layout
from tests.training.parallel_step_features import model_provider as provider

# The step machinery of the equivalence audit (same data, loss and optimizer settings), reused so that a step
# here is the step that audit checks against one process.
from tests.training.parallel_step_runner import ADAM_EPS, LR, SEED, local_pieces
from tests.training.parallel_step_runner import _forward_step as forward_step
from tests.training.parallel_step_runner import _my_microbatches as my_microbatches
from tests.training.parallel_step_runner import _parallel_fields as parallel_fields

SAVED_AT = 2  # optimizer steps before the checkpoint; one more follows it in both layouts
LOAD_SEED = SEED + 77  # layout B starts from other weights, so a tensor the load misses shows


def checkpoint_dir(root: str, feature: str) -> str:
    """Where ``feature``'s checkpoint lives under ``root`` (the ``save_dir`` of ``save_checkpoint``)."""
    return os.path.join(root, feature)


def _initialize(layout: Layout) -> None:
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=layout.tp, pipeline_model_parallel_size=layout.pp,
        context_parallel_size=layout.cp, expert_model_parallel_size=layout.ep)


def _build(name: str, layout: Layout, seed: int) -> tuple[list[torch.nn.Module], Any]:
    """``feature``'s DDP chunks and Megatron optimizer under ``layout`` (already initialised), from ``seed``."""
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    config = FEATURES[name].make_config(**parallel_fields(layout), pipeline_dtype=torch.float32)
    chunks = get_model(partial(provider, FEATURES[name]), config=config,
                       ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=layout.distributed_optimizer))
    optimizer = get_megatron_optimizer(OptimizerConfig(
        lr=LR, adam_eps=ADAM_EPS, weight_decay=0.01, clip_grad=0.5,
        use_distributed_optimizer=layout.distributed_optimizer), chunks)
    configure_model_hooks(config, chunks, optimizer)
    return chunks, optimizer


def _train_step(name: str, chunks: list[torch.nn.Module], optimizer: Any, step: int) -> dict[str, Any]:
    """One optimizer step on global batch ``step``: its ``[loss sum, token count]`` (loss-holding ranks, else
    ``None``) and grad norm."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    mine = my_microbatches(step)
    logs = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(mine), model=chunks[0],
                                       num_microbatches=len(mine), seq_length=SEQ, micro_batch_size=MBS)
    success, grad_norm, _ = optimizer.step()
    if not success:
        raise AssertionError(f"{name}: optimizer step {step} was skipped")
    owns_loss = parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0
    loss = torch.stack([log["lm loss"] for log in logs]).sum(0) if owns_loss else None
    return {"loss": loss, "grad_norm": float(grad_norm)}


def _adam_steps(optimizer: Any) -> list[int]:
    """The step count of every parameter state this rank's (possibly chained) optimizer holds."""
    leaves = getattr(optimizer, "chained_optimizers", [optimizer])
    return [int(state["step"]) for leaf in leaves for state in leaf.optimizer.state.values() if "step" in state]


def train_save_continue(names: list[str], layout: Layout, root: str) -> dict[str, dict[str, Any]]:
    """Layout A: per feature, ``SAVED_AT`` steps, a checkpoint under ``root``, then one more step."""
    _initialize(layout)
    return save_each(names, layout, root, _build, _train_step)


def save_each(names: list[str], layout: Layout, root: str, build: Callable[..., tuple],
              train_step: Callable[..., dict]) -> dict[str, dict[str, Any]]:
    """The body of :func:`train_save_continue` with the model builder and the step given (see :func:`resume_each`)."""
    out = {}
    for name in names:
        chunks, optimizer = build(name, layout, SEED)
        for step in range(SAVED_AT):
            train_step(name, chunks, optimizer, step)
        save_checkpoint(checkpoint_dir(root, name), SAVED_AT, chunks, optimizer, None)
        out[name] = dict(train_step(name, chunks, optimizer, SAVED_AT), final=local_pieces(chunks))
    return out


def load_resave_continue(names: list[str], layout: Layout, root: str, resave_root: str) -> dict[str, dict[str, Any]]:
    """Layout B: per feature, load ``root``'s checkpoint into a model built from another seed, save it again
    under ``resave_root``, then take the step that followed the save in layout A."""
    _initialize(layout)
    return resume_each(names, layout, root, resave_root, _build, _train_step)


def resume_each(names: list[str], layout: Layout, root: str, resave_root: str, build: Callable[..., tuple],
                train_step: Callable[..., dict]) -> dict[str, dict[str, Any]]:
    """The body of :func:`load_resave_continue` with the model builder (``build(name, layout, seed)`` ->
    ``(chunks, optimizer)``) and the step (``train_step(name, chunks, optimizer, iteration)`` -> results) given."""
    out = {}
    for name in names:
        chunks, optimizer = build(name, layout, LOAD_SEED)
        state = load_checkpoint(checkpoint_dir(root, name), chunks, optimizer, None)
        if state["iteration"] != SAVED_AT:
            raise AssertionError(f"{name}: loaded iteration {state['iteration']}, saved {SAVED_AT}")
        loaded, steps = local_pieces(chunks), _adam_steps(optimizer)
        save_checkpoint(checkpoint_dir(resave_root, name), SAVED_AT, chunks, optimizer, None)
        out[name] = dict(train_step(name, chunks, optimizer, SAVED_AT), final=local_pieces(chunks), loaded=loaded,
                         adam_steps=steps)
    return out
