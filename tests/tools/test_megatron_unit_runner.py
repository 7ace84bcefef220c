"""tools/megatron_unit_tests/run.py: reads files.txt / nv_pass.txt and scores JUnit results per rank."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("mut_run", ROOT / "tools" / "megatron_unit_tests" / "run.py")
run = importlib.util.module_from_spec(_spec)
sys.modules["mut_run"] = run
_spec.loader.exec_module(run)

UT = "tests/unit_tests"
JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="tests.unit_tests.test_a.TestX" name="test_one[1-2]"/>
<testcase classname="tests.unit_tests.test_a.TestX" name="test_two"><failure message="AssertionError: boom&#10;more">tb</failure></testcase>
<testcase classname="tests.unit_tests.test_a" name="test_free"><skipped message="needs GPU"/></testcase>
<testcase classname="tests.unit_tests.test_a" name="test_fix"><error message="failed on setup with &quot;file x.py, line 3&quot;">
file x.py, line 3
E       fixture 'mocker' not found
</error></testcase>
{extra}
</testsuite></testsuites>"""


def test_files_list_and_expected(tmp_path):
    files = tmp_path / "files.txt"
    files.write_text(f"# comment\n\n{UT}/test_a.py 2\n{UT}/data/test_b.py::test_b\n")
    entries = run.read_files_list(files)
    assert [(e.target, e.ranks) for e in entries] == [(f"{UT}/test_a.py", 2), (f"{UT}/data/test_b.py::test_b", 1)]
    nv = [f"{UT}/test_a.py::TestX::test_one[1-2]", f"{UT}/test_ab.py::test_z", f"{UT}/data/test_b.py::test_b[x]",
          f"{UT}/data/test_b.py::test_b_other"]
    assert run.expected_for(entries[0], nv) == nv[:1]
    assert run.expected_for(entries[1], nv) == [nv[2]]
    assert run.select(entries, ["test_b.py::test_b"]) == entries[1:]


def test_junit_scoring_needs_every_rank(tmp_path):
    f = f"{UT}/test_a.py"
    r0, r1 = tmp_path / "r0.xml", tmp_path / "r1.xml"
    r0.write_text(JUNIT.format(extra=""))
    r1.write_text(JUNIT.format(extra="").replace('name="test_one[1-2]"/>',
                                                  'name="test_one[1-2]"><error message="RuntimeError: rank1"/>'
                                                  '</testcase>'))
    results, file_error = run.parse_junit(r0, f)
    assert file_error is None
    assert results == {f"{f}::TestX::test_one[1-2]": None, f"{f}::TestX::test_two": "AssertionError: boom",
                       f"{f}::test_free": "skipped: needs GPU",
                       f"{f}::test_fix": "failed on setup: fixture 'mocker' not found"}
    entry = run.Entry(f, 2)
    expected = [f"{f}::TestX::test_one[1-2]", f"{f}::test_free", f"{f}::test_missing"]
    out = run.combine(entry, expected, [run.parse_junit(r0, f), run.parse_junit(r1, f)], timed_out=False)
    assert out == {expected[0]: "rank 1: RuntimeError: rank1", expected[1]: "rank 0: skipped: needs GPU",
                   expected[2]: "rank 0: not collected"}
    assert run.combine(entry, expected[:1], [run.parse_junit(r0, f), None], timed_out=True) == {
        expected[0]: "rank 1: file timed out"}


def test_collection_error_names_the_import(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text('<testsuites><testsuite><testcase classname="" name="tests.unit_tests.test_a">'
                   '<error message="collection failure">Traceback:\nx.py:1: in m\n'
                   "E   ModuleNotFoundError: No module named 'foo'</error></testcase></testsuite></testsuites>")
    results, file_error = run.parse_junit(xml, f"{UT}/test_a.py")
    assert results == {}
    assert file_error == "collection error: ModuleNotFoundError: No module named 'foo'"
    out = run.combine(run.Entry(f"{UT}/test_a.py"), [f"{UT}/test_a.py::t"], [(results, file_error)], False)
    assert out == {f"{UT}/test_a.py::t": file_error}


def test_module_level_te_imports_become_stand_ins():
    source = "import os\nfrom transformer_engine.pytorch.fp8 import fp8_autocast, x\n    from transformer_engine.a import b\n"
    out = run._TE_IMPORT.sub(run._guard_te_import, source)
    assert "    from transformer_engine.a import b\n" in out  # only module-level imports are guarded
    namespace: dict = {}
    harness = importlib.util.spec_from_file_location("harness", ROOT / "tools" / "megatron_unit_tests" /
                                                     "test_utilities.py")
    module = importlib.util.module_from_spec(harness)
    harness.loader.exec_module(module)
    guarded = out.split("\n", 1)[1].rsplit("    from transformer_engine.a", 1)[0]
    guarded = guarded.replace("from tests.unit_tests.test_utilities import MissingTE as _MissingTE",
                              "_MissingTE = MissingTE")
    exec(guarded, {"MissingTE": module.MissingTE}, namespace)
    with pytest.raises(ImportError, match="fp8_autocast: Transformer Engine is not installed"):
        namespace["fp8_autocast"](enabled=True)
