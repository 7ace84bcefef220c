"""Reporting helpers of the rerun state machine: spike detection, determinism statistics and the
rejected-results tracker file (a mixin of ``RerunStateMachine``)."""

from __future__ import annotations

import datetime
import logging
import math
import os
from typing import Any

import torch

from megatron_core import device
from megatron_core._rank_utils import safe_get_rank
from megatron_core._rerun_parts import RerunValidationStatus

logger = logging.getLogger("megatron_core.rerun_state_machine")


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class RerunReportingMixin:
    """``is_unexpectedly_large``, determinism statistics and the tracker file."""

    def is_unexpectedly_large(self, result: torch.Tensor, threshold: float, context: str, num_samples: int = 100,
                              resample: bool = False) -> bool:
        """Rejection function: ``abs(result) >= threshold *`` the max of the first ``num_samples`` values of ``context``.

        NaN and inf are not flagged (check them separately). ``resample`` starts a new sample window.
        """
        value = math.fabs(float(result.item()))
        if math.isnan(value) or math.isinf(value):
            return False
        if resample or context not in self.large_value_counts:
            self.large_value_counts[context] = 0
        if self.large_value_counts[context] < num_samples:
            self.large_value_counts[context] += 1
            self.max_values[context] = max(self.max_values.get(context, 0.0), value)
            if self.large_value_counts[context] == num_samples:
                logger.warning("Max value for %s: %s", context, self.max_values[context])
            return False
        return value >= self.max_values[context] * threshold

    def _maybe_report_stats(self) -> None:
        if self.current_iteration % self.REPORTING_INTERVAL_ITERATIONS != 0:
            return
        stats = dict(self.stats)
        if _distributed():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
            gathered: list[Any] | None = [None] * world if rank == 0 else None
            torch.distributed.gather_object(stats, gathered, dst=0)
            if rank != 0:
                for s in self.stats.values():
                    s.reset()
                return
            for other in gathered[1:]:
                for caller, s in other.items():
                    self.stats[caller].combine([s])
        logger.info("Stats on computation determinism in validation calls")
        for caller, s in self.stats.items():
            logger.info("  From validation call '%s':", caller.message)
            logger.info("    %s", s.print_stats())

    def _log_validation_error_to_file(self, status: RerunValidationStatus, result: Any, message: str) -> None:
        if self.result_rejected_tracker_filename is None:
            return
        node, dev = (os.uname()[1], str(device.get_current_device()))
        try:
            with open(self.result_rejected_tracker_filename, "a") as f:
                f.write(f"ts={datetime.datetime.now()} node={node} device={dev} "
                        f"jobID={os.getenv('SLURM_JOBID', 'N/A')} rank={safe_get_rank()} "
                        f"iteration={self.current_iteration + 1} status={status} result={result} "
                        f"message='{message}'\n")
        except OSError as error:
            logger.error("Could not log validation error: %s", error)
