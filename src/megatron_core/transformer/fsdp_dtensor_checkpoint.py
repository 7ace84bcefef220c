"""State-dict helpers of the ``fsdp_dtensor`` checkpoint format (Megatron-Core's ``fsdp_dtensor_checkpoint``).

The format saves a model's ``state_dict()`` (FSDP2 ``DTensor`` shards, or plain tensors) and its
optimizer's per-parameter states with ``torch.distributed.checkpoint`` (DCP), which reshards
DTensors across data-parallel sizes by itself. What DCP cannot see is fixed here first:

- routed experts are renamed from their local index on this expert-parallel rank to their global
  index (``handle_experts_in_state_dict``; ``local_experts.<i>.`` of ``SequentialMLP``,
  ``linear_fc1.weight<i>`` of ``TEGroupedMLP``), so a checkpoint saved at EP=2 loads at EP=1;
  the offset comes from the expert-parallel group (``pg_collection.ep`` or ``parallel_state``);
- fused tensors are cut into sections stored as separate tensors: a gated ``linear_fc1``
  (``[gate; up]``) into ``<key>_w`` / ``<key>_v`` (``handle_swiglu_in_state_dict``), the gated
  delta net's ``in_proj.weight`` into ``.query/.key/.value/.z/.beta/.alpha`` and ``conv1d`` into
  ``.query/.key/.value`` (``handle_gdn_in_state_dict``). The sections are views of the parameters
  (see :mod:`.fsdp_dtensor_row_split`), so a DCP load into them fills the parameters in place;
- Transformer Engine's ``_extra_state`` entries are dropped (``handle_fp8_extra_state_case``).

An optimizer state dict here is ``{"state": {model state-dict key: {state name: tensor}}}``, keyed
like the model's state dict. ``get_global_unique_param_name`` names a parameter the same way on
every pipeline and expert-parallel rank (global layer and expert indices).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

import torch
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_core._ground import get_pg_rank, get_pg_size, module_chain
from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.process_groups_config import resolve_process_group
from megatron_core.transformer.fsdp_dtensor_row_split import local_data, row_piece_region, split_rows

logger = logging.getLogger(__name__)

__all__ = [
    "expert_param_local_key", "flatten_state_dict", "get_ep_layer_offset", "get_expert_index_from_key",
    "get_global_unique_param_name", "get_total_num_experts", "global_param_names", "handle_experts_in_state_dict",
    "handle_fp8_extra_state_case", "handle_gdn_in_state_dict", "handle_swiglu_in_state_dict",
    "print_diff_in_state_dicts", "validate_loaded_state_dict",
]

_GROUPED_EXPERT = re.compile(r"^(.*\.)?mlp\.experts\.linear_fc(\d)\.(weight|bias)(\d+)(_w|_v)?$")
_SEQUENTIAL_EXPERT = re.compile(r"^(.*\.)?mlp\.experts\.local_experts\.(\d+)\.")
GDN_IN_PROJ_NAMES = ["query", "key", "value", "z", "beta", "alpha"]
GDN_CONV1D_NAMES = ["query", "key", "value"]


def get_ep_layer_offset(num_experts: int | None = None, pg_collection: Any = None) -> int:
    """Global index of this expert-parallel rank's first expert (``ep_rank * num_experts / ep_size``); 0 without
    experts. The EP group is ``pg_collection.ep`` (or ``parallel_state``'s)."""
    if not num_experts:
        return 0
    group = resolve_process_group("ep", pg_collection)
    ep_size, ep_rank = get_pg_size(group), get_pg_rank(group)
    if num_experts % ep_size:
        raise ValueError(f"num_experts ({num_experts}) must be divisible by the expert-parallel size ({ep_size})")
    return ep_rank * (num_experts // ep_size)


def get_total_num_experts(num_experts: int | None = None) -> int:
    """The model's number of routed experts (0 for ``None``)."""
    return num_experts or 0


def get_expert_index_from_key(key: str) -> int | None:
    """The expert index in a routed-expert key, ``None`` for other keys.

    ``...mlp.experts.linear_fc1.weight3`` (grouped experts, also with a ``_w`` / ``_v`` suffix) and
    ``...mlp.experts.local_experts.3.linear_fc1.weight`` (sequential experts) both give 3.
    """
    if "mlp.experts.linear_fc" in key:
        m = _GROUPED_EXPERT.match(key)
        if m is None:
            raise ValueError(f"cannot parse the expert index of {key!r} (expected ...mlp.experts.linear_fc<n>."
                             "weight<index>)")
        return int(m.group(4))
    if "mlp.experts.local_experts." in key:
        m = _SEQUENTIAL_EXPERT.match(key)
        if m is None:
            raise ValueError(f"cannot parse the expert index of {key!r} (expected ...local_experts.<index>.)")
        return int(m.group(2))
    return None


def _with_expert_index(key: str, old: int, new: int) -> str:
    m = _GROUPED_EXPERT.match(key)
    if m is not None:
        head = key[:m.start(4)]
        return f"{head}{new}{key[m.end(4):]}"
    m = _SEQUENTIAL_EXPERT.match(key)
    if m is not None:
        return f"{key[:m.start(2)]}{new}{key[m.end(2):]}"
    raise ValueError(f"unexpected expert key format: {key!r}")


def handle_experts_in_state_dict(state_dict: dict[str, Any], num_experts: int | None = None,
                                 pg_collection: Any = None) -> dict[str, Any]:
    """A copy of ``state_dict`` with each local expert key renamed to its global expert index.

    Local index ``i`` on the EP rank whose first expert is ``offset`` becomes ``i + offset``; as in
    Megatron-Core, keys whose index already lies in ``[offset, num_experts)`` are kept.
    """
    offset = get_ep_layer_offset(num_experts, pg_collection)
    total = get_total_num_experts(num_experts)
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        index = get_expert_index_from_key(key)
        if index is not None and not offset <= index < total:
            key = _with_expert_index(key, index, index + offset)
        if key in out:
            raise ValueError(f"renaming experts to global indices maps two entries onto {key!r}")
        out[key] = value
    return out


def expert_param_local_key(key: str, num_experts: int | None = None, pg_collection: Any = None) -> str:
    """The local (this EP rank's) key of a global expert key; other keys are returned unchanged."""
    index = get_expert_index_from_key(key)
    if index is None:
        return key
    return _with_expert_index(key, index, index - get_ep_layer_offset(num_experts, pg_collection))


def innermost(model: torch.nn.Module) -> torch.nn.Module:
    """The model inside every wrapper (the last module of the ``.module`` chain): the owner of the state-dict keys."""
    *_, inner = module_chain(model)
    return inner


def _inner(model: Any) -> torch.nn.Module:
    return innermost(model[0] if isinstance(model, (list, tuple)) else model)


def _gated_fc1_prefixes(model: torch.nn.Module) -> dict[str, bool]:
    """``{"<module path>.linear_fc1.": uses a gated linear unit}`` for every module holding a ``linear_fc1``."""
    out = {}
    for name, module in model.named_modules():
        if hasattr(module, "linear_fc1") and hasattr(module, "config"):
            out[f"{name}.linear_fc1." if name else "linear_fc1."] = bool(module.config.gated_linear_unit)
    return out


def _local_fc1_key(key: str, num_experts: int | None, pg_collection: Any) -> str:
    """The key the model itself uses (experts under their local index)."""
    return expert_param_local_key(key, num_experts, pg_collection) if num_experts else key


def _is_glu_fc1(key: str, prefixes: dict[str, bool], num_experts: int | None, pg_collection: Any) -> bool:
    local = _local_fc1_key(key, num_experts, pg_collection)
    head, sep, leaf = local.rpartition("linear_fc1.")
    return bool(sep) and re.fullmatch(r"(weight|bias)\d*", leaf) is not None and prefixes.get(head + sep, False)


def _split_entries(state: dict[str, Any], key: str, sizes: list[int], names: list[str]) -> None:
    """Replace ``state[key]`` by its row sections ``state[name]`` (sections this rank holds no row of are left out)."""
    pieces = split_rows(state.pop(key), sizes, names)
    for name, piece in zip(names, pieces):
        if piece is not None:
            state[name] = piece


def _split_optimizer_state(optimizer_state_dict: dict[str, Any] | None, match: Any) -> dict[str, Any] | None:
    """The optimizer state dict with every tensor state of a matched key split like the parameter.

    ``match(key)`` gives ``(sizes, section keys)`` or ``None``. Scalar states (``step``) are copied to each section.
    """
    if optimizer_state_dict is None:
        return None
    out = dict(optimizer_state_dict)
    new_state: dict[str, Any] = {}
    for key, per_param in optimizer_state_dict.get("state", {}).items():
        found = match(key)
        if found is None:
            new_state[key] = per_param
            continue
        sizes, names = found
        sections: list[dict[str, Any]] = [{} for _ in names]
        for state_name, value in per_param.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                for section, piece in zip(sections, split_rows(value, sizes, names)):
                    if piece is not None:
                        section[state_name] = piece
            else:
                for section in sections:
                    section[state_name] = value
        for name, section in zip(names, sections):
            if any(isinstance(v, torch.Tensor) and v.dim() > 0 for v in section.values()):
                new_state[name] = section
    out["state"] = new_state
    return out


def handle_swiglu_in_state_dict(model: Any, model_state_dict: dict[str, Any],
                                optimizer_state_dict: dict[str, Any] | None, num_experts: int | None = None,
                                pg_collection: Any = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Split every gated ``linear_fc1`` weight/bias ``[gate; up]`` into ``<key>_w`` (gate) and ``<key>_v`` (up).

    Only ``linear_fc1`` of modules whose config has ``gated_linear_unit=True`` is split (a model may
    mix gated and plain MLPs). ``num_experts`` is needed when expert keys were already renamed to global
    indices. Returns new ``(model_state_dict, optimizer_state_dict)``; the sections are views of the
    original tensors (see the module docstring).
    """
    prefixes = _gated_fc1_prefixes(_inner(model))

    def is_glu(key: str) -> bool:
        return _is_glu_fc1(key, prefixes, num_experts, pg_collection)

    def halves(key: str, value: torch.Tensor) -> tuple[list[int], list[str]]:
        rows = value.shape[0]
        if rows % 2:
            raise ValueError(f"{key}: a gated linear_fc1 needs an even number of rows, got {tuple(value.shape)}")
        return [rows // 2, rows // 2], [f"{key}_w", f"{key}_v"]

    model_state_dict = dict(model_state_dict)
    for key in list(model_state_dict):
        if is_glu(key):
            _split_entries(model_state_dict, key, *halves(key, model_state_dict[key]))

    def opt_match(key: str) -> tuple[list[int], list[str]] | None:
        if not is_glu(key):
            return None
        state = optimizer_state_dict["state"][key]
        tensor = next(v for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
        return halves(key, tensor)

    return model_state_dict, _split_optimizer_state(optimizer_state_dict, opt_match)


def _gdn_sections(model: torch.nn.Module) -> dict[str, tuple[list[int], list[str]]]:
    """``{state-dict key: (row sections, names)}`` of every gated delta net's fused tensors."""
    out = {}
    for name, module in model.named_modules():
        if not all(hasattr(module, a) for a in ("qk_dim", "v_dim", "in_proj_dim", "in_proj_split_sections")):
            continue
        prefix = f"{name}." if name else ""
        out[f"{prefix}in_proj.weight"] = (list(module.in_proj_split_sections), GDN_IN_PROJ_NAMES)
        conv = [module.qk_dim_local_tp, module.qk_dim_local_tp, module.v_dim_local_tp]
        out[f"{prefix}conv1d.weight"] = (conv, GDN_CONV1D_NAMES)
        out[f"{prefix}conv1d.bias"] = (conv, GDN_CONV1D_NAMES)
    return out


def handle_gdn_in_state_dict(model: Any, model_state_dict: dict[str, Any],
                             optimizer_state_dict: dict[str, Any] | None
                             ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """Split each gated delta net's ``in_proj.weight`` into ``.query/.key/.value/.z/.beta/.alpha`` and its
    ``conv1d.weight`` / ``conv1d.bias`` into ``.query/.key/.value`` (Megatron-Core's checkpoint sub-keys).

    Returns new ``(model_state_dict, optimizer_state_dict)`` whose sections are views of the original tensors.
    """
    table = _gdn_sections(_inner(model))
    if not table:
        return model_state_dict, optimizer_state_dict

    def match(key: str) -> tuple[list[int], list[str]] | None:
        found = table.get(key)
        return None if found is None else (found[0], [f"{key}.{n}" for n in found[1]])

    model_state_dict = dict(model_state_dict)
    for key in list(model_state_dict):
        found = match(key)
        if found is not None:
            _split_entries(model_state_dict, key, *found)
    return model_state_dict, _split_optimizer_state(optimizer_state_dict, match)


def handle_fp8_extra_state_case(model_state_dict: dict[str, Any]) -> None:
    """Drop the ``._extra_state`` entries (FP8 metadata of Transformer Engine modules) in place."""
    for key in [k for k in model_state_dict if k.endswith("._extra_state") or k == "_extra_state"]:
        del model_state_dict[key]


def flatten_state_dict(obj: Any, parent_key: str = "", sep: str = ".") -> dict[str, Any]:
    """A nested dict / list flattened into ``{"a.b.0.c": leaf}`` (list items under their index)."""
    if isinstance(obj, dict):
        items: Iterable[tuple[Any, Any]] = obj.items()
    elif isinstance(obj, list):
        items = enumerate(obj)
    else:
        return {parent_key: obj}
    out: dict[str, Any] = {}
    for k, v in items:
        out.update(flatten_state_dict(v, f"{parent_key}{sep}{k}" if parent_key else str(k), sep))
    return out


def state_dict_differences(state_dict_metadata: dict[str, Any], load_state_dict: dict[str, Any]
                           ) -> tuple[list[str], list[str], list[tuple[str, tuple, tuple]]]:
    """``(keys only in the checkpoint, keys only in the request, (key, saved shape, requested shape))``."""
    meta = flatten_state_dict(state_dict_metadata)
    load = flatten_state_dict(load_state_dict)
    shapes = []
    for key in sorted(meta.keys() & load.keys()):
        saved = getattr(meta[key], "size", None)
        wanted = getattr(load[key], "shape", None)
        if saved is not None and wanted is not None and tuple(saved) != tuple(wanted):
            shapes.append((key, tuple(saved), tuple(wanted)))
    return sorted(meta.keys() - load.keys()), sorted(load.keys() - meta.keys()), shapes


def print_diff_in_state_dicts(state_dict_metadata: dict[str, Any], load_state_dict: dict[str, Any],
                              limit: int = 100) -> None:
    """Log the keys only in the checkpoint metadata, only in the state dict to load, and those whose shapes differ
    (at most ``limit`` of each)."""
    only_meta, only_load, shapes = state_dict_differences(state_dict_metadata, load_state_dict)
    logger.info("Keys only in checkpoint metadata_state_dict (first %d): %s", limit, only_meta[:limit])
    logger.info("Keys only in load_state_dict (first %d): %s", limit, only_load[:limit])
    logger.info("Keys in both but with different shapes (first %d): %s", limit,
                [f"{k}: meta shape={a}, load shape={b}" for k, a, b in shapes[:limit]])


def validate_loaded_state_dict(state_dict: dict[str, Any], checkpoint_path: str) -> None:
    """Check that every tensor of ``state_dict`` equals the checkpoint's (collective).

    Each rank reads the whole saved tensors of its keys and compares the part it holds (DTensor rows,
    uneven sections, or all of a plain tensor); ``CheckpointingException`` names the first key that differs.
    """
    import torch.distributed.checkpoint as dcp

    from megatron_core.dist_checkpointing.strategies.cached_metadata_filesystem_reader import (
        CachedMetadataFileSystemReader,
    )

    reader = CachedMetadataFileSystemReader(checkpoint_path, cache_metadata=False)
    saved = reader.read_metadata().state_dict_metadata
    flat = {k: v for k, v in flatten_state_dict(state_dict).items() if isinstance(v, torch.Tensor)}
    missing = sorted(k for k in flat if k not in saved or not hasattr(saved[k], "size"))
    if missing:
        raise CheckpointingException(f"{checkpoint_path} holds no tensor for {missing[:10]}")
    full = {k: torch.empty(tuple(saved[k].size), dtype=saved[k].properties.dtype) for k in flat}
    dcp.load(full, storage_reader=reader, planner=TensorOnlyLoadPlanner())
    for key, value in flat.items():
        region = row_piece_region(value)
        expected = full[key] if region is None else full[key][region[0]:region[1]]
        got = local_data(value).detach().cpu()
        if got.shape != expected.shape or not torch.allclose(got.to(expected.dtype), expected, atol=1e-8, rtol=1e-5):
            raise CheckpointingException(f"{checkpoint_path}: {key!r} differs from the loaded value "
                                         f"(rows {region or 'all'}, shape {tuple(got.shape)})")


class TensorOnlyLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner that refuses pickled entries: DCP would unpickle them with
    ``weights_only=False``; the ``fsdp_dtensor`` format stores tensors only."""

    def load_bytes(self, read_item: Any, value: Any) -> None:
        """Refuse: a tensor-only load never reads pickled bytes."""
        raise CheckpointingException(f"refusing to unpickle checkpoint entry {read_item.dest_index.fqn!r}: the "
                                     "fsdp_dtensor format stores tensors only")


def _layer_renames(chunk: torch.nn.Module) -> list[tuple[str, str]]:
    """``(old prefix, new prefix)``: transformer layers under their global index, experts under theirs."""
    renames = []
    for module_name, module in chunk.named_modules():
        layer = re.fullmatch(r"(.*\.)?layers\.(\d+)", module_name)
        if layer and isinstance(getattr(module, "layer_number", None), int) and "mtp" not in module_name:
            renames.append((f"{module_name}.", f"{layer.group(1) or ''}layers.{module.layer_number - 1}."))
        experts = getattr(module, "local_experts", None)
        if isinstance(experts, torch.nn.ModuleList) and hasattr(module, "ep_group"):
            first = get_pg_rank(module.ep_group) * len(experts)
            renames += [(f"{module_name}.local_experts.{i}.", f"{module_name}.local_experts.{first + i}.")
                        for i in range(len(experts))]
    return renames


def global_param_names(model_chunks: list[torch.nn.Module]) -> dict[int, str]:
    """``id(param) -> name`` for every parameter of ``model_chunks``, as :func:`get_global_unique_param_name`
    names it (one pass over the chunks; the optimizer's parameter-group map uses it)."""
    names: dict[int, str] = {}
    for chunk in model_chunks:
        renames = _layer_renames(chunk)
        for name, p in chunk.named_parameters():
            names.setdefault(id(p), _rename_all(name, renames))
    return names


def get_global_unique_param_name(model_chunks: list[torch.nn.Module], param: torch.Tensor) -> str:
    """``param``'s name, the same on every rank holding it: transformer layers under their global index
    (``layer_number - 1``, not the index within this pipeline stage) and sequential experts under their global
    index (from the experts' EP group). ``ValueError`` when no chunk holds ``param``."""
    for chunk in model_chunks:
        for name, p in chunk.named_parameters():
            if p is not param:
                continue
            return _rename_all(name, _layer_renames(chunk))
    raise ValueError("parameter not found in model chunks")


def _rename_all(name: str, renames: list[tuple[str, str]]) -> str:
    """Apply the innermost matching expert rename and the matching layer rename (both can apply)."""
    out = name
    expert = [r for r in renames if ".local_experts." in r[0] and name.startswith(r[0])]
    if expert:
        old, new = max(expert, key=lambda r: len(r[0]))
        out = new + name[len(old):]
    layer = [r for r in renames if ".local_experts." not in r[0] and name.startswith(r[0])]
    if layer:
        old, new = max(layer, key=lambda r: len(r[0]))
        out = new + out[len(old):]
    return out
