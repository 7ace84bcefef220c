"""Process groups by role (Megatron-Core's ``ProcessGroupCollection``) and the one group resolver.

Code that wants no globals builds a collection by hand (``pgs = ProcessGroupCollection(); pgs.tp = ...``)
or fills it from ``parallel_state`` with :meth:`ProcessGroupCollection.use_mpu_process_groups`.

Every module that shards or communicates finds its groups through :func:`resolve_process_group`
(or :func:`resolve_pg_collection` for a whole collection), with one precedence:

1. an explicit group argument (``tp_group=...``), when given;
2. else the role's field of an explicit ``pg_collection`` (a field left ``None`` means "no group");
3. else the group registered in ``parallel_state``;
4. else ``None``: no parallelism, size 1 (:func:`megatron_core.utils.get_pg_size`).

Parallel sizes come from the resolved group. A config field that also names a size (for example
``tensor_model_parallel_size``) is checked by :func:`check_parallel_size`: left at its default it
defers to the group; set to anything else it must equal the group's size.
"""

from __future__ import annotations

from collections.abc import ItemsView, Iterator, KeysView, ValuesView
from dataclasses import dataclass, field, fields
from typing import Any

import torch

from megatron_core import parallel_state
from megatron_core._ground import get_pg_size

__all__ = [
    "MultiModuleProcessGroupCollection",
    "ProcessGroupCollection",
    "check_parallel_size",
    "resolve_pg_collection",
    "resolve_process_group",
]


def _data_parallel(with_context_parallel: bool) -> Any:
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_data_parallel_group(with_context_parallel=with_context_parallel)


