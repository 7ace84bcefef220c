"""Quantized checkpoints: Model Optimizer's state beside a ``dist_checkpointing`` checkpoint.

A quantized model is saved in two parts, as Megatron-LM does:

* the model's sharded state dict, through ``dist_checkpointing.save``: the weights plus every
  quantizer buffer (amax, pre-quantization scale), each split over TP like the channels it
  belongs to (:mod:`.quant_modules`), so the checkpoint reshards like any other;
* Model Optimizer's own record of what was done (``mto.modelopt_state``: the quantization config
  and each quantizer's settings) in ``<checkpoint>/modelopt_state``, written by :func:`save_modelopt_state`.

Loading reverses the order: :func:`load_modelopt_state` quantizes a freshly built model the same
way (Model Optimizer re-creates each quantizer with buffers of this rank's shapes, under the new TP
layout), then ``dist_checkpointing.load(model.sharded_state_dict(), ...)`` fills in the values::

    dist_checkpointing.save(model.sharded_state_dict(), ckpt)
    save_modelopt_state(model, ckpt)
    ...
    load_modelopt_state(new_model, ckpt)           # any TP or PP size
    new_model.load_state_dict(dist_checkpointing.load(new_model.sharded_state_dict(), ckpt))

Module names key the saved quantizer settings; those of MoE experts (whose names hold the local expert
index) are re-keyed for the loading model's expert-parallel size (``quant_moe.modelopt_state_for``).

Pipeline parallelism: the quantizer buffers are entries of the model's sharded state dict, so they are
keyed by each layer's global index like the weights (``TransformerBlock.sharded_state_dict``). Model
Optimizer's state names each quantizer by its module name, in which a stage numbers its layers from 0.
It is stored layout-independent: :func:`save_modelopt_state` renames every quantizer of
``decoder.layers.<i>`` to the layer's global index (``layer_offset + i``) and merges the stages' settings
(gathered over the pipeline group), so the saved state is the one a PP=1 model of the same recipe would
record (checkpoints saved before this change, all at PP=1, read the same). :func:`load_modelopt_state`
keeps the settings of this stage's layers, renamed to their local index, and of the modules this stage
holds (e.g. the output layer on the last stage only), so a checkpoint loads at any pipeline size.
Virtual pipeline parallelism (several model chunks per rank) is refused.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from megatron_core import dist_checkpointing
from megatron_core._wrapped_model import innermost_module
from megatron_core.post_training.modelopt._backend import modelopt_modules
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.transformer_block import TransformerBlock

__all__ = ["MODELOPT_STATE_DIR", "check_checkpoint_recipe", "checkpoint_recipe", "has_modelopt_state",
           "load_modelopt_state", "save_modelopt_state"]

MODELOPT_STATE_DIR = "modelopt_state"
_KEY = "modelopt_state"


def _check_no_virtual_pipeline(model: torch.nn.Module) -> None:
    stages = [m.vp_stage for m in model.modules() if isinstance(m, TransformerBlock) and m.vp_stage is not None]
    if stages:
        raise NotImplementedError(
            f"quantized checkpoints under virtual pipeline parallelism (model chunk vp_stage={stages[0]}) are not "
            "supported: save and load a model built without virtual_pipeline_model_parallel_size")


def _roots(model: torch.nn.Module) -> list[torch.nn.Module]:
    """``model`` and, when it is wrapped (DDP, ...), the wrapped module: Model Optimizer may name either way."""
    inner = innermost_module(model)
    return [model] if inner is model else [model, inner]


def _layer_prefixes(model: torch.nn.Module) -> dict[str, tuple[str, int, int]]:
    """``{"<block>.layers.": (block name, layer_offset, number of local layers)}`` for each transformer block."""
    return {f"{name}.layers." if name else "layers.": (name, m.layer_offset, len(m.layers))
            for root in _roots(model) for name, m in root.named_modules() if isinstance(m, TransformerBlock)}


def _split_layer_name(name: str, prefixes: dict[str, tuple[str, int, int]]) -> tuple[str, int, str] | None:
    """``(layers prefix, layer index, rest)`` when ``name`` lies in a transformer block's layers, else ``None``."""
    for prefix in prefixes:
        if name.startswith(prefix):
            index, _, rest = name[len(prefix):].partition(".")
            if index.isdigit():
                return prefix, int(index), rest
    return None


