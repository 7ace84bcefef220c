"""How many microbatches make one global batch, optionally ramping the global batch size up (Megatron-Core's).

A process-wide calculator is set up once with :func:`init_num_microbatches_calculator`; the
pipeline schedules and data samplers read it through :func:`get_num_microbatches` and friends.
With ``rampup_batch_size = [start, increment, ramp_samples]`` the global batch grows from
``start`` by ``increment`` every ``ramp_samples / ((global - start) / increment)`` consumed samples.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: NumMicroBatchesCalculator | None = None


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise RuntimeError("num microbatches calculator is not initialized; call init_num_microbatches_calculator()")
    return _GLOBAL_NUM_MICROBATCHES_CALCULATOR


def get_num_microbatches() -> int:
    """Microbatches per global batch at the current point of training."""
    return _calculator().get()


def get_current_global_batch_size() -> int:
    """The current (possibly ramping) global batch size."""
    return _calculator().get_current_global_batch_size()


def get_micro_batch_size() -> int:
    """The micro batch size."""
    return _calculator().get_micro_batch_size()


def get_current_running_global_batch_size() -> int:
    """The global batch size actually run (rounded down when ``decrease_batch_size_if_needed``)."""
    return _calculator().get_current_running_global_batch_size()


def update_num_microbatches(consumed_samples: int, consistency_check: bool = True, verbose: bool = False) -> None:
    """Recompute the batch size after ``consumed_samples`` samples."""
    _calculator().update(consumed_samples, consistency_check, verbose)


def unset_num_microbatches_calculator() -> None:
    """Forget the global calculator (tests, re-configuration)."""
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = None


def init_num_microbatches_calculator(rank: int, rampup_batch_size: list[int] | None, global_batch_size: int,
                                     micro_batch_size: int, data_parallel_size: int,
                                     decrease_batch_size_if_needed: bool = False) -> None:
    """Create the global calculator; raises if one exists already."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, init=True)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: list[int] | None, global_batch_size: int,
                                            micro_batch_size: int, data_parallel_size: int,
                                            decrease_batch_size_if_needed: bool = False) -> None:
    """Replace the global calculator."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, init=False)


def _configure(rank: int, rampup_batch_size: list[int] | None, global_batch_size: int, micro_batch_size: int,
               data_parallel_size: int, decrease_batch_size_if_needed: bool, init: bool) -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if init and _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise RuntimeError("num microbatches calculator is already initialized")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
        decrease_batch_size_if_needed,
    )


def _build_num_microbatches_calculator(rank: int, rampup_batch_size: list[int] | None, global_batch_size: int,
                                       micro_batch_size: int, data_parallel_size: int,
                                       decrease_batch_size_if_needed: bool) -> NumMicroBatchesCalculator:
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                 decrease_batch_size_if_needed, rank)
    if len(rampup_batch_size) != 3:
        raise ValueError(
            f"rampup_batch_size ({rampup_batch_size}) must be [start global batch size, batch size increment, "
            "ramp-up samples]"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    decrease_batch_size_if_needed, rank, start, increment, samples)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value <= 0:
            raise ValueError(f"{name} ({value}) must be > 0")


class NumMicroBatchesCalculator(ABC):
    """Base: holds the current numbers; subclasses decide how they change."""

    def __init__(self) -> None:
        self.num_micro_batches = 0
        self.current_global_batch_size = 0
        self.current_running_global_batch_size = 0
        self.micro_batch_size = 0

    def get(self) -> int:
        """Microbatches per global batch."""
        return self.num_micro_batches

    def get_current_global_batch_size(self) -> int:
        """The current global batch size."""
        return self.current_global_batch_size

    def get_micro_batch_size(self) -> int:
        """The micro batch size."""
        return self.micro_batch_size

    def get_current_running_global_batch_size(self) -> int:
        """The global batch size actually run."""
        return self.current_running_global_batch_size

    @abstractmethod
    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Recompute after ``consumed_samples`` samples."""


class ConstantNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """A fixed global batch: ``global_batch_size / (micro_batch_size * data_parallel_size)`` microbatches."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int) -> None:
        super().__init__()
        _check_positive(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                        data_parallel_size=data_parallel_size)
        per_step = micro_batch_size * data_parallel_size
        if decrease_batch_size_if_needed:
            running = global_batch_size // per_step * per_step
            if rank == 0 and running != global_batch_size:
                logger.info("decreasing global batch size from %d to %d to fit micro batch size %d x DP %d",
                            global_batch_size, running, micro_batch_size, data_parallel_size)
        else:
            if global_batch_size % per_step != 0:
                raise ValueError(
                    f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                    f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
                )
            running = global_batch_size
        self.num_micro_batches = running // per_step
        if self.num_micro_batches < 1:
            raise ValueError(
                f"number of microbatches must be at least 1: global batch size ({global_batch_size}) < micro batch "
                f"size ({micro_batch_size}) x data parallel size ({data_parallel_size})"
            )
        self.current_global_batch_size = global_batch_size
        self.current_running_global_batch_size = running
        self.micro_batch_size = micro_batch_size

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """The batch size never changes."""


class RampupBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Grow the global batch from ``start_global_batch_size`` to ``global_batch_size`` over ``ramup_samples``."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 decrease_batch_size_if_needed: bool, rank: int, start_global_batch_size: int,
                 batch_size_increment: int, ramup_samples: int) -> None:
        super().__init__()
        _check_positive(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                        data_parallel_size=data_parallel_size, start_global_batch_size=start_global_batch_size,
                        batch_size_increment=batch_size_increment)
        if ramup_samples < 0:
            raise ValueError(f"ramp-up samples ({ramup_samples}) must be >= 0")
        diff = global_batch_size - start_global_batch_size
        if diff < 0:
            raise ValueError(
                f"start global batch size ({start_global_batch_size}) must be <= global batch size "
                f"({global_batch_size})"
            )
        if diff % batch_size_increment != 0:
            raise ValueError(
                f"global batch size interval ({diff}) is not divisible by global batch size increment "
                f"({batch_size_increment})"
            )
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.decrease_batch_size_if_needed = decrease_batch_size_if_needed
        self.rank = rank
        self.start_global_batch_size = start_global_batch_size
        self.batch_size_increment = batch_size_increment
        self.ramup_samples = ramup_samples
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        num_increments = diff // batch_size_increment
        self.rampup_samples_per_increment = ramup_samples / num_increments if num_increments else float("inf")
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Set the batch size reached after ``consumed_samples``; check it splits into microbatches."""
        if consumed_samples > self.ramup_samples:
            current = self.global_batch_size
        else:
            steps = int(consumed_samples / self.rampup_samples_per_increment)
            current = min(self.start_global_batch_size + steps * self.batch_size_increment, self.global_batch_size)
        per_step = self.micro_batch_times_data_parallel_size
        if consistency_check and not self.decrease_batch_size_if_needed and current % per_step != 0:
            raise ValueError(
                f"current global batch size ({current}) is not divisible by micro-batch-size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})"
            )
        running = current // per_step * per_step if self.decrease_batch_size_if_needed else current
        if running < per_step and consistency_check:
            raise ValueError(
                f"current global batch size ({current}) is smaller than micro batch size ({self.micro_batch_size}) "
                f"times data parallel size ({self.data_parallel_size})"
            )
        if verbose and self.rank == 0 and current != self.current_global_batch_size:
            logger.info("ramping up global batch size to %d after %d samples", current, consumed_samples)
        self.current_global_batch_size = current
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // per_step


def destroy_num_microbatches_calculator() -> None:
    """Forget the global calculator (Megatron-Core's name for :func:`unset_num_microbatches_calculator`)."""
    unset_num_microbatches_calculator()