def _partial_data_parallel(expert: bool) -> Any:
    """The (expert) data-parallel ranks of this rank's distributed optimizer instance (the whole group with one)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    if expert:
        return parallel_state.get_expert_data_parallel_group(check_initialized=False, partial_expert_data_parallel=True)
    return parallel_state.get_data_parallel_group(with_context_parallel=True, partial_data_parallel=True)


_GROUP_GETTERS = {
    "tp": lambda: parallel_state.get_tensor_model_parallel_group(check_initialized=False),
    "pp": lambda: parallel_state.get_pipeline_model_parallel_group(check_initialized=False),
    "mp": lambda: parallel_state.get_model_parallel_group(check_initialized=False),
    "embd": lambda: parallel_state.get_embedding_group(check_initialized=False),
    "pos_embd": lambda: parallel_state.get_position_embedding_group(check_initialized=False),
    "cp": lambda: parallel_state.get_context_parallel_group(check_initialized=False),
    "tp_cp": lambda: parallel_state.get_tensor_and_context_parallel_group(check_initialized=False),
    "hcp": lambda: parallel_state.get_hierarchical_context_parallel_groups(check_initialized=False),
    "ep": lambda: parallel_state.get_expert_model_parallel_group(check_initialized=False),
    "expt_tp": lambda: parallel_state.get_expert_tensor_parallel_group(check_initialized=False),
    "tp_ep": lambda: parallel_state.get_expert_tensor_and_model_parallel_group(check_initialized=False),
    "tp_ep_pp": lambda: parallel_state.get_expert_tensor_model_pipeline_parallel_group(check_initialized=False),
    "tp_dp_cp": lambda: parallel_state.get_tensor_and_data_parallel_group(
        check_initialized=False, with_context_parallel=True
    ),
    "dp": lambda: _data_parallel(False),
    "dp_cp": lambda: _data_parallel(True),
    "expt_dp": lambda: parallel_state.get_expert_data_parallel_group(check_initialized=False),
    "dp_cp_ag": lambda: None,
    "expt_dp_ag": lambda: None,
    "intra_dp_cp": lambda: _partial_data_parallel(expert=False),
    "intra_expt_dp": lambda: _partial_data_parallel(expert=True),
    "inter_dist_opt": lambda: parallel_state.get_inter_distributed_optimizer_instance_group(check_initialized=False),
    "intra_dist_opt": lambda: parallel_state.get_intra_distributed_optimizer_instance_group(check_initialized=False),
}


def _group_field() -> Any:
    return field(init=False, default=None)


@dataclass
class ProcessGroupCollection:
    """Process groups by role; every field is set after construction. Unset roles are ``None``."""

    tp: Any = _group_field()
    pp: Any = _group_field()
    mp: Any = _group_field()
    embd: Any = _group_field()
    pos_embd: Any = _group_field()
    cp: Any = _group_field()
    tp_cp: Any = _group_field()
    hcp: Any = _group_field()  # a list: the hierarchical context-parallel groups, innermost first
    ep: Any = _group_field()
    expt_tp: Any = _group_field()
    tp_ep: Any = _group_field()
    tp_ep_pp: Any = _group_field()
    tp_dp_cp: Any = _group_field()
    dp: Any = _group_field()
    dp_cp: Any = _group_field()
    expt_dp: Any = _group_field()
    # Separate all-gather groups for the distributed optimizer's parameter gather (Megatron-Core's
    # create_all_gather_groups); never filled from parallel_state: callers set them explicitly.
    dp_cp_ag: Any = _group_field()
    expt_dp_ag: Any = _group_field()
    # The partial distributed optimizer (num_distributed_optimizer_instances): the (expert) DP x CP ranks of one
    # optimizer instance, the ranks holding the same optimizer shard across instances, and all ranks of one instance.
    intra_dp_cp: Any = _group_field()
    intra_expt_dp: Any = _group_field()
    inter_dist_opt: Any = _group_field()
    intra_dist_opt: Any = _group_field()

    def __init__(self, **groups: Any) -> None:
        """Set the roles given by keyword (``ProcessGroupCollection(tp=..., pp=...)``, as in Megatron-Core); the
        others stay ``None``. ``ValueError`` naming any unknown role."""
        names = [f.name for f in fields(self)]
        unknown = sorted(set(groups) - set(names))
        if unknown:
            raise ValueError(f"unknown process group names {unknown}; known: {names}")
        for name in names:
            setattr(self, name, groups.get(name))

    def __repr__(self) -> str:
        """The roles that hold a group, with their sizes: ``ProcessGroupCollection(tp(4), hcp([2, 4]))``."""
        active = []
        for f in fields(self):
            group = getattr(self, f.name)
            if isinstance(group, (list, tuple)):
                active.append(f"{f.name}({[g.size() for g in group]})")
            elif group is not None:
                active.append(f"{f.name}({group.size()})")
        return f"ProcessGroupCollection({', '.join(active) or 'empty'})"

    @classmethod
    def use_mpu_process_groups(cls, required_pgs: list[str] | None = None) -> ProcessGroupCollection:
        """A collection filled from ``parallel_state``; ``required_pgs`` limits which roles are read.

        Roles that ``parallel_state`` has not set up (or everything, before
        ``initialize_model_parallel``) are ``None``.
        """
        names = [f.name for f in fields(cls)]
        wanted = names if required_pgs is None else list(required_pgs)
        unknown = [name for name in wanted if name not in names]
        if unknown:
            raise ValueError(f"Invalid process groups requested: {unknown}; known: {names}")
        pgs = cls()
        for name in wanted:
            setattr(pgs, name, _GROUP_GETTERS[name]())
        return pgs


def resolve_process_group(role: str, pg_collection: Any = None, group: Any = None) -> Any:
    """The process group for ``role`` (a ``ProcessGroupCollection`` field name such as ``"tp"``).

    ``group`` when given, else ``pg_collection.<role>`` when a collection is given (``None`` if
    the collection leaves it unset), else ``parallel_state``'s group, else ``None`` (size 1).
    """
    if role not in _GROUP_GETTERS:
        raise ValueError(f"unknown process group role {role!r}; known: {sorted(_GROUP_GETTERS)}")
    if group is not None:
        return group
    if pg_collection is not None:
        return getattr(pg_collection, role, None)
    return _GROUP_GETTERS[role]()


def resolve_tp_group(tp_group: Any = None, pg_collection: Any = None, is_expert: bool = False) -> Any:
    """The (expert) TP group: :func:`resolve_process_group` for role ``"expt_tp"`` when ``is_expert``, else ``"tp"``."""
    return resolve_process_group("expt_tp" if is_expert else "tp", pg_collection=pg_collection, group=tp_group)


def get_tensor_model_parallel_group_if_none(
    tp_group: Any = None, is_expert: bool = False, check_initialized: bool = True
) -> Any:
    """Megatron-Core's helper: ``tp_group``, else the (expert) TP group of ``parallel_state``.

    ``None`` before ``torch.distributed`` is initialised. Otherwise the lookup is
    :func:`resolve_process_group`; when it finds no group, ``check_initialized=True`` raises
    ``parallel_state``'s "not initialized" error, as Megatron-Core does, and
    ``check_initialized=False`` returns ``None`` (no TP, size 1).
    """
    if not torch.distributed.is_initialized():
        return None
    group = resolve_tp_group(tp_group, is_expert=is_expert)
    if group is None and check_initialized:
        getter = (parallel_state.get_expert_tensor_parallel_group if is_expert
                  else parallel_state.get_tensor_model_parallel_group)
        getter(check_initialized=True)
    return group


def resolve_pg_collection(pg_collection: Any = None, required_pgs: list[str] | None = None) -> Any:
    """``pg_collection`` itself when given, else a collection filled from ``parallel_state``."""
    if pg_collection is not None:
        return pg_collection
    return ProcessGroupCollection.use_mpu_process_groups(required_pgs)


def check_parallel_size(config: Any, field_name: str, group: Any, role: str | None = None) -> int:
    """The size of ``group``, after checking that ``config.<field_name>`` does not contradict it.

    A field left at its default (1) defers to the group; any other value must equal the group's
    size, else ``ValueError`` naming both.
    """
    size = get_pg_size(group)
    value = getattr(config, field_name, None) if config is not None else None
    if value is not None and value != 1 and value != size:
        where = f"the {role} process group" if role else "the process group"
        detail = "no group is set up (size 1)" if group is None else f"{where} has {size} ranks"
        raise ValueError(
            f"config.{field_name} is {value} but {detail}; parallel sizes come from the process groups "
            f"(pg_collection, else parallel_state): leave {field_name} at 1 or make it equal the group size"
        )
    return size



@dataclass
class MultiModuleProcessGroupCollection:
    """The process groups of every module a rank runs in a multi-module (e.g. encoder + LLM) pipeline.

    ``module_pgs`` maps each module this rank belongs to onto its :class:`ProcessGroupCollection`;
    ``language_model_module_name`` names the entry holding the language model, or ``None`` when this
    rank runs no language model (an encoder-only rank). Reads like a dict of module collections.
    """

    module_pgs: dict[str, ProcessGroupCollection]
    language_model_module_name: str | None = None

    def __post_init__(self) -> None:
        if not self.module_pgs:
            raise ValueError(f"module_pgs must name at least one module, got {self.module_pgs!r}")
        name = self.language_model_module_name
        if name is not None and name not in self.module_pgs:
            raise ValueError(
                f"language_model_module_name {name!r} is not a key of module_pgs {list(self.module_pgs)}"
            )

    def get_language_model_collection(self) -> ProcessGroupCollection:
        """The language model's collection; ``ValueError`` when this rank runs no language model."""
        if self.language_model_module_name is None:
            raise ValueError(
                f"language_model_module_name is None: no language model among modules {list(self.module_pgs)}"
            )
        return self.module_pgs[self.language_model_module_name]

    def get_language_model_cp_size(self) -> int:
        """Context-parallel size of the language model (1 when its ``cp`` group is unset)."""
        return get_pg_size(self.get_language_model_collection().cp)

    def has_language_model(self) -> bool:
        """Whether this rank runs the language model."""
        return self.language_model_module_name is not None

    def get_module_collection(self, module_name: str) -> ProcessGroupCollection:
        """The collection of ``module_name``; ``ValueError`` naming the known modules if absent."""
        if module_name not in self.module_pgs:
            raise ValueError(f"module {module_name!r} is not in module_pgs; available: {list(self.module_pgs)}")
        return self.module_pgs[module_name]

    def __len__(self) -> int:
        return len(self.module_pgs)

    def __getitem__(self, module_name: str) -> ProcessGroupCollection:
        return self.module_pgs[module_name]

    def __iter__(self) -> Iterator[ProcessGroupCollection]:
        """Iterates over the collections (not the names), as Megatron-Core does."""
        return iter(self.module_pgs.values())

    def keys(self) -> KeysView[str]:
        """Module names."""
        return self.module_pgs.keys()

    def values(self) -> ValuesView[ProcessGroupCollection]:
        """Module collections."""
        return self.module_pgs.values()

    def items(self) -> ItemsView[str, ProcessGroupCollection]:
        """``(module name, collection)`` pairs."""
        return self.module_pgs.items()

    def __repr__(self) -> str:
        lm = f", language_model_module_name={self.language_model_module_name!r}" \
            if self.language_model_module_name else ""
        return f"MultiModuleProcessGroupCollection(modules=[{', '.join(self.module_pgs)}]{lm})"