def _quantizer_states(modelopt_state: dict) -> list[dict | None]:
    """Each recorded mode's ``quantizer_state`` (per-quantizer settings by module name), ``None`` where it has none."""
    return [entry.get("metadata", {}).get("quantizer_state") if isinstance(entry, dict) else None
            for _, entry in modelopt_state.get("modelopt_state_dict", [])]


def _with_quantizer_states(modelopt_state: dict, states: list[dict | None]) -> dict:
    """``modelopt_state`` with each mode's ``quantizer_state`` replaced by ``states`` (in mode order)."""
    modes = []
    for (mode, entry), quantizer_state in zip(modelopt_state.get("modelopt_state_dict", []), states, strict=True):
        if quantizer_state is not None:
            entry = {**entry, "metadata": {**entry["metadata"], "quantizer_state": quantizer_state}}
        modes.append((mode, entry))
    return {**modelopt_state, "modelopt_state_dict": modes}


def _global_state(model: torch.nn.Module, modelopt_state: dict) -> dict:
    """``modelopt_state`` with layer-global quantizer names, merged over the pipeline stages (module docstring)."""
    prefixes = _layer_prefixes(model)

    def to_global(name: str) -> str:
        split = _split_layer_name(name, prefixes)
        if split is None:
            return name
        prefix, index, rest = split
        return f"{prefix}{prefixes[prefix][1] + index}.{rest}"

    states = [None if q is None else {to_global(n): v for n, v in q.items()} for q in _quantizer_states(modelopt_state)]
    modes = [mode for mode, _ in modelopt_state.get("modelopt_state_dict", [])]
    group = resolve_process_group("pp")
    if group is not None and torch.distributed.get_world_size(group) > 1:
        stages: list = [None] * torch.distributed.get_world_size(group)
        torch.distributed.all_gather_object(stages, (modes, states), group=group)
        for stage_modes, _ in stages:
            if stage_modes != modes:
                raise ValueError(f"the pipeline stages were converted by different Model Optimizer modes: "
                                 f"{stage_modes} vs {modes}")
        states = [None if q is None else {n: v for _, s in stages for n, v in s[i].items()}  # in layer order
                  for i, q in enumerate(states)]
    return _with_quantizer_states(modelopt_state, states)


def _local_state(model: torch.nn.Module, modelopt_state: dict) -> dict:
    """A saved (layer-global) ``modelopt_state`` restricted to ``model``'s modules, with their local layer names."""
    prefixes = _layer_prefixes(model)

    def to_local(name: str) -> str | None:
        split = _split_layer_name(name, prefixes)
        if split is not None:
            prefix, index, rest = split
            _, offset, count = prefixes[prefix]
            if not offset <= index < offset + count:
                return None  # another stage's layer
            name = f"{prefix}{index - offset}.{rest}"
        parts = name.split(".")
        owner = next((".".join(parts[:i]) for i, part in enumerate(parts) if part.endswith("_quantizer")), name)
        for root in _roots(model):
            try:
                root.get_submodule(owner)
            except AttributeError:
                continue
            return name
        return None  # a module of another stage (e.g. the output layer)

    states = []
    for quantizer_state in _quantizer_states(modelopt_state):
        if quantizer_state is not None:
            local = ((to_local(n), v) for n, v in quantizer_state.items())
            quantizer_state = {n: v for n, v in local if n is not None}
        states.append(quantizer_state)
    return _with_quantizer_states(modelopt_state, states)


def has_modelopt_state(checkpoint_dir: str | os.PathLike) -> bool:
    """Whether ``checkpoint_dir`` holds Model Optimizer's state (a quantized model's checkpoint)."""
    return (Path(checkpoint_dir) / MODELOPT_STATE_DIR).is_dir()


