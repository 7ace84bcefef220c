"""Run Megatron-LM's own unit tests against megatron_core on CPU: the share of what megatron-core passes.

A temporary copy of ``tests/unit_tests`` at a Megatron-LM tag is made under /tmp (NVIDIA's tests are
never committed here), ``megatron.core`` is rewritten to ``megatron_core`` in every file, and the test
harness (``test_utilities.py``, ``conftest.py``) is replaced by the CPU/gloo stand-ins next to this
script. Each entry of ``files.txt`` (a test file or a ``file::test`` node) runs in its own pytest
process, or under ``torchrun --nproc-per-node N`` when the list gives it N ranks, with a wall-clock limit
per entry. The measure is the share of ``nv_pass.txt`` (the tests megatron-core 0.19.2 passes) that
pass here; a test counts only when it passes on every rank. Failures are listed with their first error
line and everything is written to a JSON file.

Usage::

    python tools/megatron_unit_tests/run.py [--files test_parallel_state.py transformer/test_mlp.py]
        [--timeout 120] [--out /tmp/mcore_unit_results.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TAG = "core_v0.19.0"
UT = "tests/unit_tests"
MIRROR = Path("/work/.mirror/NVIDIA+Megatron-LM/repo")
REFERENCE = Path("/work/shared/reference/megatron_unit_tests")
# Runs pytest with a JUnit file per rank (torchrun gives every rank the same arguments). Failed tests (pytest's
# exit code 1) exit 0: torchrun terminates every other rank as soon as one exits non-zero, which killed a rank
# that was still finishing its last test or writing its JUnit file.
_LAUNCHER = """import os, sys
import pytest
rank = os.environ.get("RANK", "0")
code = pytest.main(sys.argv[1:] + [f"--junitxml={os.environ['MCORE_JUNIT_DIR']}/rank{rank}.xml"])
sys.exit(0 if code in (0, 1) else int(code))
"""


# A module-level ``from transformer_engine... import a, b``: Transformer Engine is not installed on the CPU
# harness, so the names become stand-ins that raise ImportError when used and the module's other tests run.
_TE_IMPORT = re.compile(r"^from (transformer_engine[\w.]*) import ([\w, ]+)$", re.MULTILINE)


def _guard_te_import(match: re.Match) -> str:
    names = [n.strip() for n in match.group(2).split(",") if n.strip()]
    stand_ins = "\n".join(f"    {n} = _MissingTE('{match.group(1)}.{n}')" for n in names)
    return (f"try:\n    {match.group(0)}\nexcept ImportError:  # CPU harness: no Transformer Engine\n"
            f"    from tests.unit_tests.test_utilities import MissingTE as _MissingTE\n{stand_ins}")


@dataclass
class Entry:
    """One line of files.txt: a test file (or ``file::test`` node) and the ranks it runs on."""

    target: str
    ranks: int = 1

    @property
    def file(self) -> str:
        """The test file of the entry."""
        return self.target.split("::")[0]


@dataclass
class EntryResult:
    """The outcome of one entry: per nv_pass test, ``None`` when passed, else the reason."""

    entry: Entry
    outcomes: dict[str, str | None] = field(default_factory=dict)
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def passed(self) -> int:
        """How many nv_pass tests passed on every rank."""
        return sum(v is None for v in self.outcomes.values())


def read_files_list(path: Path) -> list[Entry]:
    """The entries of files.txt (``path [ranks]`` per line; ``#`` comments and blank lines skipped)."""
    entries = []
    for line in path.read_text().splitlines():
        parts = line.split("#")[0].split()
        if parts:
            entries.append(Entry(parts[0], int(parts[1]) if len(parts) > 1 else 1))
    return entries


def read_nv_pass(path: Path) -> list[str]:
    """The node ids of nv_pass.txt."""
    return [ln.strip() for ln in path.read_text().splitlines() if ln.strip() and not ln.startswith("#")]


def expected_for(entry: Entry, nv_pass: list[str]) -> list[str]:
    """The nv_pass node ids that ``entry`` runs."""
    return [t for t in nv_pass if t == entry.target or t.startswith(entry.target + ("::" if "::" not in
                                                                                      entry.target else "["))]


def prepare(repo: Path, dest: Path, tag: str = TAG) -> None:
    """Extract the unit tests at ``tag`` into ``dest``, rewrite the imports, install the CPU harness."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", f"--git-dir={repo}", "archive", tag, UT], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "tests" / "__init__.py").touch()
    for path in (dest / UT).rglob("*.py"):
        text = path.read_text(errors="replace")
        new = _TE_IMPORT.sub(_guard_te_import, re.sub(r"\bmegatron\.core\b", "megatron_core", text))
        if new != text:
            path.write_text(new)
    shutil.copy(HERE / "test_utilities.py", dest / UT / "test_utilities.py")
    shutil.copy(HERE / "conftest.py", dest / UT / "conftest.py")
    # megatron.training (Megatron-LM's trainer, imported by the dist_checkpointing tests) as a thin stand-in
    shutil.copytree(HERE / "megatron", dest / "megatron", ignore=shutil.ignore_patterns("__pycache__"))
    (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")
    (dest / "_rank_pytest.py").write_text(_LAUNCHER)


def _node_id(case: ET.Element, file: str) -> str:
    """The pytest node id of a JUnit test case of ``file``."""
    module = file.removesuffix(".py").replace("/", ".")
    classname = case.get("classname") or ""
    rest = classname[len(module) + 1:] if classname.startswith(module + ".") else ""
    return "::".join([file, *([rest.replace(".", "::")] if rest else []), case.get("name", "")])


def _first_line(text: str | None) -> str:
    for line in (text or "").splitlines():
        if line.strip():
            return line.strip()[:300]
    return ""


def parse_junit(xml: Path, file: str) -> tuple[dict[str, str | None], str | None]:
    """Per node id: ``None`` if passed, else the first error line; plus a file-level (collection) error."""
    results: dict[str, str | None] = {}
    file_error = None
    for case in ET.parse(xml).getroot().iter("testcase"):
        bad = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        reason = None
        if bad is not None:
            body = _first_line(bad.get("message")) or _first_line(bad.text)
            if body.startswith("failed on "):  # a fixture error: the message names only the file
                e_lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
                body = f"{body.split(' with ')[0]}: {e_lines[0][:300]}" if e_lines else body
            reason = f"{'skipped: ' if bad.tag == 'skipped' else ''}{body}"
        if not case.get("classname") and bad is not None and bad.tag == "error":
            e_lines = [ln[1:].strip() for ln in (bad.text or "").splitlines() if ln.startswith("E ")]
            file_error = f"collection error: {e_lines[0][:300] if e_lines else reason}"
            continue
        node = _node_id(case, file)
        if node in results and results[node] is None and reason is not None:
            results[node] = reason  # a teardown error after a pass
        elif node not in results or reason is not None:
            results[node] = reason
    return results, file_error


def combine(entry: Entry, expected: list[str], per_rank: list[tuple[dict[str, str | None], str | None] | None],
            timed_out: bool) -> dict[str, str | None]:
    """Per nv_pass test of the entry: ``None`` when it passed on every rank, else the first reason found."""
    outcomes: dict[str, str | None] = {}
    for test in expected:
        reason = None
        for rank, result in enumerate(per_rank):
            if result is None:
                reason = "file timed out" if timed_out else "no JUnit result (process died)"
            else:
                results, file_error = result
                if test in results:
                    reason = results[test]
                else:
                    reason = file_error or ("file timed out" if timed_out else "not collected")
            if reason is not None:
                if entry.ranks > 1:
                    reason = f"rank {rank}: {reason}"
                break
        outcomes[test] = reason
    return outcomes


def run_entry(dest: Path, entry: Entry, expected: list[str], out_dir: Path, timeout: int,
              src: Path = ROOT / "src") -> EntryResult:
    """Run one entry in a fresh process group (``torchrun`` for several ranks), killed after ``timeout`` s.

    ``src`` is the directory that holds the ``megatron_core`` package under test.
    """
    tag = re.sub(r"\W+", "_", entry.target.removeprefix(UT + "/"))
    junit_dir = out_dir / tag
    junit_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=f"{src}{os.pathsep}{dest}", CUDA_VISIBLE_DEVICES="",
               OMP_NUM_THREADS="1", MCORE_JUNIT_DIR=str(junit_dir), MCORE_TEST_STORE=str(junit_dir / "store"),
               MCORE_UNIT_TEST_TIMEOUT=str(timeout))
    pytest_args = ["-q", "-c", str(dest / "pytest.ini"), "--rootdir", str(dest), entry.target]
    if entry.ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={entry.ranks}",
               str(dest / "_rank_pytest.py"), *pytest_args]
    else:
        env.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0")
        cmd = [sys.executable, str(dest / "_rank_pytest.py"), *pytest_args]
    log = (junit_dir / "log.txt").open("w")
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()
    per_rank = []
    for rank in range(entry.ranks):
        xml = junit_dir / f"rank{rank}.xml"
        per_rank.append(parse_junit(xml, entry.file) if xml.exists() else None)
    return EntryResult(entry, combine(entry, expected, per_rank, timed_out), time.monotonic() - start, timed_out)


def select(entries: list[Entry], wanted: list[str] | None) -> list[Entry]:
    """The entries whose target ends with (or contains) one of ``wanted``; all when ``wanted`` is empty."""
    if not wanted:
        return entries
    return [e for e in entries if any(e.target.endswith(w) or w in e.target for w in wanted)]


def report(results: list[EntryResult], total_expected: int, args: argparse.Namespace) -> dict:
    """Print the per-file table and failures; return the JSON summary."""
    passed = sum(r.passed for r in results)
    print(f"\n{'file':62s} {'ranks':>5s} {'passed':>9s} {'secs':>6s}")
    for r in results:
        flag = " TIMEOUT" if r.timed_out else ""
        print(f"{r.entry.target.removeprefix(UT + '/'):62s} {r.entry.ranks:5d} "
              f"{r.passed:4d}/{len(r.outcomes):<4d} {r.seconds:6.1f}{flag}")
    pct = 100 * passed / total_expected if total_expected else 0.0
    print(f"{'TOTAL':62s} {'':5s} {passed:4d}/{total_expected:<4d} ({pct:.1f}%)")
    print("\nfailing nv_pass tests (first error line):")
    for r in results:
        for test, reason in r.outcomes.items():
            if reason is not None:
                print(f"  {test.removeprefix(UT + '/')}: {reason}")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "tag": args.tag, "timeout_s": args.timeout, "passed": passed, "of": total_expected,
        "percent": round(pct, 1),
        "files": {r.entry.target: {"ranks": r.entry.ranks, "passed": r.passed, "of": len(r.outcomes),
                                   "seconds": round(r.seconds, 1), "timed_out": r.timed_out,
                                   "failures": {t: m for t, m in r.outcomes.items() if m is not None}}
                  for r in results},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, default=MIRROR, help="a Megatron-LM git directory (bare or not)")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--files-list", type=Path, default=REFERENCE / "files.txt")
    parser.add_argument("--nv-pass", type=Path, default=REFERENCE / "nv_pass.txt")
    parser.add_argument("--files", nargs="*", help="run only the entries whose path ends with / contains these")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per entry (file)")
    parser.add_argument("--dest", type=Path, default=Path(tempfile.gettempdir()) / f"mcore_unit_tests_{os.getpid()}")
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "mcore_unit_results.json",
                        help="write the summary as JSON here")
    parser.add_argument("--src", type=Path, default=ROOT / "src",
                        help="the directory holding the megatron_core package to test (default: this checkout's)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (and the logs) afterwards")
    args = parser.parse_args(argv)
    repo = args.repo / ".git" if (args.repo / ".git").exists() else args.repo
    entries = select(read_files_list(args.files_list), args.files)
    nv_pass = read_nv_pass(args.nv_pass)
    prepare(repo, args.dest, args.tag)
    out_dir = args.dest / "_results"
    results = []
    try:
        for entry in entries:
            expected = expected_for(entry, nv_pass)
            r = run_entry(args.dest, entry, expected, out_dir, args.timeout, args.src.resolve())
            print(f"{entry.target}: {r.passed}/{len(expected)} in {r.seconds:.0f}s"
                  f"{' (timed out)' if r.timed_out else ''}", flush=True)
            results.append(r)
        summary = report(results, sum(len(r.outcomes) for r in results), args)
        args.out.write_text(json.dumps(summary, indent=1))
        print(f"\nJSON: {args.out}")
    finally:
        if not args.keep:
            shutil.rmtree(args.dest, ignore_errors=True)
        else:
            print(f"kept {args.dest}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
