"""Fault injector: config validation, the plan draws, each fault kind in a child process, ranks on 2 gloo ranks.

Faults run in loops wired as Megatron-LM's ``train()`` (``tests/_fault_injector_child.py``), forked from one
launcher process so torch is imported once; the launcher's whole tree is killed at the end, so none is left behind.
"""

from __future__ import annotations

import math
import os
import random
import re
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_core import fault_injector as fi
from megatron_core.fault_injector import Fault, FaultInjectorConfig
from tests.dist_harness import run_on_ranks
from tests.process_tree import kill_tree, readline_within

ROOT = Path(__file__).resolve().parents[1]


def _config(**kwargs: object) -> FaultInjectorConfig:
    base = dict(fault_injector_ranks="1", fault_injector_fault_types="sigkill", fault_injector_fault_delay=1.0)
    return FaultInjectorConfig(**{**base, **kwargs})


@pytest.mark.parametrize("kwargs, fields", [
    (dict(fault_injector_num_ranks=2), ["fault_injector_ranks", "fault_injector_num_ranks"]),
    (dict(fault_injector_ranks="1,x"), ["fault_injector_ranks"]),
    (dict(fault_injector_ranks="-1"), ["fault_injector_ranks"]),
    (dict(fault_injector_fault_types="sigkill,meteor"), ["fault_injector_fault_types", "meteor"]),
    (dict(fault_injector_fault_types=None), ["fault_injector_fault_types"]),
    (dict(fault_injector_fault_probabilities="1,2"), ["fault_injector_fault_probabilities"]),
    (dict(fault_injector_fault_probabilities="-1"), ["fault_injector_fault_probabilities"]),
    (dict(fault_injector_fault_delay=-0.5), ["fault_injector_fault_delay", "-0.5"]),
    (dict(fault_injector_fault_delay=None), ["fault_injector_fault_delay", "fault_injector_mtti_seconds"]),
    (dict(fault_injector_mtti_seconds=0.0), ["fault_injector_mtti_seconds"]),
    (dict(fault_injector_offset_seconds=math.inf), ["fault_injector_offset_seconds"]),
    (dict(fault_injector_delay_start_iteration=-3), ["fault_injector_delay_start_iteration", "-3"]),
    (dict(fault_injector_ranks=None, fault_injector_num_ranks=0), ["fault_injector_num_ranks"]),
    (dict(fault_injector_seed=True), ["fault_injector_seed"]),
])
def test_invalid_config_names_the_fields(kwargs: dict, fields: list[str]) -> None:
    """Each bad value raises ValueError naming the field(s) involved."""
    with pytest.raises(ValueError) as err:
        _config(**kwargs)
    for field in fields:
        assert field in str(err.value)


def test_defaults_disable_injection_and_gate_setup_by_iteration() -> None:
    """All-None is valid (Megatron builds it from every run's args); the start/iteration gates follow the field."""
    assert FaultInjectorConfig() == FaultInjectorConfig(fault_injector_ranks=None)
    with pytest.raises(TypeError):
        FaultInjectorConfig("1")  # keyword-only, as Megatron's
    at_start = _config()
    assert fi.should_setup_fault_injection_at_start(at_start)
    assert not fi.should_setup_fault_injection_at_iteration(at_start, 0)
    later = _config(fault_injector_delay_start_iteration=4)
    assert not fi.should_setup_fault_injection_at_start(later)
    assert [fi.should_setup_fault_injection_at_iteration(later, i) for i in (3, 4, 5)] == [False, True, False]
    assert fi.__all__ == ["FaultInjectorConfig", "setup_fault_injection", "maybe_raise_workload_exception"]
    assert [f.value for f in Fault] == list(range(1, 13))


