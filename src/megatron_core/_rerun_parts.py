"""Building blocks of the rerun state machine: its enums, the error injector and determinism stats.

Re-exported by :mod:`megatron_core.rerun_state_machine`, which documents how they fit together.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Callable
from enum import Enum
from typing import Any, NamedTuple

import torch

from megatron_core._rank_utils import safe_get_rank

logger = logging.getLogger("megatron_core.rerun_state_machine")

EXIT_CODE_RESUME_TO_DISAMBIGUATE: int = 16
"""Exit code asking the launcher to resume the job from the checkpoint just written (ideally elsewhere)."""
EXIT_CODE_FAILED_ON_RESULT_VALIDATION: int = 17
"""Exit code of a job stopped because a result failed validation."""

COMPARISON_MATCH: float = 0.0
COMPARISON_MISMATCH: float = math.inf


class Caller(NamedTuple):
    """Where ``validate_result`` was called from: its message and the rank."""

    message: str
    rank: int


class Call(NamedTuple):
    """The ``sequence``-th call of ``validate_result`` by ``caller`` within one step."""

    caller: Caller
    sequence: int


class RerunDiagnostic(str, Enum):
    """Attribution of a rejected result.

    CORRECT_RESULT: the result is reproduced on other hardware (the input caused it).
    TRANSIENT_ERROR: re-running on the same device gives a different result.
    PERSISTENT_ERROR: reproduced on the same device but not on another one.
    """

    CORRECT_RESULT = "correct_result"
    TRANSIENT_ERROR = "transient_error"
    PERSISTENT_ERROR = "persistent_error"


class RerunMode(str, Enum):
    """How the machine runs: off, validating results, or re-running every step to measure determinism."""

    DISABLED = "disabled"
    VALIDATE_RESULTS = "validate_results"
    REPORT_DETERMINISM_STATS = "report_determinism_stats"


class RerunState(Enum):
    """Where the machine is in a step.

    NOT_RUNNING_YET: outside the step loop (before the first run, or after a step passed).
    INITIAL_RUN: the step's first forward-backward.
    RERUNNING_IN_PLACE: the re-run on the same device after a rejection.
    WILL_RERUN_FROM_CHECKPOINT: the rejection reproduced; a checkpoint is taken to re-run elsewhere.
    RERUNNING_FROM_CHECKPOINT: the re-run after resuming from that checkpoint.
    RERUNNING_AGAIN_FROM_CHECKPOINT: the resumed job landed on the same device; resume again.
    """

    NOT_RUNNING_YET = 0
    INITIAL_RUN = 1
    RERUNNING_IN_PLACE = 2
    WILL_RERUN_FROM_CHECKPOINT = 3
    RERUNNING_FROM_CHECKPOINT = 4
    RERUNNING_AGAIN_FROM_CHECKPOINT = 5


class RerunValidationStatus(str, Enum):
    """Status written for each record of the rejected-results tracker file."""

    RERUN_DISABLED = "rerun_disabled"
    INITIAL_RUN = "initial_run"
    FIRST_RERUN_NOT_REPRODUCIBLE = "first_rerun_not_reproducible"
    FIRST_RERUN_REPRODUCIBLE = "first_rerun_reproducible"
    SECOND_RERUN_NOT_REPRODUCIBLE = "second_rerun_not_reproducible"
    SECOND_RERUN_REPRODUCIBLE = "second_rerun_reproducible"


def _compare_floats(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative difference of two scalars: 0 when equal (NaN == NaN), inf when only one is NaN/inf."""
    x, y = float(a.item()), float(b.item())
    if x == y or (math.isnan(x) and math.isnan(y)):
        return COMPARISON_MATCH
    if math.isnan(x) or math.isnan(y) or math.isinf(x) != math.isinf(y):
        return COMPARISON_MISMATCH
    if math.isinf(x) and math.isinf(y):  # opposite infinities
        return COMPARISON_MISMATCH
    return math.fabs((x - y) / (x + y) * 2) if x + y != 0 else COMPARISON_MISMATCH