def save_modelopt_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """Write Model Optimizer's state of ``model`` to ``<checkpoint_dir>/modelopt_state``; collective over all ranks.

    ``ValueError`` when ``model`` was not converted by Model Optimizer (nothing to save).
    """
    mo = modelopt_modules("saving a quantized checkpoint")
    if not mo.mto.ModeloptStateManager.is_converted(model):
        raise ValueError(f"{type(model).__name__} was not quantized or otherwise converted by Model Optimizer: "
                         "there is no modelopt_state to save")
    _check_no_virtual_pipeline(model)
    state = _global_state(model, mo.mto.modelopt_state(model))
    dist_checkpointing.save({_KEY: state}, Path(checkpoint_dir) / MODELOPT_STATE_DIR)


def _saved_state(checkpoint_dir: str | os.PathLike) -> dict:
    if not has_modelopt_state(checkpoint_dir):
        raise ValueError(f"{checkpoint_dir} holds no {MODELOPT_STATE_DIR}/ (not saved from a quantized model with "
                         "save_modelopt_state)")
    common = dist_checkpointing.load_common_state_dict(Path(checkpoint_dir) / MODELOPT_STATE_DIR)
    if _KEY not in common:
        raise ValueError(f"{checkpoint_dir}/{MODELOPT_STATE_DIR} has no {_KEY!r} entry; found {sorted(common)}")
    return common[_KEY]


def checkpoint_recipe(checkpoint_dir: str | os.PathLike) -> str:
    """The name of the quantization config a checkpoint's model was quantized with (see ``recipes.recipe_of``)."""
    from megatron_core.post_training.modelopt.recipes import recipe_of

    return recipe_of(_saved_state(checkpoint_dir))


def check_checkpoint_recipe(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> None:
    """``ValueError`` naming both recipes when ``model`` is quantized otherwise than the checkpoint's model.

    Call before loading a quantized checkpoint's state dict into an already quantized model (its
    quantizer buffers would not fit, or worse, fit and mean something else).
    """
    from megatron_core.post_training.modelopt.recipes import recipe_of

    mo = modelopt_modules("checking a quantized checkpoint")
    saved = _saved_state(checkpoint_dir)
    ours = mo.mto.modelopt_state(model) if mo.mto.ModeloptStateManager.is_converted(model) else {}
    if repr(_quantize_config(saved)) != repr(_quantize_config(ours)):
        raise ValueError(f"{checkpoint_dir} was quantized with {recipe_of(saved)}, but this {type(model).__name__} "
                         f"is quantized with {recipe_of(ours)}; quantize the model with the checkpoint's recipe, or "
                         "load the checkpoint into a freshly built model with load_modelopt_state")


def _quantize_config(state: dict) -> object:
    """The quantize mode's config recorded in a Model Optimizer state (``None`` when unquantized)."""
    return dict(state.get("modelopt_state_dict", [])).get("quantize", {}).get("config")


def load_modelopt_state(model: torch.nn.Module, checkpoint_dir: str | os.PathLike) -> torch.nn.Module:
    """Convert a freshly built ``model`` the way the checkpoint's model was (quantizers re-created, empty).

    Call before loading the model's own sharded state dict from ``checkpoint_dir``, so that dict
    requests the quantizer buffers too. Returns the converted model (the same object).
    ``ValueError`` when the checkpoint has no Model Optimizer state or ``model`` is already converted
    (naming both recipes when they differ).
    """
    from megatron_core.post_training.modelopt import register_quant_modules

    mo = modelopt_modules("loading a quantized checkpoint")
    register_quant_modules()
    saved = _saved_state(checkpoint_dir)
    if mo.mto.ModeloptStateManager.is_converted(model):
        check_checkpoint_recipe(model, checkpoint_dir)
        raise ValueError(f"{type(model).__name__} is already converted by Model Optimizer; load a quantized "
                         "checkpoint into a freshly built model")
    _check_no_virtual_pipeline(model)
    from megatron_core.post_training.modelopt.quant_moe import modelopt_state_for

    return mo.mto.restore_from_modelopt_state(model, modelopt_state_for(model, _local_state(model, saved)))