def test_plan_draws_follow_the_seeded_rng(monkeypatch: pytest.MonkeyPatch) -> None:
    """Delay = offset + inverse-CDF exponential of rng.random(); fault by normalised weights; explicit ranks kept."""
    monkeypatch.setattr(fi, "rng", random.Random(11))
    config = _config(fault_injector_fault_delay=None, fault_injector_mtti_seconds=30.0,
                     fault_injector_offset_seconds=2.5, fault_injector_ranks="0")
    u = random.Random(11).random()
    assert fi.get_fault_delay(config) == pytest.approx(2.5 - 30.0 * math.log(1.0 - u), rel=1e-12)
    assert fi.get_fault_delay(_config(fault_injector_fault_delay=0.75)) == 0.75
    weighted = _config(fault_injector_fault_types="sigterm,Workload_Exc", fault_injector_fault_probabilities="0,3")
    assert {fi.get_fault(weighted) for _ in range(20)} == {Fault.WORKLOAD_EXC}
    uniform = _config(fault_injector_fault_types="sigint,sigstop")
    assert {fi.get_fault(uniform) for _ in range(200)} == {Fault.SIGINT, Fault.SIGSTOP}
    assert fi.get_fault_ranks(config) == [0]
    with pytest.raises(ValueError, match="fault_injector_ranks .* world size \\(1\\)"):
        fi.get_fault_ranks(_config(fault_injector_ranks="0,1"))
    with pytest.raises(ValueError, match="fault_injector_num_ranks"):
        fi.get_fault_ranks(_config(fault_injector_ranks=None, fault_injector_num_ranks=1))


def test_workload_exception_fires_after_the_delay(monkeypatch: pytest.MonkeyPatch) -> None:
    """In-process WORKLOAD_EXC: nothing before the delay, one InjectedException after it, then quiet."""
    monkeypatch.setattr(fi, "rng", None)
    config = _config(fault_injector_ranks="0", fault_injector_fault_types="workload_exc",
                     fault_injector_fault_delay=0.3)
    start = time.monotonic()
    fi.setup_fault_injection(config)
    fi.maybe_raise_workload_exception()  # too early: must not raise
    deadline = start + 20.0
    with pytest.raises(fi.InjectedException):
        while time.monotonic() < deadline:
            fi.maybe_raise_workload_exception()
            time.sleep(0.01)
    assert time.monotonic() - start >= 0.3
    fi.maybe_raise_workload_exception()  # raised once only


def test_gpu_faults_need_cuda() -> None:
    """GPU_ERROR / GPU_SLEEP refuse to arm without CUDA, naming the fault."""
    if fi.torch.cuda.is_available():
        pytest.skip("CUDA present")
    for fault in (Fault.GPU_ERROR, Fault.GPU_SLEEP):
        with pytest.raises(RuntimeError, match=f"{fault.name} needs a CUDA device"):
            fi.dispatch_fault_injection(fault, 0.0)


def _launch(log_dir: Path, cases: list[str], cuda: bool = False) -> tuple[subprocess.Popen, dict[str, int]]:
    """Start the launcher that forks one loop per case; return it and each case's pid."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FAULT_CHILD_CUDA": "1" if cuda else "0"}
    launcher = subprocess.Popen([sys.executable, "-m", "tests._fault_injector_child", str(log_dir), *cases],
                                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_CORE, (0, 0)))
    pids: dict[str, int] = {}
    while len(pids) < len(cases):
        line = readline_within(launcher, 120.0)
        assert line and line.startswith("pid "), f"launcher said {line!r}"
        _, name, pid = line.split()
        pids[name] = int(pid)
    return launcher, pids


def _exit_codes(launcher: subprocess.Popen, count: int) -> dict[str, int]:
    """The launcher's ``exit NAME CODE`` lines (read through the same buffered pipe as the pids)."""
    codes: dict[str, int] = {}
    while len(codes) < count:
        line = readline_within(launcher, 120.0)
        assert line, f"a forked loop outlived its fault (ended so far: {codes})"
        if line.startswith("exit "):
            codes[line.split()[1]] = int(line.split()[2])
    launcher.wait(timeout=60)
    return codes


