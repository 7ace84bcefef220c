"""Checkpointing of the rerun state machine and the tracker-file reader (a mixin of ``RerunStateMachine``).

The saved state is plain data (enum values, lists), so it loads with ``torch.load(weights_only=True)``;
the per-rank part is a ``ShardedObject`` keyed ``rerun_state_machine_state`` over the world.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import torch

from megatron_core._rank_utils import log_single_rank
from megatron_core._rerun_parts import Call, Caller, RerunMode, RerunState

logger = logging.getLogger("megatron_core.rerun_state_machine")

_TRACKER_LINE = re.compile(
    r"ts=.+ node=.+ device=.+ jobID=(.+) rank=(.+) iteration=(.+) status=(.+) result=.+ message=.+"
)
_SKIP_STATUSES = ("RERUN_DISABLED", "FIRST_RERUN_REPRODUCIBLE", "SECOND_RERUN_REPRODUCIBLE")


def _call_to_plain(call: Call | None) -> list | None:
    return None if call is None else [call.caller.message, call.caller.rank, call.sequence]


def _call_from_plain(value: Any) -> Call | None:
    if value is None or isinstance(value, Call):
        return value
    message, rank, sequence = value
    return Call(caller=Caller(message=message, rank=int(rank)), sequence=int(sequence))


class RerunCheckpointMixin:
    """``state_dict`` / ``load_state_dict`` / ``validate_state_dict`` of the rerun state machine."""

    def state_dict(self, data_iterator: Any, ckpt_format: str, force: bool = False) -> dict[str, Any] | None:
        """The machine's checkpoint entry, or None when disabled or ``ckpt_format`` is not ``torch_dist``.

        ``force=True`` always builds it (a template for loading). Data-iterator buffers are saved only
        while a re-run is pending.
        """
        from megatron_core.dist_checkpointing.mapping import ShardedObject

        if not force:
            if self.mode == RerunMode.DISABLED:
                return None
            if ckpt_format != "torch_dist":
                log_single_rank(logger, logging.WARNING,
                                "RerunStateMachine state is only checkpointed with ckpt_format='torch_dist'")
                return None
        iterator_states = None
        if self.state != RerunState.NOT_RUNNING_YET or force:
            iterators = self._sanitize_data_iterators(data_iterator)
            iterator_states = [it.state_dict() for it in iterators] or None
        per_rank = {
            "rerun_requested": self.rerun_requested,
            "checkpoint_requested": self.checkpoint_requested,
            "restart_again_requested": self.restart_again_requested,
            "continue_requested": self.continue_requested,
            "error_injector_checkpoint": self.error_injector.state_dict(),
            "failed_validation_call": _call_to_plain(self.failed_validation_call),
            "initial_result": self.initial_result,
            "suspicious_node": self.suspicious_node,
            "suspicious_device": self.suspicious_device,
            "data_iterator_checkpoints": iterator_states,
            "large_value_counts": self.large_value_counts,
            "max_values": self.max_values,
        }
        ready = torch.distributed.is_available() and torch.distributed.is_initialized()
        world = torch.distributed.get_world_size() if ready else 1
        rank = torch.distributed.get_rank() if ready else 0
        return {
            "mode": self.mode.value,
            "state": self.state.value,
            "current_iteration": self.current_iteration,
            "sharded": ShardedObject("rerun_state_machine_state", per_rank, (world,), (rank,)),
        }

    def validate_state_dict(self, state_dict: dict[str, Any] | None) -> bool:
        """Whether a loaded entry holds a pending re-run worth restoring."""
        if state_dict is None or "state" not in state_dict:
            return False
        return RerunState(_enum_value(state_dict["state"])) != RerunState.NOT_RUNNING_YET

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a machine saved by :meth:`state_dict` (ignored while this machine is disabled)."""
        if self.mode == RerunMode.DISABLED:
            log_single_rank(logger, logging.WARNING,
                            "RerunStateMachine is disabled: ignoring the machine state saved in the checkpoint")
            return
        log_single_rank(logger, logging.WARNING, "Restoring RerunStateMachine state from the checkpoint")
        self.mode = RerunMode(_enum_value(state_dict["mode"]))
        self.current_iteration = state_dict["current_iteration"]
        self.state = RerunState(_enum_value(state_dict["state"]))
        sharded = state_dict["sharded"]
        sharded = getattr(sharded, "data", sharded)
        for key in ("rerun_requested", "checkpoint_requested", "restart_again_requested", "continue_requested",
                    "initial_result", "suspicious_node", "suspicious_device", "large_value_counts", "max_values"):
            setattr(self, key, sharded[key])
        self.data_iterator_checkpoints = sharded["data_iterator_checkpoints"]
        self.error_injector.load_state_dict(sharded["error_injector_checkpoint"])
        self.failed_validation_call = _call_from_plain(sharded["failed_validation_call"])

    @classmethod
    def get_skipped_iterations_from_tracker_file(cls, tracker_file_name: str) -> list[int]:
        """Iterations to skip: rejected twice on the same rank (with reruns off or reproduced), on one rank only."""
        potentially_skip: set[int] = set()
        multi_rank: set[int] = set()
        seen: set[tuple[int, int]] = set()
        ranks_by_job: dict[str, dict[int, set[int]]] = {}
        try:
            with open(tracker_file_name) as f:
                for line in f:
                    match = _TRACKER_LINE.search(line)
                    if not match:
                        continue
                    job, rank, iteration = match[1], int(match[2]), int(match[3])
                    status = match[4].split(".")[-1].upper()
                    if status not in _SKIP_STATUSES:
                        continue
                    if (rank, iteration) in seen:
                        potentially_skip.add(iteration)
                    seen.add((rank, iteration))
                    ranks = ranks_by_job.setdefault(job, {}).setdefault(iteration, set())
                    ranks.add(rank)
                    if len(ranks) > 1:
                        multi_rank.add(iteration)
        except (OSError, ValueError) as error:
            log_single_rank(logger, logging.ERROR, f"Could not parse the tracker file {tracker_file_name}: {error}")
        skip = sorted(potentially_skip - multi_rank)
        log_single_rank(logger, logging.WARNING, f"Will skip these iterations from tracker file: {skip}")
        if multi_rank:
            log_single_rank(logger, logging.WARNING,
                            f"Will not skip these iterations due to multiple rank errors: {sorted(multi_rank)}")
        return skip


def _enum_value(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value
