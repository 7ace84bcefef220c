"""A ``torch.distributed.checkpoint`` save split into a planning half and a finalizing half
(Megatron-Core's ``strategies.state_dict_saver``).

An asynchronous save runs in three steps: :func:`save_state_dict_async_plan` plans collectively on the
caller's thread and stages this rank's data in a :class:`~.filesystem_async.FileSystemWriterAsync`; the
writer's save function (``writer.get_save_function_and_args()``) writes the files, possibly in the
background; :func:`save_state_dict_async_finalize` gathers every rank's write results and has the
coordinator write DCP's ``.metadata``.

Planning can be skipped in part on repeated saves of the same structure: a validated cached central plan
skips every collective of planning, and a checkpoint's recorded plans (``Metadata.all_local_plans``, which
the decentralized path stores) let :func:`verify_global_md_reuse` skip gathering the plans. In both cases
the planning returns no global metadata and the caller passes the cached metadata to the finalizer.
Only small metadata travels between ranks, through :mod:`megatron_core.dist_checkpointing.collectives`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

from megatron_core.dist_checkpointing import collectives

if TYPE_CHECKING:
    from megatron_core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

logger = logging.getLogger(__name__)

__all__ = ["PlanningGroup", "save_state_dict_async_finalize", "save_state_dict_async_plan", "verify_global_md_reuse"]


WrappedException = tuple[BaseException, traceback.StackSummary]


def _wrap(error: BaseException) -> WrappedException:
    """``(error, its stack)`` as ``CheckpointException`` reports failures; picklable, so it can be gathered."""
    summary = traceback.extract_tb(error.__traceback__)
    for frame in summary:  # Python 3.13 keeps code objects in frames, which do not pickle
        if hasattr(frame, "_code"):
            object.__setattr__(frame, "_code", None)
    return error, summary


def _failures(results: list[Any]) -> dict[int, WrappedException]:
    return {r: v for r, v in enumerate(results)
            if isinstance(v, tuple) and len(v) == 2 and isinstance(v[0], BaseException)}


class PlanningGroup:
    """The ranks that plan one save together and the coordinator among them (the ``dist_wrapper`` of
    Megatron-Core's functions). Without an initialised process group it is a world of one rank.

    Args:
        group: the process group (``None``: the default group).
        coordinator_rank: the coordinator's rank within ``group``.
    """

    def __init__(self, group: Any = None, coordinator_rank: int = 0) -> None:
        self.group = group
        self.coordinator_rank = coordinator_rank
        self.rank = collectives.get_rank(group)
        self.is_coordinator = self.rank == coordinator_rank

    def get_world_size(self) -> int:
        """Number of ranks planning."""
        return collectives.get_world_size(self.group)

    def gather_object(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (by rank) on the coordinator, ``None`` elsewhere."""
        gathered = collectives.all_gather_object(obj, self.group)
        return gathered if self.is_coordinator else None

    def reduce_scatter(self, local_fn: Callable[[], SavePlan],
                       global_fn: Callable[[list[SavePlan]], list[SavePlan]]) -> SavePlan:
        """This rank's share of ``global_fn(every rank's local_fn())``, computed by the coordinator.

        An error in either step raises ``CheckpointException`` on every rank (naming the failing ranks).
        """
        try:
            local: Any = local_fn()
        except Exception as error:  # noqa: BLE001 - reported to every rank below
            local = _wrap(error)
        gathered = collectives.all_gather_object(local, self.group)
        payload: tuple[list[SavePlan] | None, dict[int, WrappedException]]
        payload = (None, {})
        if self.is_coordinator:
            failures = _failures(gathered)
            if not failures:
                try:
                    payload = (global_fn(gathered), {})
                except Exception as error:  # noqa: BLE001 - reported to every rank below
                    failures = {self.rank: _wrap(error)}
            if failures:
                payload = (None, failures)
        plans, failures = collectives.broadcast_object(payload, self.coordinator_rank, self.group)
        if failures:
            raise CheckpointException("plan", failures)
        return plans[self.rank]


def _plan_differences(a: SavePlan, b: SavePlan) -> list[str]:
    """The fields other than ``storage_data`` in which two save plans differ."""
    return [f.name for f in dataclasses.fields(a)
            if f.name != "storage_data" and getattr(a, f.name) != getattr(b, f.name)]


def save_state_dict_async_plan(
    state_dict: STATE_DICT_TYPE,
    storage_writer: FileSystemWriterAsync,
    process_group: Any = None,
    coordinator_rank: int = 0,
    planner: SavePlanner | None = None,
    cached_ckpt_structure: tuple[SavePlan | None, SavePlan | None, bool] | None = None,
    loaded_all_plans: list[SavePlan] | None = None,
) -> tuple[tuple[FileSystemWriterAsync, Metadata | None, PlanningGroup], SavePlan, SavePlan, bool, bool]:
    """Plan a DCP save of ``state_dict`` and stage this rank's data in ``storage_writer`` (first half of a save).

    Args:
        state_dict: the DCP state dict (e.g. :func:`~.torch.mcore_to_pyt_state_dict`'s output).
        storage_writer: a :class:`~.filesystem_async.FileSystemWriterAsync`.
        process_group: the ranks that plan together (``None``: the default group).
        coordinator_rank: the rank (within ``process_group``) that builds the global plan and metadata.
        planner: the DCP save planner (default ``DefaultSavePlanner()``).
        cached_ckpt_structure: ``(central plan, local plan, validated)`` returned by the previous call for the
            same structure. A cached local plan is reused instead of being recreated; when ``validated`` (the
            previous call's central plan equalled the one cached before it) the cached central plan is used
            and planning runs no collective.
        loaded_all_plans: every rank's local plan recorded in a checkpoint's metadata (its
            ``all_local_plans``); when they match this save's (:func:`verify_global_md_reuse`), the plans are
            not gathered and that checkpoint's metadata is to be reused.

    Returns:
        ``((storage_writer, global metadata, planning group), central plan, local plan, cache validated,
        loaded metadata reusable)``. The first element is :func:`save_state_dict_async_finalize`'s arguments;
        its metadata is ``None`` on non-coordinator ranks and whenever cached or loaded metadata is to be
        reused, in which case the caller puts that metadata there on the coordinator. The next three values
        form the next call's ``cached_ckpt_structure``.
    """
    cached_central_plan, cached_local_plan, validated_cache_reuse = cached_ckpt_structure or (None, None, False)
    group = PlanningGroup(process_group, coordinator_rank)
    planner = DefaultSavePlanner() if planner is None else planner
    global_metadata: Metadata | None = None
    local_plan = cached_local_plan
    global_md_verify_reuse = False

    def local_step() -> SavePlan:
        nonlocal local_plan
        planner.set_up_planner(state_dict, is_coordinator=group.is_coordinator)
        storage_writer.set_up_storage_writer(group.is_coordinator, rank=group.rank, use_collectives=True)
        if local_plan is None:
            local_plan = planner.create_local_plan()
        local_plan = storage_writer.prepare_local_plan(local_plan)
        return local_plan

    def global_step(all_local_plans: list[SavePlan]) -> list[SavePlan]:
        nonlocal global_metadata
        all_local_plans, global_metadata = planner.create_global_plan(all_local_plans)
        return storage_writer.prepare_global_plan(all_local_plans)

    start = time.monotonic()
    if validated_cache_reuse and cached_central_plan is not None:
        logger.debug("rank %d: reusing the cached central save plan", group.rank)
        local_step()
        central_plan = cached_central_plan
    elif getattr(planner, "can_run_decentralized_global_plan", False) and getattr(
            storage_writer, "can_run_decentralized_global_plan", False):
        local_plan = local_step()
        global_md_verify_reuse = verify_global_md_reuse(loaded_all_plans, local_plan, group.rank, group)
        if not global_md_verify_reuse:
            all_local_plans = group.gather_object(local_plan)
            if group.is_coordinator:
                _, global_metadata = planner.create_global_plan(all_local_plans)
                global_metadata.all_local_plans = all_local_plans  # recorded so a later save may reuse it
        else:
            logger.debug("rank %d: the loaded checkpoint's global metadata will be reused", group.rank)
        local_plan = planner.create_decentralized_global_plan(local_plan)
        central_plan = storage_writer.prepare_decentralized_global_plan(local_plan)
    else:
        central_plan = group.reduce_scatter(local_step, global_step)
    central_plan = planner.finish_plan(central_plan)
    logger.debug("rank %d: save planned in %.3f s", group.rank, time.monotonic() - start)
    storage_writer.prepare_write_data(central_plan, planner)
    return ((storage_writer, global_metadata, group), central_plan, local_plan,
            cached_central_plan == central_plan, global_md_verify_reuse)


def verify_global_md_reuse(loaded_all_plans: list[SavePlan] | None, local_plan: SavePlan, rank: int,
                           dist_wrapper: PlanningGroup) -> bool:
    """True on every rank when every rank's ``local_plan`` equals its plan in ``loaded_all_plans`` (all fields
    but ``storage_data``), so that checkpoint's global metadata describes this save too.

    False without loaded plans or when they come from a different number of ranks. A collective over
    ``dist_wrapper.group`` whenever the plan count matches.
    """
    if not loaded_all_plans:
        logger.debug("global metadata reuse: no loaded plans")
        return False
    if len(loaded_all_plans) != dist_wrapper.get_world_size():
        logger.debug("global metadata reuse: %d loaded plans for %d ranks", len(loaded_all_plans),
                     dist_wrapper.get_world_size())
        return False
    differences = _plan_differences(local_plan, loaded_all_plans[rank])
    if differences:
        logger.debug("global metadata reuse: rank %d's plan differs from the loaded one in %s", rank, differences)
    return not collectives.any_rank_true(bool(differences), dist_wrapper.group)


def save_state_dict_async_finalize(storage_writer: FileSystemWriterAsync, global_metadata: Metadata | None,
                                   dist_wrapper: PlanningGroup) -> None:
    """Gather every rank's write results and write ``.metadata`` on the coordinator (second half of a save).

    The arguments are the first element of :func:`save_state_dict_async_plan`'s result, with the cached
    metadata on the coordinator where it was to be reused; call it on every rank after the write function
    ran. A write failure on any rank (or the coordinator's failure to write the metadata) raises
    ``CheckpointException`` on every rank; the coordinator's names each failing rank's error.
    """
    try:
        write_results: Any = storage_writer.retrieve_write_results()
    except Exception as error:  # noqa: BLE001 - gathered, so every rank fails together
        write_results = _wrap(error)
    start = time.monotonic()
    all_results = dist_wrapper.gather_object(write_results)
    logger.debug("rank %d: write results gathered in %.3f s", dist_wrapper.rank, time.monotonic() - start)
    failures: dict[int, WrappedException] = {}
    if dist_wrapper.is_coordinator:
        failures = _failures(all_results)
        if not failures:
            try:
                if global_metadata is None:
                    raise ValueError("save_state_dict_async_finalize: the coordinator needs the global metadata "
                                     "(pass the cached metadata when planning reused it)")
                storage_writer.finish(global_metadata, all_results)
            except Exception as error:  # noqa: BLE001 - reported to every rank below
                failures = {dist_wrapper.rank: _wrap(error)}
    if collectives.broadcast_object(bool(failures), dist_wrapper.coordinator_rank, dist_wrapper.group):
        raise CheckpointException("write", failures)
