"""How many microbatches make one global batch, optionally ramping the global batch size up (Megatron-Core's).

A process-wide calculator is set up once with :func:`init_num_microbatches_calculator`; the
pipeline schedules and data samplers read it through :func:`get_num_microbatches` and friends.
``step_batch_size_schedule = "0:256 200K:512 ..."`` (Megatron-Core 0.19) steps the global batch at sample
(or, with ``seq_length``, token) thresholds. The deprecated ``rampup_batch_size = [start, increment,
ramp_samples]`` grows it from ``start`` by ``increment`` every ``ramp_samples / ((global - start) / increment)``
samples (Megatron-Core 0.19 ignores it; see docs/compat.md). Validation errors are ``ValueError`` that are also
``AssertionError``, the type Megatron-Core raises.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod

logger = logging.getLogger(__name__)

_GLOBAL_NUM_MICROBATCHES_CALCULATOR: NumMicroBatchesCalculator | None = None


class MicroBatchesConfigError(ValueError, AssertionError):
    """A batch-size setting that cannot be run (an ``AssertionError`` too, as Megatron-Core asserts)."""


class MicroBatchesStateError(RuntimeError, AssertionError):
    """The global calculator is missing, or initialised twice (an ``AssertionError`` too, as in Megatron-Core)."""


def _calculator() -> NumMicroBatchesCalculator:
    if _GLOBAL_NUM_MICROBATCHES_CALCULATOR is None:
        raise MicroBatchesStateError(
            "num microbatches calculator is not initialized; call init_num_microbatches_calculator()")
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


def init_num_microbatches_calculator(rank: int, rampup_batch_size: list[int] | None = None,
                                     global_batch_size: int | None = None, micro_batch_size: int | None = None,
                                     data_parallel_size: int | None = None,
                                     decrease_batch_size_if_needed: bool = False,
                                     step_batch_size_schedule: str | None = None,
                                     seq_length: int | None = None) -> None:
    """Create the global calculator; raises if one exists already.

    ``step_batch_size_schedule`` selects :class:`StepBatchsizeNumMicroBatchesCalculator` (``global_batch_size``
    then unused); otherwise ``global_batch_size`` is required.
    """
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, step_batch_size_schedule, seq_length, init=True)


def reconfigure_num_microbatches_calculator(rank: int, rampup_batch_size: list[int] | None = None,
                                            global_batch_size: int | None = None,
                                            micro_batch_size: int | None = None,
                                            data_parallel_size: int | None = None,
                                            decrease_batch_size_if_needed: bool = False,
                                            step_batch_size_schedule: str | None = None,
                                            seq_length: int | None = None) -> None:
    """Replace the global calculator (same arguments as :func:`init_num_microbatches_calculator`)."""
    _configure(rank, rampup_batch_size, global_batch_size, micro_batch_size, data_parallel_size,
               decrease_batch_size_if_needed, step_batch_size_schedule, seq_length, init=False)


def _configure(rank: int, rampup_batch_size: list[int] | None, global_batch_size: int | None,
               micro_batch_size: int | None, data_parallel_size: int | None, decrease_batch_size_if_needed: bool,
               step_batch_size_schedule: str | None, seq_length: int | None, init: bool) -> None:
    global _GLOBAL_NUM_MICROBATCHES_CALCULATOR
    if init and _GLOBAL_NUM_MICROBATCHES_CALCULATOR is not None:
        raise MicroBatchesStateError("num microbatches calculator is already initialized")
    if rampup_batch_size is not None and rank == 0:
        logger.warning("rampup_batch_size is deprecated (Megatron-Core 0.19 ignores it); "
                       "use step_batch_size_schedule instead")
    _GLOBAL_NUM_MICROBATCHES_CALCULATOR = _build_num_microbatches_calculator(
        rank, global_batch_size, micro_batch_size, data_parallel_size, decrease_batch_size_if_needed,
        step_batch_size_schedule, seq_length, rampup_batch_size=rampup_batch_size,
    )


def _build_num_microbatches_calculator(rank: int, global_batch_size: int | None, micro_batch_size: int,
                                       data_parallel_size: int, decrease_batch_size_if_needed: bool,
                                       step_batch_size_schedule: str | None = None, seq_length: int | None = None,
                                       rampup_batch_size: list[int] | None = None) -> NumMicroBatchesCalculator:
    if step_batch_size_schedule is not None:
        if decrease_batch_size_if_needed:
            raise MicroBatchesConfigError(
                "step_batch_size_schedule and decrease_batch_size_if_needed cannot be used together")
        return StepBatchsizeNumMicroBatchesCalculator(micro_batch_size, data_parallel_size,
                                                      decrease_batch_size_if_needed, rank,
                                                      step_batch_size_schedule, seq_length)
    if global_batch_size is None:
        raise MicroBatchesConfigError("global_batch_size is required without a step_batch_size_schedule")
    if rampup_batch_size is None:
        return ConstantNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                 decrease_batch_size_if_needed, rank)
    if len(rampup_batch_size) != 3:
        raise MicroBatchesConfigError(
            f"rampup_batch_size ({rampup_batch_size}) must be [start global batch size, batch size increment, "
            "ramp-up samples]"
        )
    start, increment, samples = (int(v) for v in rampup_batch_size)
    return RampupBatchsizeNumMicroBatchesCalculator(global_batch_size, micro_batch_size, data_parallel_size,
                                                    decrease_batch_size_if_needed, rank, start, increment, samples)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if value is None or value <= 0:
            raise MicroBatchesConfigError(f"{name} ({value}) must be > 0")


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
                raise MicroBatchesConfigError(
                    f"global batch size ({global_batch_size}) is not divisible by micro batch size "
                    f"({micro_batch_size}) times data parallel size ({data_parallel_size})"
                )
            running = global_batch_size
        self.num_micro_batches = running // per_step
        if self.num_micro_batches < 1:
            raise MicroBatchesConfigError(
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
            raise MicroBatchesConfigError(f"ramp-up samples ({ramup_samples}) must be >= 0")
        diff = global_batch_size - start_global_batch_size
        if diff < 0:
            raise MicroBatchesConfigError(
                f"start global batch size ({start_global_batch_size}) must be <= global batch size "
                f"({global_batch_size})"
            )
        if diff % batch_size_increment != 0:
            raise MicroBatchesConfigError(
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
            raise MicroBatchesConfigError(
                f"current global batch size ({current}) is not divisible by micro-batch-size "
                f"({self.micro_batch_size}) times data parallel size ({self.data_parallel_size})"
            )
        running = current // per_step * per_step if self.decrease_batch_size_if_needed else current
        if running < per_step and consistency_check:
            raise MicroBatchesConfigError(
                f"current global batch size ({current}) is smaller than micro batch size ({self.micro_batch_size}) "
                f"times data parallel size ({self.data_parallel_size})"
            )
        if verbose and self.rank == 0 and current != self.current_global_batch_size:
            logger.info("ramping up global batch size to %d after %d samples", current, consumed_samples)
        self.current_global_batch_size = current
        self.current_running_global_batch_size = running
        self.num_micro_batches = running // per_step


class StepBatchsizeNumMicroBatchesCalculator(NumMicroBatchesCalculator):
    """Global batch size stepped by a schedule of ``THRESHOLD:BATCH_SIZE`` pairs (Megatron-Core 0.19).

    ``schedule`` is e.g. ``"0:768 250B:1536 500B:3072"`` (space- or comma-separated; thresholds and sizes take
    the suffixes K, M, B, T). Thresholds count samples, or tokens when ``seq_length`` is given (converted to
    samples by integer division). The first threshold must be 0 and thresholds strictly increase. Whether the
    current batch splits into ``micro_batch_size * data_parallel_size`` is checked in :meth:`update` with
    ``consistency_check=True`` only, so entries already passed may be smaller (a job resumed on more ranks).
    """

    def __init__(self, micro_batch_size: int, data_parallel_size: int, decrease_batch_size_if_needed: bool,
                 rank: int, schedule: str, seq_length: int | None = None) -> None:
        super().__init__()
        if decrease_batch_size_if_needed:
            raise MicroBatchesConfigError("step batch size schedules do not support decrease_batch_size_if_needed")
        _check_positive(micro_batch_size=micro_batch_size, data_parallel_size=data_parallel_size)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_size = data_parallel_size
        self.rank = rank
        self.seq_length = seq_length
        self.micro_batch_times_data_parallel_size = micro_batch_size * data_parallel_size
        self.schedule = _parse_schedule(schedule, seq_length)
        self.global_batch_size = self.schedule[-1][1]
        if rank == 0:
            unit = "tokens" if seq_length else "samples"
            logger.info("step batch size schedule (thresholds in %s): %s", unit, schedule)
        self.update(0, consistency_check=False)

    def update(self, consumed_samples: int, consistency_check: bool, verbose: bool = False) -> None:
        """Set the batch size of the last threshold reached by ``consumed_samples``; optionally check it splits."""
        current = next(bs for threshold, bs in reversed(self.schedule) if consumed_samples >= threshold)
        per_step = self.micro_batch_times_data_parallel_size
        if consistency_check and current % per_step != 0:
            raise MicroBatchesConfigError(
                f"current global batch size ({current}) is not divisible by micro_batch_size "
                f"({self.micro_batch_size}) * data_parallel_size ({self.data_parallel_size})"
            )
        if verbose and self.rank == 0 and current != self.current_global_batch_size:
            logger.info("global batch size %d after %d samples", current, consumed_samples)
        self.current_global_batch_size = current
        self.current_running_global_batch_size = current
        self.num_micro_batches = current // per_step


_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _parse_count(text: str) -> int:
    text = text.strip().upper()
    scale = _SUFFIXES.get(text[-1:], 1)
    try:
        return int(float(text[:-1] if scale != 1 else text) * scale)
    except ValueError:
        raise MicroBatchesConfigError(f"invalid number {text!r} in step batch size schedule") from None


def _parse_schedule(schedule: str, seq_length: int | None) -> list[tuple[int, int]]:
    """``[(threshold in samples, batch size), ...]`` sorted by threshold, validated."""
    pairs = []
    for entry in schedule.replace(",", " ").split():
        if ":" not in entry:
            raise MicroBatchesConfigError(f'invalid schedule entry "{entry}"; expected "THRESHOLD:BATCH_SIZE"')
        threshold, batch = (_parse_count(part) for part in entry.split(":", 1))
        pairs.append((threshold // seq_length if seq_length else threshold, batch))
    pairs.sort()
    if not pairs or pairs[0][0] != 0:
        raise MicroBatchesConfigError(f"the step batch size schedule {schedule!r} must start at threshold 0")
    for (prev, _), (cur, _) in zip(pairs, pairs[1:]):
        if cur <= prev:
            raise MicroBatchesConfigError(f"schedule thresholds must be strictly increasing, got {prev} then {cur}")
    for _, batch in pairs:
        if batch <= 0:
            raise MicroBatchesConfigError(f"schedule batch sizes must be positive, got {batch}")
    return pairs


def destroy_num_microbatches_calculator() -> None:
    """Forget the global calculator (Megatron-Core's name for :func:`unset_num_microbatches_calculator`)."""
    unset_num_microbatches_calculator()
