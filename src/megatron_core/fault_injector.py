"""Deliberate faults for resilience testing (Megatron-Core's ``megatron.core.fault_injector``).

:func:`setup_fault_injection` has rank 0 draw a plan from a :class:`FaultInjectorConfig` (which ranks,
which :class:`Fault`, after how many seconds), broadcasts it, and every target rank arms a daemon timer
thread that fires the fault. Megatron delegates the faults to ``nvidia-resiliency-ext``; here each kind
is implemented with the standard library and torch (``GPU_ERROR`` and ``GPU_SLEEP`` need CUDA), so no
optional package is involved. ``WORKLOAD_EXC`` is cooperative: the timer only sets a flag, and the next
:func:`maybe_raise_workload_exception` call of the training loop raises :class:`InjectedException`.
"""

from __future__ import annotations

import ctypes
import datetime
import enum
import logging
import math
import os
import random
import re
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["FaultInjectorConfig", "setup_fault_injection", "maybe_raise_workload_exception"]

logger = logging.getLogger(__name__)


class Fault(enum.Enum):
    """The kinds of fault (names and values as ``nvidia_resiliency_ext``'s ``Fault``)."""

    GPU_ERROR = 1  # an out-of-bounds CUDA index: a device-side assert that poisons the CUDA context
    GPU_SLEEP = 2  # a kernel that never finishes on the current CUDA device
    WORKLOAD_EXC = 3  # InjectedException at the loop's next maybe_raise_workload_exception()
    ASYNC_EXC = 4  # InjectedException raised asynchronously in the main thread
    SIGNAL_EXC = 5  # SIGUSR1, whose handler raises InjectedException in the main thread
    OS_ABORT = 6  # os.abort(): SIGABRT
    LOCK_GIL = 7  # a timer thread holds the GIL (catastrophic regex backtracking): the process freezes
    SEGFAULT = 8  # a read of address 1: SIGSEGV
    SIGINT = 9
    SIGKILL = 10
    SIGTERM = 11
    SIGSTOP = 12


class InjectedException(Exception):
    """The exception raised by the ``WORKLOAD_EXC``, ``ASYNC_EXC`` and ``SIGNAL_EXC`` faults."""


@dataclass(kw_only=True)
class FaultInjectorConfig:
    """Where, what and when to inject; injection is on when ``fault_injector_ranks`` or ``_num_ranks`` is set.

    ``fault_injector_ranks``: comma-separated ranks ("1,3"); ``fault_injector_num_ranks``: that many ranks drawn
    from 1..world_size-1 instead (rank 0 is never drawn). ``fault_injector_fault_types``: comma-separated
    :class:`Fault` names, case-insensitive ("sigkill,workload_exc"), one drawn per plan with the weights in
    ``fault_injector_fault_probabilities`` (normalised; uniform when unset). The fault fires
    ``fault_injector_fault_delay`` seconds after the plan is set up, or, when that is unset, after
    ``fault_injector_offset_seconds`` plus an exponential delay of mean ``fault_injector_mtti_seconds``. The plan is
    set up at training start, or after iteration ``fault_injector_delay_start_iteration`` when that is set.
    ``fault_injector_seed`` seeds rank 0's draws.
    """

    fault_injector_ranks: str | None = None
    fault_injector_num_ranks: int | None = None
    fault_injector_fault_types: str | None = None
    fault_injector_fault_probabilities: str | None = None
    fault_injector_fault_delay: float | None = None
    fault_injector_delay_start_iteration: int | None = None
    fault_injector_mtti_seconds: float | None = None
    fault_injector_offset_seconds: float | None = None
    fault_injector_seed: int | None = None

    def __post_init__(self) -> None:
        """Each field's format and range; an enabled injector also needs fault types and a delay or an MTTI."""
        if self.fault_injector_ranks is not None:
            _parse_ranks(self.fault_injector_ranks)
        if self.fault_injector_ranks is not None and self.fault_injector_num_ranks is not None:
            raise ValueError(f"fault_injector_ranks ({self.fault_injector_ranks!r}) and fault_injector_num_ranks "
                             f"({self.fault_injector_num_ranks}) are exclusive: set one of them")
        _check_int("fault_injector_num_ranks", self.fault_injector_num_ranks, minimum=1)
        _check_int("fault_injector_delay_start_iteration", self.fault_injector_delay_start_iteration, minimum=0)
        _check_int("fault_injector_seed", self.fault_injector_seed, minimum=None)
        _check_float("fault_injector_fault_delay", self.fault_injector_fault_delay, positive=False)
        _check_float("fault_injector_mtti_seconds", self.fault_injector_mtti_seconds, positive=True)
        _check_float("fault_injector_offset_seconds", self.fault_injector_offset_seconds, positive=False)
        types = None if self.fault_injector_fault_types is None else _parse_fault_types(
            self.fault_injector_fault_types)
        if self.fault_injector_fault_probabilities is not None:
            weights = _parse_probabilities(self.fault_injector_fault_probabilities)
            if types is not None and len(weights) != len(types):
                raise ValueError(f"fault_injector_fault_probabilities ({self.fault_injector_fault_probabilities!r}) "
                                 f"must give one weight per fault type in fault_injector_fault_types "
                                 f"({self.fault_injector_fault_types!r})")
        if self.fault_injector_ranks is None and self.fault_injector_num_ranks is None:
            return
        if types is None:
            raise ValueError("fault_injector_fault_types must be set when fault_injector_ranks or "
                             "fault_injector_num_ranks enables fault injection")
        if self.fault_injector_fault_delay is None and self.fault_injector_mtti_seconds is None:
            raise ValueError("fault_injector_fault_delay or fault_injector_mtti_seconds must be set when "
                             "fault_injector_ranks or fault_injector_num_ranks enables fault injection")


