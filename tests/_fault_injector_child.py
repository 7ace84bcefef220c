"""A toy training loop wired to the fault injector as Megatron-LM's ``train()`` wires it (run by test_fault_injector).

Usage: ``python -m tests._fault_injector_child LOG_DIR CASE...`` runs one forked loop per case (see
:func:`launch`). A loop for ``FAULT[+FAULT...]`` prints ``armed [N]`` when the plan is set up, ``iter N`` at
each iteration, ``injected at N by FAULT`` when an InjectedException arrives (then the next fault's loop
starts; exit 0 after the last) and ``no fault`` if a loop ends without one (exit 3).
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from pathlib import Path

import torch

from megatron_core.fault_injector import (
    FaultInjectorConfig,
    InjectedException,
    maybe_raise_workload_exception,
    setup_fault_injection,
    should_setup_fault_injection_at_iteration,
    should_setup_fault_injection_at_start,
)

ITERATIONS, STEP_S = 300, 0.02
# FAULT_CHILD_CUDA=1: each iteration waits for a small CUDA computation, as a GPU training step does.
CUDA_STEP = os.environ.get("FAULT_CHILD_CUDA") == "1"


def run(fault: str, delay: float, start_iteration: int | None) -> int:
    config = FaultInjectorConfig(fault_injector_ranks="0", fault_injector_fault_types=fault,
                                 fault_injector_fault_delay=delay,
                                 fault_injector_delay_start_iteration=start_iteration)
    iteration = 0
    try:
        if should_setup_fault_injection_at_start(config):
            setup_fault_injection(config)
            print("armed", flush=True)
        for iteration in range(1, ITERATIONS + 1):
            print(f"iter {iteration}", flush=True)
            time.sleep(STEP_S)
            if CUDA_STEP:
                torch.ones(4, device="cuda").sum().item()
            if iteration != 1:
                maybe_raise_workload_exception()
            if should_setup_fault_injection_at_iteration(config, iteration):
                setup_fault_injection(config)
                print(f"armed {iteration}", flush=True)
    except InjectedException:
        print(f"injected at {iteration} by {fault}", flush=True)
        return 0
    print("no fault", flush=True)
    return 3


def main(faults: str, delay: float, start_iteration: int | None) -> int:
    """Run the loop once per fault of ``faults`` ("a+b": one after the other); the first non-zero code ends it."""
    for fault in faults.split("+"):
        code = run(fault, delay, start_iteration)
        if code:
            return code
    return 0


def launch(log_dir: Path, cases: list[str]) -> int:
    """Fork one loop per case ``FAULT:DELAY[:START_ITERATION]`` (its output in ``log_dir/FAULT.log``).

    Prints ``pid FAULT PID`` for each, then ``exit FAULT CODE`` as each ends (CODE is minus the signal that ended
    it, 130 for a KeyboardInterrupt, 1 for another exception). Forking from this one process (which has not
    touched CUDA) saves each loop the import of torch.
    """
    names = {}
    for case in cases:
        fault, delay, *start = case.split(":")
        pid = os.fork()
        if pid == 0:
            # A training process in the foreground turns SIGINT into KeyboardInterrupt; a shell that starts a job in
            # the background (as CI runners may) leaves SIGINT ignored, and Python then installs no handler.
            signal.signal(signal.SIGINT, signal.default_int_handler)
            log = os.open(log_dir / f"{fault}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            code = 1
            try:
                code = main(fault, float(delay), int(start[0]) if start else None)
            except KeyboardInterrupt:
                print("KeyboardInterrupt", flush=True)
                code = 130
            except Exception:  # noqa: BLE001 - the test reads the traceback
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        names[pid] = fault
        print(f"pid {fault} {pid}", flush=True)
    while names:
        pid, status = os.waitpid(-1, 0)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        print(f"exit {names.pop(pid)} {code}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(launch(Path(sys.argv[1]), sys.argv[2:]))
