"""Save a model family's training state under one layout, resume it under another (rank side).

The family counterpart of :mod:`tests.training.checkpoint_reshard_runner` (same steps, same checks): layout A
(:func:`train_save_continue`) trains ``SAVED_AT`` steps of a family
(:data:`tests.training.family_step_features.FAMILIES`) through the path of
:mod:`tests.training.family_step_runner`, saves model + optimizer with ``save_checkpoint`` and trains one more
step; layout B (:func:`load_resave_continue`) builds the model from another seed, loads the checkpoint with
``load_checkpoint``, records its pieces and Adam step counts, saves it again and trains the same extra step.
"""

from __future__ import annotations

from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core.training.model_builder import configure_model_hooks
from tests.training.checkpoint_reshard_runner import resume_each, save_each
from tests.training.family_step_features import FAMILIES
from tests.training.family_step_runner import build, initialize, train_step
from tests.training.parallel_step_features import Layout
from tests.training.parallel_step_runner import _optimizer


def _model_and_optimizer(name: str, layout: Layout, seed: int) -> tuple[list[torch.nn.Module], Any]:
    config, chunks = build(FAMILIES[name], layout, seed)
    optimizer = _optimizer(layout, chunks)
    configure_model_hooks(config, chunks, optimizer)
    return chunks, optimizer


def _step(name: str, chunks: list[torch.nn.Module], optimizer: Any, step: int) -> dict[str, Any]:
    loss, grad_norm = train_step(FAMILIES[name], chunks, optimizer, step)
    return {"loss": loss, "grad_norm": grad_norm}


def train_save_continue(names: list[str], layout: Layout, root: str) -> dict[str, dict[str, Any]]:
    """Layout A: per family, ``SAVED_AT`` steps, a checkpoint under ``root``, then one more step."""
    initialize(layout)
    try:
        return save_each(names, layout, root, _model_and_optimizer, _step)
    finally:
        parallel_state.destroy_model_parallel()


def load_resave_continue(names: list[str], layout: Layout, root: str, resave_root: str) -> dict[str, dict[str, Any]]:
    """Layout B: per family, load ``root``'s checkpoint into a model built from another seed, save it again under
    ``resave_root``, then take the step that followed the save in layout A."""
    initialize(layout)
    try:
        return resume_each(names, layout, root, resave_root, _model_and_optimizer, _step)
    finally:
        parallel_state.destroy_model_parallel()
