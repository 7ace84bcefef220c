"""Validate results during training and re-run a suspicious step to attribute the fault (Megatron-Core's
``rerun_state_machine``).

The training step becomes a loop::

    machine = get_rerun_state_machine()
    while machine.should_run_forward_backward(data_iterator):   # data_iterator: RerunDataIterator(s)
        loss = forward_backward(next(data_iterator))
        machine.validate_result(loss, torch.isnan, "loss is NaN")
    should_checkpoint, should_exit, exit_code = machine.should_checkpoint_and_exit()

In ``RerunMode.VALIDATE_RESULTS``, a rejected result (``rejection_func(result)`` is True on any rank)
makes every rank re-run the step in place with the same data and RNG state. If the re-run differs
(beyond ``tolerance``) the fault was transient; if it reproduces, a checkpoint is written and the job
exits with ``EXIT_CODE_RESUME_TO_DISAMBIGUATE`` so it can re-run the step on other hardware: a
mismatch there means a persistent fault of the first device, a match that the result was correct.
``RerunMode.REPORT_DETERMINISM_STATS`` re-runs every step once and reports how much results vary.
With ``RerunMode.DISABLED`` a rejected result raises ``RuntimeError`` (or warns when not ``fatal``).
"""

from __future__ import annotations

import copy
import logging
import os
import random
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any, Union

import numpy as np
import torch

from megatron_core import device
from megatron_core._rank_utils import log_single_rank, safe_get_rank
from megatron_core._rerun_checkpoint import RerunCheckpointMixin
from megatron_core._rerun_parts import (
    COMPARISON_MATCH,
    COMPARISON_MISMATCH,
    EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
    EXIT_CODE_RESUME_TO_DISAMBIGUATE,
    Call,
    Caller,
    QuickStats,
    RerunDiagnostic,
    RerunErrorInjector,
    RerunMode,
    RerunState,
    RerunValidationStatus,
    _compare_floats,
)
from megatron_core._rerun_reporting import RerunReportingMixin
from megatron_core.typed_torch import copy_signature

logger = logging.getLogger(__name__)

SerializableStateType = Union[list, dict]
DataIteratorArgType = Union["RerunDataIterator", list["RerunDataIterator"], None]

_GLOBAL_RERUN_STATE_MACHINE: RerunStateMachine | None = None


def _where() -> tuple[str, str]:
    """(node name, device) of this process, for reports."""
    return os.uname()[1], str(device.get_current_device())


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