class QuickStats:
    """Running distribution of a non-negative statistic (relative differences between runs)."""

    def __init__(self, max_size: int = 100000) -> None:
        self.samples: list[float] = []
        self.pos = 0
        self.zero_cnt = 0
        self.max = 0.0
        self.max_size = max_size

    def record(self, data: float) -> None:
        """Add one sample (zeros are only counted)."""
        if data == 0.0:
            self.zero_cnt += 1
            return
        if self.pos < self.max_size:
            self.samples.append(data)
        else:
            self.samples[self.pos % self.max_size] = data
        self.pos += 1
        self.max = max(self.max, data)

    def combine(self, others: list[QuickStats]) -> None:
        """Merge other ranks' stats into this one."""
        if not others:
            return
        total = len(self.samples) + sum(len(o.samples) for o in others)
        if total <= self.max_size:
            for other in others:
                self.samples.extend(other.samples)
            self.pos = total
        self.zero_cnt += sum(o.zero_cnt for o in others)
        self.max = max(self.max, *(o.max for o in others))

    def reset(self) -> None:
        """Forget every sample."""
        self.samples, self.pos, self.zero_cnt, self.max = [], 0, 0, 0.0

    def print_stats(self) -> str:
        """One line: count, identical count, mean and percentiles of the relative variability."""
        self.samples.sort()
        zeros, n = self.zero_cnt, len(self.samples)
        if n == 0:
            return f"{zeros:,} samples, all identical"
        total = zeros + n
        pct = {}
        for p in (0.5, 0.9, 0.99, 0.999):
            idx = int(total * p) - zeros
            pct[p] = f"{self.samples[idx]:.3E}" if idx >= 0 else "0.0"
        return (f"{total:,}/{zeros:,} total/identical samples, rel. variability: avg= {sum(self.samples) / total:.3E}, "
                f"p50= {pct[0.5]}, p90= {pct[0.9]}, p99= {pct[0.99]}, p99.9= {pct[0.999]}, max: {self.max:.3E}")


class RerunErrorInjector:
    """Injects rejected results, and matching or mismatching re-runs, to exercise the machine.

    About one ``validate_result`` call in ``error_injection_rate`` is rejected (0: never). The re-runs
    then behave as ``error_injection_type`` says: TRANSIENT_ERROR differs on the in-place re-run;
    PERSISTENT_ERROR matches in place and differs after the checkpoint re-run; CORRECT_RESULT matches
    both times.
    """

    _ERROR_NAMES = {
        RerunDiagnostic.CORRECT_RESULT: "Expected result",
        RerunDiagnostic.TRANSIENT_ERROR: "Transient error",
        RerunDiagnostic.PERSISTENT_ERROR: "Persistent error",
    }

    def __init__(self, error_injection_rate: int = 0,
                 error_injection_type: RerunDiagnostic = RerunDiagnostic.TRANSIENT_ERROR) -> None:
        if not isinstance(error_injection_type, RerunDiagnostic):
            raise ValueError(f"error_injection_type={error_injection_type!r} must be a RerunDiagnostic")
        if error_injection_rate < 0:
            raise ValueError(f"error_injection_rate={error_injection_rate} must be >= 0")
        self.error_injection_rate = error_injection_rate
        self.error_injection_type = error_injection_type
        self.should_inject_errors = error_injection_rate > 0
        self.injected_error_type: RerunDiagnostic | None = None

    def maybe_inject(self) -> bool:
        """Whether to reject this result (at most one injection in flight)."""
        if not self.should_inject_errors or self.injected_error_type is not None:
            return False
        draw = (random.randint(0, self.error_injection_rate - 1) + safe_get_rank()) % self.error_injection_rate
        if draw != 0:
            return False
        self.injected_error_type = self.error_injection_type
        logger.warning("Injecting error type %s", self._ERROR_NAMES[self.error_injection_type])
        return True

    def maybe_miscompare(self, comparison_func: Callable[[Any, Any], float], initial_result: Any, result: Any,
                         state: RerunState) -> float:
        """``comparison_func(initial, result)``, or the injected outcome for this re-run."""
        injected = self.injected_error_type
        if injected is None:
            return comparison_func(initial_result, result)
        if state == RerunState.RERUNNING_IN_PLACE:
            if injected == RerunDiagnostic.TRANSIENT_ERROR:
                self.injected_error_type = None
                return COMPARISON_MISMATCH
            return COMPARISON_MATCH
        if state == RerunState.RERUNNING_FROM_CHECKPOINT:
            self.injected_error_type = None
            if injected == RerunDiagnostic.PERSISTENT_ERROR:
                return COMPARISON_MISMATCH
            if injected == RerunDiagnostic.CORRECT_RESULT:
                return COMPARISON_MATCH
        raise RuntimeError(f"RerunErrorInjector: no comparison to inject for {injected} in state {state}")

    def state_dict(self) -> dict[str, Any]:
        """Plain-data state for a checkpoint."""
        return {
            "error_injection_rate": self.error_injection_rate,
            "error_injection_type": self.error_injection_type.value,
            "injected_error_type": None if self.injected_error_type is None else self.injected_error_type.value,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        self.error_injection_rate = state_dict["error_injection_rate"]
        self.error_injection_type = RerunDiagnostic(state_dict["error_injection_type"])
        self.should_inject_errors = self.error_injection_rate > 0
        injected = state_dict["injected_error_type"]
        self.injected_error_type = None if injected is None else RerunDiagnostic(injected)
