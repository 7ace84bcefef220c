"""Section 7, check 9: the suite's per-test wall limit, short subgroup timeouts, no process left behind.

- ``pyproject.toml`` sets pytest-timeout's ``timeout`` to at most 300 s (pytest-timeout is in the
  ``dev`` extra), and the plugin is active in this session;
- ``initialize_model_parallel`` called in a test (through ``tests/dist_harness.py``) creates every
  subgroup with the pool's short timeout, not the library's 30-minute default;
- a test session whose test leaves a child process running ends with a failing exit status that
  names the process (``tests/conftest.py``'s session-finish check);
- every blocking call in the tests (subprocess runs, ``communicate``/``wait``/``join``/``get``, pipe
  reads) carries a timeout (``tests/blocking_calls.py``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_core import parallel_state
from tests.blocking_calls import unbounded_blocking_calls
from tests.dist_harness import PROCESS_GROUP_TIMEOUT_S, run_on_ranks

REPO = Path(__file__).resolve().parents[2]

LEAKY_TEST = '''
import subprocess, sys

def test_leaves_a_child_behind(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    open("{pid_file}", "w").write(str(child.pid))
'''


def test_per_test_wall_limit_is_configured(pytestconfig) -> None:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    timeout = int(pyproject["tool"]["pytest"]["ini_options"]["timeout"])
    assert 0 < timeout <= 300
    assert any(dep.startswith("pytest-timeout") for dep in pyproject["project"]["optional-dependencies"]["dev"])
    if pytestconfig.pluginmanager.hasplugin("timeout"):
        assert int(float(pytestconfig.getini("timeout"))) == timeout


def test_a_process_left_behind_fails_the_session(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    test_file = tmp_path / "test_leaky.py"
    test_file.write_text(LEAKY_TEST.format(pid_file=pid_file))
    # The child sleeps 120 s: a 2 s grace (15 s in a real session) is enough to see it left behind.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)]),
           "MCORE_TEST_LEFT_BEHIND_GRACE_S": "2"}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "--rootdir", str(tmp_path), str(test_file)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    try:
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert "1 passed" in proc.stdout and "processes left behind" in proc.stdout, proc.stdout[-2000:]
        assert "time.sleep(120)" in proc.stdout
    finally:
        if pid_file.exists():
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass
    if not pid_file.exists():
        pytest.fail("the inner test did not start its child")


def _subgroup_timeouts() -> list[float]:
    seen: list[float] = []
    original = dist.new_group

    def recording(*args, **kwargs):
        seen.append(kwargs["timeout"].total_seconds())
        return original(*args, **kwargs)

    dist.new_group = recording
    try:
        parallel_state.initialize_model_parallel(2, 1)
    finally:
        dist.new_group = original
        parallel_state.destroy_model_parallel()
    return seen


def test_subgroups_made_in_tests_use_the_short_timeout() -> None:
    for timeouts in run_on_ranks(2, _subgroup_timeouts):
        assert timeouts and max(timeouts) <= PROCESS_GROUP_TIMEOUT_S <= 60, timeouts


def test_every_blocking_call_in_the_tests_has_a_timeout() -> None:
    found = unbounded_blocking_calls(REPO / "tests")
    assert not found, "blocking calls without a timeout:\n" + "\n".join(found)


def test_the_blocking_call_scan_finds_what_it_should(tmp_path: Path) -> None:
    (tmp_path / "sample.py").write_text(
        "import subprocess\n"
        "subprocess.run(['true'])\n"                 # flagged
        "subprocess.run(['true'], timeout=5)\n"
        "proc.communicate()\n"                       # flagged
        "proc.communicate(timeout=5)\n"
        "q.get()\n"                                  # flagged
        "d.get('key')\n"
        "', '.join(parts)\n"
        "proc.stdout.readline()\n"                   # flagged
        "dist.barrier()\n"
        "asyncio.wait_for(event.wait(), 5)\n"
        "asyncio.wait_for(event.wait())\n"          # flagged: no timeout given
    )
    assert [line.split(":")[1] for line in unbounded_blocking_calls(tmp_path)] == ["2", "4", "6", "9", "12"]


def test_every_listed_slow_test_exists() -> None:
    from tests.conftest import SLOW_TESTS

    for node_id in SLOW_TESTS:
        path, _, name = node_id.partition("::")
        function = name.split("[")[0]
        assert (REPO / path).is_file() and f"def {function}(" in (REPO / path).read_text(), node_id