def _check_int(name: str, value: object, minimum: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        rule = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise ValueError(f"{name} ({value!r}) must be {rule}")


def _check_float(name: str, value: object, positive: bool) -> None:
    if value is None:
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):
        raise ValueError(f"{name} ({value!r}) must be a finite number {'> 0' if positive else '>= 0'}")


def _parse_ranks(text: str | int) -> list[int]:
    try:
        ranks = [int(part) for part in str(text).split(",")]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 0:
        raise ValueError(f"fault_injector_ranks ({text!r}) must be comma-separated ranks >= 0, e.g. '1,3'")
    return ranks


def _parse_fault_types(text: str) -> list[Fault]:
    names = [part.strip().upper() for part in text.split(",")]
    unknown = [name for name in names if name not in Fault.__members__]
    if unknown:
        raise ValueError(f"fault_injector_fault_types ({text!r}) names unknown faults {unknown}; "
                         f"valid: {[fault.name.lower() for fault in Fault]}")
    return [Fault[name] for name in names]


def _parse_probabilities(text: str) -> list[float]:
    try:
        weights = [float(part) for part in text.split(",")]
    except ValueError:
        weights = [-1.0]
    if any(not math.isfinite(w) or w < 0 for w in weights) or sum(weights) <= 0:
        raise ValueError(f"fault_injector_fault_probabilities ({text!r}) must be comma-separated finite "
                         f"weights >= 0 with a positive sum")
    return weights


# Rank 0's random source, created from fault_injector_seed by the first setup_fault_injection call.
rng: random.Random | None = None


def _require_rng() -> random.Random:
    if rng is None:
        raise RuntimeError("the fault injector's rng is not set: call setup_fault_injection, or assign "
                           "megatron_core.fault_injector.rng")
    return rng


def _rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) without an initialised ``torch.distributed``."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def should_setup_fault_injection_at_start(config: FaultInjectorConfig) -> bool:
    """True when the fault's delay is counted from the start of training (no ``delay_start_iteration``)."""
    return config.fault_injector_delay_start_iteration is None


def should_setup_fault_injection_at_iteration(config: FaultInjectorConfig, iteration: int) -> bool:
    """True when the fault's delay is counted from the end of ``iteration``."""
    start = config.fault_injector_delay_start_iteration
    return start is not None and start == iteration


