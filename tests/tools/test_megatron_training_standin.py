"""The harness's ``megatron.training`` stand-in (tools/megatron_unit_tests/megatron): importable next to an
installed ``megatron`` namespace, arguments as a namespace of defaults, checkpoint entry points skip."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "tools" / "megatron_unit_tests"

_PROBE = """
import sys, pytest
from unittest import mock
from megatron.training.arguments import parse_args
from megatron.training import training, checkpointing
args = parse_args(ignore_unknown_args=True)
assert training.get_args() is args and args.use_distributed_optimizer is False and args.ddp_bucket_size is None
with mock.patch("megatron.training.training.get_args", new=lambda: "patched"):
    assert training.get_args() == "patched"
try:
    checkpointing.save_checkpoint(1, [], None, None, 0)
except pytest.skip.Exception as e:
    assert "not part of the CPU harness" in str(e)
else:
    raise AssertionError("save_checkpoint should skip")
print("ok")
"""


def test_standin_imports_and_behaves(tmp_path):
    env_path = f"{ROOT / 'src'}:{HARNESS}"
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120,
                         env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")


def test_runner_copies_the_standin(tmp_path, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location("mut_run_standin", HARNESS / "run.py")
    run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mut_run_standin", run)  # its dataclasses look the module up
    spec.loader.exec_module(run)
    mirror = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
    if not mirror.exists():
        import pytest

        pytest.skip("no Megatron-LM mirror")
    run.prepare(mirror, tmp_path / "dest")
    assert (tmp_path / "dest" / "megatron" / "training" / "arguments.py").is_file()
    assert not (tmp_path / "dest" / "megatron" / "__init__.py").exists()  # stays a namespace package


def test_rank_launcher_reports_failed_tests_in_junit_and_exits_zero(tmp_path, monkeypatch):
    """torchrun stops every rank when one exits non-zero: a rank whose tests failed must not do that."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mut_run_launcher", HARNESS / "run.py")
    run = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "mut_run_launcher", run)
    spec.loader.exec_module(run)
    (tmp_path / "launcher.py").write_text(run._LAUNCHER)
    (tmp_path / "test_fails.py").write_text("def test_no():\n    assert False\n")
    env = {"PATH": "/usr/bin:/bin", "MCORE_JUNIT_DIR": str(tmp_path), "RANK": "1"}
    out = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), "-q", "-p", "no:cacheprovider",
                          str(tmp_path / "test_fails.py")], capture_output=True, text=True, timeout=120, env=env,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout[-1000:]
    assert "failure" in (tmp_path / "rank1.xml").read_text()
    out = subprocess.run([sys.executable, str(tmp_path / "launcher.py"), "-q", str(tmp_path / "missing.py")],
                         capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert out.returncode == 4  # usage errors still fail the rank