class RerunStateMachine(RerunCheckpointMixin, RerunReportingMixin):
    """The process-wide rerun state machine; make it with :func:`initialize_rerun_state_machine`.

    ``state_save_func``/``state_restore_func`` save and restore extra state a re-run needs (Python,
    NumPy, torch and device RNG states are handled here). ``result_rejected_tracker_filename`` is a
    file each rejection is appended to (see :meth:`get_skipped_iterations_from_tracker_file`).

    Assumption: a re-run of a step makes the same sequence of ``validate_result`` calls as the first run.
    """

    REPORTING_INTERVAL_ITERATIONS: int = 2

    def __init__(self, state_save_func: Callable[[], SerializableStateType] | None = None,
                 state_restore_func: Callable[[SerializableStateType], None] | None = None,
                 mode: RerunMode = RerunMode.DISABLED, error_injector: RerunErrorInjector | None = None,
                 result_rejected_tracker_filename: str | None = None) -> None:
        self.mode = RerunMode(mode)
        self.state = RerunState.NOT_RUNNING_YET
        self.current_iteration = -1  # 0-based; messages show it 1-based
        self.first_iteration_complete = False
        self.rerun_requested = False
        self.checkpoint_requested = False
        self.restart_again_requested = False
        self.continue_requested = False
        self.logged_sdc_enabled = False
        self.error_injector = error_injector or RerunErrorInjector()
        self.validation_counts: dict[Caller, int] = defaultdict(int)
        self.failed_validation_call: Call | None = None
        self.initial_result: Any = None
        self.suspicious_node: str | None = None
        self.suspicious_device: str | None = None
        self.result_rejected_tracker_filename = result_rejected_tracker_filename
        if result_rejected_tracker_filename is not None:
            try:
                with open(result_rejected_tracker_filename, "a"):
                    pass
            except OSError as error:
                raise RuntimeError(f"cannot append to result_rejected_tracker_filename "
                                   f"{result_rejected_tracker_filename!r}: {error}") from error
        self.saved_state: dict[str, Any] | None = None
        self.state_save_func = state_save_func
        self.state_restore_func = state_restore_func
        self.data_iterator_checkpoints: list[SerializableStateType] | None = None
        self.large_value_counts: dict[str, int] = {}
        self.max_values: dict[str, float] = {}
        self.saved_results: dict[Call, Any] = {}
        self.stats: dict[Caller, QuickStats] = defaultdict(QuickStats)
        log_single_rank(logger, logging.WARNING, f"RerunStateMachine initialized in mode {self.mode}")

    def set_mode(self, mode: RerunMode) -> None:
        """Change the operating mode."""
        log_single_rank(logger, logging.WARNING, f"Setting RerunStateMachine mode {mode}")
        self.mode = RerunMode(mode)

    def get_mode(self) -> RerunMode:
        """The operating mode."""
        return self.mode

    def _reduce_any(self, values: list[bool]) -> tuple[bool, ...]:
        """Logical OR of each flag over all ranks."""
        flags = torch.tensor([int(v) for v in values], dtype=torch.int32, device=device.get_current_device())
        if _distributed():
            torch.distributed.all_reduce(flags)
        return tuple(bool(v > 0) for v in flags.tolist())

    def _rewind(self, iterators: list[RerunDataIterator]) -> None:
        self._restore_state()
        for it in iterators:
            it.rewind()

    def should_run_forward_backward(self, data_iterator: DataIteratorArgType) -> bool:
        """Whether to run (or re-run) the step's forward-backward; call it as the step loop's condition."""
        self.validation_counts = defaultdict(int)
        iterators = self._sanitize_data_iterators(data_iterator)
        state = self.state
        if state == RerunState.NOT_RUNNING_YET:
            self.current_iteration += 1
            self.state = RerunState.INITIAL_RUN
            if self.mode == RerunMode.DISABLED:
                return True
            if self.data_iterator_checkpoints is not None:
                if len(self.data_iterator_checkpoints) != len(iterators):
                    raise ValueError(f"{len(iterators)} data iterators given, the checkpoint holds "
                                     f"{len(self.data_iterator_checkpoints)}")
                for it, saved in zip(iterators, self.data_iterator_checkpoints):
                    it.load_state_dict(saved)
                self.data_iterator_checkpoints = None
            self._save_state()
            for it in iterators:
                it.advance()
            self.rerun_requested = self.checkpoint_requested = False
            self.restart_again_requested = self.continue_requested = False
            return True
        if state == RerunState.INITIAL_RUN:
            if self.mode == RerunMode.DISABLED:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            (rerun,) = self._reduce_any([self.rerun_requested])
            if not rerun:
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if self.mode == RerunMode.VALIDATE_RESULTS:
                log_single_rank(logger, logging.WARNING, "Re-running the step to check whether the result reproduces")
            self.state = RerunState.RERUNNING_IN_PLACE
            self._rewind(iterators)
            return True
        if state == RerunState.RERUNNING_IN_PLACE:
            if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
                self.state = RerunState.NOT_RUNNING_YET
                self._maybe_report_stats()
                self.saved_results = {}
                return False
            resume, checkpoint = self._reduce_any([self.continue_requested, self.checkpoint_requested])
            if resume:
                log_single_rank(logger, logging.WARNING, "Continuing: the failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
                return False
            if checkpoint:
                self.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
            self._rewind(iterators)
            return False
        if state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            self.state = RerunState.RERUNNING_FROM_CHECKPOINT
            return True
        if state == RerunState.RERUNNING_FROM_CHECKPOINT:
            again, resume = self._reduce_any([self.restart_again_requested, self.continue_requested])
            if again:
                log_single_rank(logger, logging.WARNING,
                                "Resume again from the same checkpoint: the job ran on the same node/device")
                self.state = RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT
            elif resume:
                log_single_rank(logger, logging.WARNING, "Continuing: the failed validation was not fatal")
                self.state = RerunState.NOT_RUNNING_YET
            return False
        raise RuntimeError(f"should_run_forward_backward called in state {state}")

    # Megatron-LM's training loop calls it by this name too.
    should_rerun_forward_and_backward = should_run_forward_backward

    def should_checkpoint_and_exit(self) -> tuple[bool, bool, int]:
        """(write a checkpoint?, exit?, exit code) after the step loop; 0 means keep training."""
        self.first_iteration_complete = True
        if self.mode in (RerunMode.DISABLED, RerunMode.REPORT_DETERMINISM_STATS):
            return False, False, 0
        if self.state == RerunState.RERUNNING_IN_PLACE:
            log_single_rank(logger, logging.WARNING, "Exiting: resume the job from an earlier checkpoint")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
            log_single_rank(logger, logging.WARNING,
                            "Saving a checkpoint and exiting: resume from it to re-run the step elsewhere")
            return True, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        if self.state == RerunState.RERUNNING_FROM_CHECKPOINT:
            log_single_rank(logger, logging.WARNING, "Exiting: the checkpoint of this step is kept for inspection")
            return False, True, EXIT_CODE_FAILED_ON_RESULT_VALIDATION
        if self.state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
            log_single_rank(logger, logging.WARNING, "Exiting: resume from the same checkpoint on other hardware")
            return False, True, EXIT_CODE_RESUME_TO_DISAMBIGUATE
        return False, False, 0

    def validate_result(self, result: Any, rejection_func: Callable[[Any], bool], message: str,
                        comparison_func: Callable[[Any, Any], float] | None = None, tolerance: float = 0.0,
                        fatal: bool = True) -> None:
        """Check ``result``; a rejection starts the re-run protocol (see the module docstring).

        ``comparison_func(initial, rerun)`` returns a relative difference (default: for scalar tensors),
        compared with ``tolerance``. A non-``fatal`` check lets training continue once attributed.
        Results are not validated in the job's first step (no checkpoint could be taken before it).
        """
        if self.mode == RerunMode.DISABLED:
            if rejection_func(result):
                self._log_validation_error_to_file(RerunValidationStatus.RERUN_DISABLED, result, message)
                node, dev = _where()
                text = (f"Rank {safe_get_rank()}, node {node}, device {dev}, iteration {self.current_iteration + 1}: "
                        f"Unexpected result {result} (message='{message}')")
                if fatal:
                    raise RuntimeError(text)
                logger.warning(text)
            return
        if self.state == RerunState.NOT_RUNNING_YET:
            raise RuntimeError("validate_result must be called inside the should_run_forward_backward loop")
        comparison_func = comparison_func or _compare_floats
        call = self._get_validation_call_info(message)
        if self.mode == RerunMode.REPORT_DETERMINISM_STATS:
            if self.state == RerunState.INITIAL_RUN:
                self.rerun_requested = True
                self.saved_results[call] = result
            elif self.state == RerunState.RERUNNING_IN_PLACE:
                if call not in self.saved_results:
                    raise RuntimeError(f"validate_result({message!r}): no result from the initial run to compare")
                self.stats[Caller(message=message, rank=0)].record(comparison_func(self.saved_results[call], result))
            return
        if not self.logged_sdc_enabled:
            self.logged_sdc_enabled = True
            log_single_rank(logger, logging.WARNING, "Result validation enabled")
        if self.state == RerunState.INITIAL_RUN:
            if self.rerun_requested or not self.first_iteration_complete:
                return
            if self.error_injector.maybe_inject() or rejection_func(result):
                self.failed_validation_call = call
                self.initial_result = result
                self.rerun_requested = True
                self._log_validation_error_to_file(RerunValidationStatus.INITIAL_RUN, result, message)
                logger.error("Unexpected result %s on rank %d at iteration #%d invocation #%d (message='%s')",
                             result, safe_get_rank(), self.current_iteration + 1, call.sequence, message)
            return
        if call != self.failed_validation_call or self.state not in (
                RerunState.RERUNNING_IN_PLACE, RerunState.RERUNNING_FROM_CHECKPOINT):
            return
        difference = self.error_injector.maybe_miscompare(comparison_func, self.initial_result, result, self.state)
        if self.state == RerunState.RERUNNING_IN_PLACE:
            self._judge_first_rerun(difference > tolerance, result, message, fatal)
        else:
            self._judge_second_rerun(difference > tolerance, result, message, fatal)

    def _failure(self, text: str, fatal: bool) -> None:
        node, dev = _where()
        line = f"Rank {safe_get_rank()}, node {node}, device {dev}, iteration #{self.current_iteration + 1}: {text}!"
        (logger.error if fatal else logger.warning)(line)

    def _judge_first_rerun(self, differs: bool, result: Any, message: str, fatal: bool) -> None:
        if differs:
            if not fatal:
                self.continue_requested = True
            self._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_NOT_REPRODUCIBLE, result, message)
            self._failure(f"First rerun: the unexpected result does not reproduce ({result} != "
                          f"{self.initial_result}): possible transient error", fatal)
            return
        if fatal:
            self.checkpoint_requested = True
        else:
            self.continue_requested = True
        self.suspicious_node, self.suspicious_device = _where()
        self._log_validation_error_to_file(RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE, result, message)
        self._failure(f"First rerun: the unexpected result reproduces ({result} = {self.initial_result}); "
                      "re-run on other hardware to tell a persistent fault from a correct result", fatal)

    def _judge_second_rerun(self, differs: bool, result: Any, message: str, fatal: bool) -> None:
        if _where() == (self.suspicious_node, self.suspicious_device):
            logger.error("Resumed on the same node/device (%s, %s): resume again from the same checkpoint",
                         self.suspicious_node, self.suspicious_device)
            self.restart_again_requested = True
            return
        if differs:
            self._log_validation_error_to_file(RerunValidationStatus.SECOND_RERUN_NOT_REPRODUCIBLE, result, message)
            self._failure(f"Second rerun: the result differs on other hardware ({result} != {self.initial_result}): "
                          "possible persistent error", True)
        else:
            self._log_validation_error_to_file(RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE, result, message)
            self._failure(f"Second rerun: the result reproduces on other hardware ({result} = "
                          f"{self.initial_result}): correct result, possibly an application error ({message})", True)
        if not fatal:
            self.continue_requested = True

    def _sanitize_data_iterators(self, data_iterator: DataIteratorArgType) -> list[RerunDataIterator]:
        if self.mode == RerunMode.DISABLED:
            return []
        iterators = data_iterator if isinstance(data_iterator, list) else [data_iterator]
        iterators = [it for it in iterators if it is not None]
        for it in iterators:
            if not isinstance(it, RerunDataIterator):
                raise TypeError(f"data iterator {type(it).__name__} must be wrapped in RerunDataIterator")
        return iterators

    def _get_validation_call_info(self, message: str) -> Call:
        caller = Caller(message=message, rank=safe_get_rank())
        self.validation_counts[caller] += 1
        return Call(caller=caller, sequence=self.validation_counts[caller])

    def _save_state(self) -> None:
        """Save what a re-run must restore: RNG states and ``state_save_func``'s state."""
        self.saved_state = {
            "rng_state": {"random": random.getstate(), "numpy": np.random.get_state(),
                          "torch": torch.get_rng_state(), "device": device.get_device_rng_state()},
            "other_state": self.state_save_func() if self.state_save_func else None,
        }

    def _restore_state(self) -> None:
        rng = self.saved_state["rng_state"]
        random.setstate(rng["random"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        device.set_device_rng_state(rng["device"])
        if self.saved_state["other_state"] is not None and self.state_restore_func:
            self.state_restore_func(self.saved_state["other_state"])

class RerunDataIterator:
    """Wraps a data iterator so a step's micro-batches can be replayed for a re-run."""

    def __init__(self, iterable: Iterable[Any]) -> None:
        self.iterable = iterable
        self.saved_microbatches: list[Any] = []
        self.replaying = False
        self.replay_pos = 0

    def __iter__(self) -> RerunDataIterator:
        return self

    def __next__(self) -> Any:
        if self.replaying:
            if self.replay_pos >= len(self.saved_microbatches):
                raise RuntimeError("RerunDataIterator: the re-run asked for more micro-batches than the first run")
            batch = self.saved_microbatches[self.replay_pos]
            self.replay_pos += 1
            return batch
        batch = next(self.iterable)
        if get_rerun_state_machine().get_mode() != RerunMode.DISABLED:
            self.saved_microbatches.append(copy.copy(batch))
        return batch

    def rewind(self) -> None:
        """Replay from the step's first micro-batch."""
        self.replaying = True
        self.replay_pos = 0

    def advance(self) -> None:
        """Drop the saved micro-batches and read new ones (a new step)."""
        self.replaying = False
        self.saved_microbatches = []

    def state_dict(self) -> SerializableStateType:
        """Saved micro-batches and replay position."""
        return {"saved_microbatches": self.saved_microbatches, "replaying": self.replaying,
                "replay_pos": self.replay_pos}

    def load_state_dict(self, state_dict: SerializableStateType) -> None:
        """Restore :meth:`state_dict`."""
        self.saved_microbatches = state_dict["saved_microbatches"]
        self.replaying = state_dict["replaying"]
        self.replay_pos = state_dict["replay_pos"]


@copy_signature(RerunStateMachine.__init__, handle_first_src_param="skip")
def initialize_rerun_state_machine(*args: Any, **kwargs: Any) -> None:
    """Create the process-wide machine (arguments as :class:`RerunStateMachine`); once per process."""
    global _GLOBAL_RERUN_STATE_MACHINE
    if _GLOBAL_RERUN_STATE_MACHINE is not None:
        raise RuntimeError("the rerun state machine is already initialized; destroy_rerun_state_machine() first")
    _GLOBAL_RERUN_STATE_MACHINE = RerunStateMachine(*args, **kwargs)


def destroy_rerun_state_machine() -> None:
    """Forget the process-wide machine."""
    global _GLOBAL_RERUN_STATE_MACHINE
    _GLOBAL_RERUN_STATE_MACHINE = None


def get_rerun_state_machine() -> RerunStateMachine:
    """The process-wide machine (a disabled one is made on first use)."""
    if _GLOBAL_RERUN_STATE_MACHINE is None:
        log_single_rank(logger, logging.WARNING, "Implicit initialization of Rerun State Machine!")
        initialize_rerun_state_machine()
    return _GLOBAL_RERUN_STATE_MACHINE


__all__ = [
    "COMPARISON_MATCH", "COMPARISON_MISMATCH", "EXIT_CODE_FAILED_ON_RESULT_VALIDATION",
    "EXIT_CODE_RESUME_TO_DISAMBIGUATE", "Call", "Caller", "QuickStats", "RerunDataIterator", "RerunDiagnostic",
    "RerunErrorInjector", "RerunMode", "RerunState", "RerunStateMachine", "RerunValidationStatus",
    "destroy_rerun_state_machine", "get_rerun_state_machine", "initialize_rerun_state_machine",
]