def get_fault_ranks(config: FaultInjectorConfig) -> list[int]:
    """The ranks to inject on: the configured list, or ``num_ranks`` drawn from 1..world_size-1."""
    world_size = _rank_and_world()[1]
    _check_ranks_fit(config, world_size)
    if config.fault_injector_ranks is not None:
        return _parse_ranks(config.fault_injector_ranks)
    return _require_rng().sample(range(1, world_size), k=config.fault_injector_num_ranks)


def _check_ranks_fit(config: FaultInjectorConfig, world_size: int) -> None:
    if config.fault_injector_ranks is not None:
        if max(_parse_ranks(config.fault_injector_ranks)) >= world_size:
            raise ValueError(f"fault_injector_ranks ({config.fault_injector_ranks!r}) must be below the world "
                             f"size ({world_size})")
        return
    num_ranks = config.fault_injector_num_ranks
    if num_ranks is None or num_ranks > world_size - 1:
        raise ValueError(f"fault_injector_num_ranks ({num_ranks}) must be set and at most world size - 1 "
                         f"({world_size - 1}): ranks are drawn from 1..{world_size - 1}")


def get_fault(config: FaultInjectorConfig) -> Fault:
    """One fault drawn from ``fault_types`` with the normalised ``fault_probabilities`` (uniform when unset)."""
    if config.fault_injector_fault_types is None:
        raise ValueError("fault_injector_fault_types must be set to draw a fault")
    faults = _parse_fault_types(config.fault_injector_fault_types)
    weights = [1.0] * len(faults)
    if config.fault_injector_fault_probabilities is not None:
        weights = _parse_probabilities(config.fault_injector_fault_probabilities)
    if len(weights) != len(faults):
        raise ValueError("fault_injector_fault_probabilities must give one weight per fault type")
    total = sum(weights)
    return _require_rng().choices(faults, [w / total for w in weights], k=1)[0]


def get_fault_delay(config: FaultInjectorConfig) -> float:
    """Seconds until the fault: ``fault_delay``, else ``offset + Exp(mean=mtti_seconds)``."""
    if config.fault_injector_fault_delay is not None:
        return float(config.fault_injector_fault_delay)
    if config.fault_injector_mtti_seconds is None:
        raise ValueError("fault_injector_fault_delay or fault_injector_mtti_seconds must be set")
    # Inverse-CDF draw of an exponential with rate 1 / mtti.
    sampled = -math.log(1.0 - _require_rng().random()) * config.fault_injector_mtti_seconds
    return (config.fault_injector_offset_seconds or 0.0) + sampled


_workload_flag = threading.Event()


def maybe_raise_workload_exception() -> None:
    """Raise :class:`InjectedException` once when a ``WORKLOAD_EXC`` fault has fired since the last call."""
    if _workload_flag.is_set():
        _workload_flag.clear()
        raise InjectedException("injected workload exception (Fault.WORKLOAD_EXC)")


def clear_workload_exception() -> None:
    """Forget a fired ``WORKLOAD_EXC`` fault that no :func:`maybe_raise_workload_exception` has raised yet."""
    _workload_flag.clear()


def _raise_in_thread(thread_id: int) -> None:
    set_async_exc = ctypes.pythonapi.PyThreadState_SetAsyncExc
    set_async_exc.argtypes = (ctypes.c_ulong, ctypes.py_object)
    if set_async_exc(thread_id, InjectedException) != 1:
        set_async_exc(thread_id, None)
        raise RuntimeError(f"could not raise InjectedException in thread {thread_id}")


def _on_sigusr1(signum: int, frame: object) -> None:
    raise InjectedException("injected signal exception (Fault.SIGNAL_EXC)")


def _hold_gil() -> None:
    # Exponential backtracking inside one C call of the regex engine, which never releases the GIL.
    re.match(r"(x+x+)+y", "x" * 64)