def _wait_stopped(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return True
        time.sleep(0.05)
    return False


def _goes_silent(log: Path, pid: int, quiet_s: float = 3.0, timeout: float = 60.0) -> bool:
    """The loop logging to ``log`` armed its fault, then wrote nothing for ``quiet_s`` while ``pid`` lived on."""
    deadline = time.monotonic() + timeout
    size, since = -1, time.monotonic()
    while time.monotonic() < deadline:
        text = log.read_text() if log.exists() else ""
        if len(text) != size:
            size, since = len(text), time.monotonic()
        elif "armed" in text.splitlines() and time.monotonic() - since >= quiet_s:
            return Path(f"/proc/{pid}").exists() and "no fault" not in text
        time.sleep(0.1)
    return False


def test_each_fault_kind_hits_the_loop_at_its_time(tmp_path: Path) -> None:
    """Every CPU fault kind, in forked training loops: signals end the process with that signal, SIGINT with a
    KeyboardInterrupt, the exception kinds reach the loop (in order), SIGSTOP stops and LOCK_GIL freezes it.

    ``sigkill`` counts its delay from the end of iteration 5, so that loop must have run past iteration 5.
    """
    cases = ["sigkill:0:5", "sigterm:0.1", "sigint:0.1", "os_abort:0.1", "segfault:0.1", "sigstop:0.1",
             "lock_gil:0.1", "workload_exc+async_exc+signal_exc:0.1"]
    launcher, pids = _launch(tmp_path, cases)
    try:
        assert _wait_stopped(pids["sigstop"], 60.0)
        assert _goes_silent(tmp_path / "lock_gil.log", pids["lock_gil"])
        for frozen in ("sigstop", "lock_gil"):
            os.kill(pids[frozen], signal.SIGKILL)
        codes = _exit_codes(launcher, len(cases))
    finally:
        kill_tree(launcher)
    assert codes == {"sigkill": -9, "sigterm": -15, "sigint": 130, "os_abort": -6, "segfault": -11, "sigstop": -9,
                     "lock_gil": -9, "workload_exc+async_exc+signal_exc": 0}
    logs = {name: (tmp_path / f"{name}.log").read_text() for name in pids}
    assert max(_iterations(logs["sigkill"])) >= 5 and "firing SIGKILL" in logs["sigkill"]
    assert "KeyboardInterrupt" in logs["sigint"]
    for name, log in logs.items():
        assert "no fault" not in log, (name, log)
        assert name == "sigkill" or "armed" in log.splitlines(), (name, log)
    # An exception raised between a loop line's text and its newline joins the next line to it ("iter 6injected at
    # 6 by signal_exc"): the injected lines are found anywhere in a line.
    injected = re.findall(r"injected at \d+ by ([a-z_]+)", logs[cases[-1].split(":")[0]])
    assert injected == ["workload_exc", "async_exc", "signal_exc"]


def _iterations(out: str) -> list[int]:
    # The timer thread's "FAULT ..." line can land between a loop line's number and its newline ("iter 6FAULT").
    return [int(m.group(1)) for m in re.finditer(r"^iter (\d+)", out, flags=re.MULTILINE)]


@pytest.mark.gpu
def test_gpu_error_and_gpu_sleep_hit_the_training_loop(tmp_path: Path) -> None:
    """GPU_ERROR: the loop's next CUDA sync raises (device-side assert); GPU_SLEEP: its next sync never returns."""
    launcher, pids = _launch(tmp_path, ["gpu_error:0.5", "gpu_sleep:0.5"], cuda=True)
    try:
        assert _goes_silent(tmp_path / "gpu_sleep.log", pids["gpu_sleep"])
        os.kill(pids["gpu_sleep"], signal.SIGKILL)
        codes = _exit_codes(launcher, 2)
    finally:
        kill_tree(launcher)
    assert codes == {"gpu_error": 1, "gpu_sleep": -9}
    assert "device-side assert" in (tmp_path / "gpu_error.log").read_text()


def _plan_on_two_ranks(kwargs: dict) -> tuple[int, bool, bool]:
    """Set up the plan; report whether this rank's WORKLOAD_EXC arrived (polled for up to 10 s) and not early."""
    fi.rng = None
    fi.setup_fault_injection(FaultInjectorConfig(fault_injector_fault_types="workload_exc",
                                                 fault_injector_fault_delay=0.2, fault_injector_seed=3, **kwargs))
    early = False
    try:
        fi.maybe_raise_workload_exception()
    except fi.InjectedException:
        early = True
    got = False
    deadline = time.monotonic() + (10.0 if dist.get_rank() == 1 else 1.0)
    while time.monotonic() < deadline and not got:
        try:
            fi.maybe_raise_workload_exception()
        except fi.InjectedException:
            got = True
        time.sleep(0.01)
    dist.barrier()
    fi.rng = None
    fi.clear_workload_exception()
    return dist.get_rank(), got, early


def test_only_planned_ranks_fault_on_two_gloo_ranks() -> None:
    """Explicit ranks and a random draw (which never picks rank 0) both fault only rank 1, after the delay."""
    expected = [(0, False, False), (1, True, False)]
    assert run_on_ranks(2, _plan_on_two_ranks, dict(fault_injector_ranks="1")) == expected
    assert run_on_ranks(2, _plan_on_two_ranks, dict(fault_injector_num_ranks=1)) == expected
