"""tools/import_graph.py: the package has no import cycle between its parts and keeps its declared layering."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import import_graph

ROOT = Path(__file__).resolve().parents[2]


def test_package_has_no_cycle_and_no_layering_violation():
    result = import_graph.report(import_graph.scan())
    assert result["cycles"] == []
    assert result["violations"] == []
    edges = {(e["src"], e["dst"]) for e in result["edges"]}
    core_deps = {dst for src, dst in edges if src == "dist_checkpointing"}
    assert core_deps <= {"parallel_state", "device", "utils", "process_groups_config"}, core_deps
    for upper in ("tensor_parallel", "transformer", "optimizer"):
        assert (upper, "dist_checkpointing") in edges
        assert ("dist_checkpointing", upper) not in edges


def test_cli_exits_zero_and_prints_the_graph():
    proc = subprocess.run([sys.executable, "tools/import_graph.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "cycles: 0" in proc.stdout and "layering violations: 0" in proc.stdout


def test_detects_cycles_and_upward_imports(tmp_path):
    pkg = tmp_path / "megatron_core"
    (pkg / "transformer").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "transformer" / "__init__.py").write_text("from megatron_core.optimizer import x\n")
    (pkg / "optimizer").mkdir()
    (pkg / "optimizer" / "__init__.py").write_text("from megatron_core.transformer import y\n")
    (pkg / "utils.py").write_text(
        "def f():\n"
        "    from megatron_core.transformer import z  # lazy-import: documented\n"
        "    from megatron_core.optimizer import w\n"
    )
    old = import_graph.SRC
    import_graph.SRC = pkg
    try:
        result = import_graph.report(import_graph.scan(pkg))
    finally:
        import_graph.SRC = old
    assert result["cycles"] == [["optimizer", "transformer"]]
    assert any("transformer -> optimizer" in v for v in result["violations"])
    assert any("utils -> optimizer" in v for v in result["violations"])
    assert not any("utils -> transformer" in v for v in result["violations"])
    assert len(result["documented_lazy"]) == 1