def _out_of_bounds_write(device: torch.device) -> None:
    # The index lives on the device, so only the kernel sees that it is out of range: a device-side assert.
    values = torch.zeros(1, device=device)
    values[torch.tensor([7], device=device)] = 1.0


def _fault_action(fault: Fault) -> Callable[[], object]:
    """What the timer thread does when ``fault`` fires (checks that need the caller's thread happen here)."""
    pid, main_thread = os.getpid(), threading.main_thread().ident
    process_signals = {Fault.SIGINT: signal.SIGINT, Fault.SIGKILL: signal.SIGKILL, Fault.SIGTERM: signal.SIGTERM,
                       Fault.SIGSTOP: signal.SIGSTOP}
    if fault in process_signals:
        return lambda: os.kill(pid, process_signals[fault])
    if fault in (Fault.GPU_ERROR, Fault.GPU_SLEEP):
        if not torch.cuda.is_available():
            raise RuntimeError(f"fault {fault.name} needs a CUDA device, and torch.cuda is not available")
        device = torch.device("cuda", torch.cuda.current_device())
        if fault is Fault.GPU_SLEEP:
            return lambda: (torch.cuda.set_device(device), torch.cuda._sleep(1 << 62))
        return lambda: _out_of_bounds_write(device)
    if fault is Fault.SIGNAL_EXC:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("fault SIGNAL_EXC must be set up from the main thread (it installs a SIGUSR1 handler)")
        signal.signal(signal.SIGUSR1, _on_sigusr1)
        return lambda: os.kill(pid, signal.SIGUSR1)
    actions: dict[Fault, Callable[[], object]] = {
        Fault.WORKLOAD_EXC: _workload_flag.set,
        Fault.ASYNC_EXC: lambda: _raise_in_thread(main_thread),
        Fault.OS_ABORT: os.abort,
        Fault.LOCK_GIL: _hold_gil,
        Fault.SEGFAULT: lambda: ctypes.string_at(1),
    }
    return actions[fault]


def dispatch_fault_injection(fault: Fault, delay: float, callback: Callable[[], object] | None = None
                             ) -> threading.Thread:
    """Fire ``fault`` in this process ``delay`` seconds from now (``callback`` runs just before); returns the
    daemon timer thread."""
    action = _fault_action(Fault(fault))

    def fire() -> None:
        time.sleep(delay)
        logger.critical("FAULT INJECTION: firing %s in process %d", fault.name, os.getpid())
        if callback is not None:
            callback()
        action()

    thread = threading.Thread(target=fire, name=f"fault-injector-{fault.name.lower()}", daemon=True)
    thread.start()
    return thread


def setup_fault_injection(config: FaultInjectorConfig) -> None:
    """Plan a fault on rank 0, broadcast it, and arm the timer on the target ranks (collective over all ranks).

    Without an initialised ``torch.distributed`` the process is rank 0 of a world of one.
    """
    global rng
    rank, world_size = _rank_and_world()
    _check_ranks_fit(config, world_size)  # on every rank, so that none is left waiting in the broadcast
    clear_workload_exception()
    use_cuda = world_size > 1 and dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    # plan[r] is the Fault value for rank r (NaN: no fault); plan[world_size] the delay in seconds.
    plan = torch.full((world_size + 1,), float("nan"), dtype=torch.float64, device=device)
    if rank == 0:
        if rng is None:
            rng = random.Random(config.fault_injector_seed)
        ranks, fault, delay = get_fault_ranks(config), get_fault(config), get_fault_delay(config)
        plan[ranks] = float(fault.value)
        plan[world_size] = delay
    if world_size > 1:
        dist.broadcast(plan, src=0)
    planned = plan.cpu().tolist()
    if math.isnan(planned[rank]):
        return
    fault, delay = Fault(int(planned[rank])), planned[world_size]
    now = datetime.datetime.now()
    logger.warning("FAULT INJECTION: rank %d will inject %s at %s", rank, fault.name,
                   (now + datetime.timedelta(seconds=delay)).strftime("%Y-%m-%d %H:%M:%S.%f"))
    dispatch_fault_injection(fault, delay)
