"""Run Megatron-LM's own unit tests against megatron_core on CPU, as a measure of API fidelity.

A temporary copy of ``tests/unit_tests`` at a Megatron-LM tag is made under /tmp (NVIDIA's tests are
never committed here), ``megatron.core`` is rewritten to ``megatron_core`` in every file, and the test
harness (``test_utilities.py``, ``conftest.py``) is replaced by the CPU/gloo stand-ins next to this
script. Each area runs in its own pytest process; the pass fraction is reported per area. Test files
that import private (leading-underscore) names from ``megatron_core`` are left out of the counts.

Usage::

    python tools/megatron_unit_tests/run.py --repo /path/to/Megatron-LM [--areas parallel_state optimizer]
        [--world-size 1] [--out /tmp/mcore_unit_results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TAG = "core_v0.19.0"
UT = "tests/unit_tests"
AREAS = {
    "parallel_state": [f"{UT}/test_parallel_state.py"],
    "tensor_parallel": [f"{UT}/tensor_parallel"],
    "pipeline_parallel": [f"{UT}/pipeline_parallel"],
    "distributed": [f"{UT}/distributed"],
    "optimizer": [f"{UT}/optimizer", f"{UT}/test_optimizer.py", f"{UT}/test_optimizer_param_scheduler.py",
                  f"{UT}/test_num_microbatches_calculator.py"],
    "transformer": [f"{UT}/transformer"],
    "models": [f"{UT}/models"],
    "dist_checkpointing": [f"{UT}/dist_checkpointing"],
    "data": [f"{UT}/data"],
    "utils_and_names": [f"{UT}/test_utils.py", f"{UT}/test_hyper_comm_grid.py", f"{UT}/test_msc_utils.py",
                        f"{UT}/test_typed_torch.py", f"{UT}/test_local_multi_tensor_fns.py", f"{UT}/fusions"],
}
_PRIVATE_IMPORT = re.compile(
    r"from\s+megatron_core[\w.]*\s+import\s+\(?(?:[^)]*?[\s,(])?_[A-Za-z]\w*|megatron_core(?:\.\w+)*\._[A-Za-z]"
)


def prepare(repo: Path, dest: Path, tag: str = TAG) -> None:
    """Extract the unit tests at ``tag`` into ``dest``, rewrite the imports, install the CPU harness."""
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(repo), "archive", tag, UT], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True)
    (dest / "tests" / "__init__.py").touch()
    for path in (dest / UT).rglob("*.py"):
        text = path.read_text(errors="replace")
        new = re.sub(r"\bmegatron\.core\b", "megatron_core", text)
        if new != text:
            path.write_text(new)
    shutil.copy(HERE / "test_utilities.py", dest / UT / "test_utilities.py")
    shutil.copy(HERE / "conftest.py", dest / UT / "conftest.py")
    (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\n")


def private_files(dest: Path) -> set[str]:
    """Test files (relative to ``dest``) that import private megatron_core names."""
    return {str(p.relative_to(dest)) for p in (dest / UT).rglob("test_*.py") if _PRIVATE_IMPORT.search(p.read_text())}


def _test_files(dest: Path, paths: list[str]) -> list[str]:
    files = []
    for p in paths:
        full = dest / p
        if full.is_dir():
            files += sorted(str(f.relative_to(dest)) for f in full.rglob("test_*.py"))
        elif full.exists():
            files.append(p)
    return files


def run_area(dest: Path, area: str, paths: list[str], out_dir: Path, world_size: int, timeout: int,
             skip: set[str] = frozenset()) -> list[Path]:
    """Run one area's test files, each in a fresh pytest process (``timeout`` s per file); return JUnit paths.

    Files in ``skip`` (tests of private internals) are not run.
    """
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{dest}", WORLD_SIZE=str(world_size), RANK="0",
               LOCAL_RANK="0", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
    xmls = []
    for i, test_file in enumerate(f for f in _test_files(dest, paths) if f not in skip):
        xml = out_dir / f"{area}.{i}.xml"
        env["MCORE_TEST_STORE"] = str(out_dir / f"{area}.{i}.store")
        cmd = [sys.executable, "-m", "pytest", "-q", "-c", str(dest / "pytest.ini"), "--rootdir", str(dest),
               "--continue-on-collection-errors", f"--junitxml={xml}", test_file]
        proc = subprocess.Popen(cmd, cwd=dest, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        xmls.append(xml)
    return xmls


def summarize(xmls: list[Path], excluded: set[str]) -> dict:
    """Counts of passed / failed / errors / skipped tests over JUnit files, without excluded files."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0, "collection_errors": 0, "excluded": 0,
              "timed_out_files": 0}
    for xml in xmls:
        if not xml.exists():
            counts["timed_out_files"] += 1
            continue
        for case in ET.parse(xml).getroot().iter("testcase"):
            classname = case.get("classname") or case.get("name", "")  # a collection error has no class name
            module_file = classname.replace(".", "/")
            if any(module_file.startswith(f.removesuffix(".py")) for f in excluded):
                counts["excluded"] += 1
                continue
            kinds = {child.tag for child in case}
            if "error" in kinds and "." in case.get("name", "").split("[")[0]:  # a module that failed to import
                counts["collection_errors"] += 1
            elif "failure" in kinds:
                counts["failed"] += 1
            elif "error" in kinds:
                counts["errors"] += 1
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    ran = counts["passed"] + counts["failed"] + counts["errors"]
    counts["pass_fraction"] = round(counts["passed"] / ran, 3) if ran else None
    return counts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repo", type=Path, required=True, help="a Megatron-LM git clone")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--areas", nargs="*", default=list(AREAS), choices=list(AREAS))
    parser.add_argument("--world-size", type=int, default=1, help="only 1 is run by this script (one process)")
    parser.add_argument("--timeout", type=int, default=240, help="seconds per test file")
    parser.add_argument("--dest", type=Path, default=Path(tempfile.gettempdir()) / "mcore_unit_tests")
    parser.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = parser.parse_args(argv)
    prepare(args.repo, args.dest, args.tag)
    excluded = private_files(args.dest)
    out_dir = args.dest / "_results"
    out_dir.mkdir()
    results = {}
    print(f"{'area':20s} {'passed':>7s} {'failed':>7s} {'errors':>7s} {'skipped':>8s} {'coll.err':>8s} "
          f"{'excl.f':>6s} {'t/o':>4s} {'pass %':>7s}", flush=True)
    for area in args.areas:
        xmls = run_area(args.dest, area, AREAS[area], out_dir, args.world_size, args.timeout, excluded)
        c_files = len([f for f in _test_files(args.dest, AREAS[area]) if f in excluded])
        c = results[area] = summarize(xmls, excluded)
        c["excluded"] = c_files  # files importing private names: not run
        frac = "-" if c["pass_fraction"] is None else f"{100 * c['pass_fraction']:.1f}"
        print(f"{area:20s} {c['passed']:7d} {c['failed']:7d} {c['errors']:7d} {c['skipped']:8d} "
              f"{c['collection_errors']:8d} {c['excluded']:6d} {c['timed_out_files']:4d} {frac:>7s}", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"tag": args.tag, "world_size": args.world_size, "areas": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
