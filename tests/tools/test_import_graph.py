"""tools/import_graph.py: every import counts; the package has no file circle, no subpackage cycle, no upward import."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import import_graph

ROOT = Path(__file__).resolve().parents[2]


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "megatron_core"
    for name, text in files.items():
        path = pkg / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return pkg


def _report(monkeypatch: pytest.MonkeyPatch, pkg: Path) -> dict:
    monkeypatch.setattr(import_graph, "SRC", pkg)
    return import_graph.report(import_graph.scan(pkg))


def test_every_import_counts_lazy_and_tagged_and_private(tmp_path, monkeypatch):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "_ground/__init__.py": "",
        "_ground/a.py": "def f():\n    from megatron_core.transformer import layer  # lazy-import: no exemption\n",
        "transformer/__init__.py": "",
        "transformer/layer.py": "from megatron_core._ground import a\n",
        "optimizer/__init__.py": "from megatron_core.transformer.layer import x\n",
        "transformer/adam_user.py": "import megatron_core.optimizer\n",
    })
    result = _report(monkeypatch, pkg)
    assert result["lazy_imports"] == 1
    assert ["megatron_core._ground.a", "megatron_core.transformer.layer"] in result["file_circles"]
    assert {(c["src"], c["dst"]) for c in result["subpackage_cycles"]} == {
        ("_ground", "transformer"), ("transformer", "_ground"), ("optimizer", "transformer"),
        ("transformer", "optimizer")}
    upward = result["upward_imports"]
    assert "megatron_core._ground.a:2 -> megatron_core.transformer.layer" in upward
    assert "megatron_core.transformer.adam_user:1 -> megatron_core.optimizer" in upward
    assert import_graph.failed(result)


def test_from_package_import_submodule_points_at_the_submodule_file(tmp_path, monkeypatch):
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "models/__init__.py": "",
        "models/gpt.py": "from megatron_core.transformer import block\nfrom ..transformer import CONST\n",
        "transformer/__init__.py": "CONST = 1\n",
        "transformer/block.py": "",
    })
    result = _report(monkeypatch, pkg)
    assert result["file_circles"] == [] and result["subpackage_cycles"] == [] and result["upward_imports"] == []
    found = {(i.src, i.dst) for i in import_graph.scan(pkg)}
    assert ("megatron_core.models.gpt", "megatron_core.transformer.block") in found
    assert ("megatron_core.models.gpt", "megatron_core.transformer") in found


def test_undeclared_part_fails(tmp_path, monkeypatch):
    pkg = _package(tmp_path, {"__init__.py": "", "brand_new.py": ""})
    result = _report(monkeypatch, pkg)
    assert result["undeclared_parts"] == ["brand_new"]
    assert import_graph.failed(result)


def test_circles_are_strongly_connected_components_largest_first():
    edges = {("a", "b"), ("b", "c"), ("c", "a"), ("d", "e"), ("e", "d"), ("c", "d"), ("f", "a")}
    assert import_graph.strongly_connected(edges) == [["a", "b", "c"], ["d", "e"]]


def test_every_part_of_the_package_is_declared_once():
    declared = [p for _, parts, _ in import_graph.LAYERS for p in parts]
    assert len(declared) == len(set(declared))
    parts = {import_graph.part_of(m) for m in import_graph.modules()}
    assert parts <= set(declared), parts - set(declared)


def test_cli_json_round_trip():
    proc = subprocess.run([sys.executable, "tools/import_graph.py", "--json"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    result = json.loads(proc.stdout)
    assert proc.returncode == (1 if import_graph.failed(result) else 0)
    assert set(result) >= {"file_circles", "largest_circle", "subpackage_cycles", "upward_imports"}


def test_the_package_has_no_circle_no_cycle_no_upward_import():
    """CI gate: every import counted, the package is layered with no circles."""
    result = import_graph.report(import_graph.scan())
    assert result["file_circles"] == [], result["file_circles"]
    assert result["subpackage_cycles"] == [], result["subpackage_cycles"]
    assert result["upward_imports"] == [], result["upward_imports"]
    assert result["undeclared_parts"] == [], result["undeclared_parts"]


def test_an_alias_counts_at_its_own_part(tmp_path, monkeypatch):
    """A re-export-only module in a lower subpackage that names a higher one is an upward import and a cycle."""
    pkg = _package(tmp_path, {
        "__init__.py": "",
        "fusions/__init__.py": "",
        "fusions/fused_norm.py": "from megatron_core.transformer.norm import Norm\n\n__all__ = ['Norm']\n",
        "fusions/kernel.py": "",
        "transformer/__init__.py": "",
        "transformer/norm.py": "from megatron_core.fusions import kernel\n",
    })
    result = _report(monkeypatch, pkg)
    assert result["upward_imports"] == ["megatron_core.fusions.fused_norm:1 -> megatron_core.transformer.norm"]
    assert {(c["src"], c["dst"]) for c in result["subpackage_cycles"]} == {
        ("fusions", "transformer"), ("transformer", "fusions")}


def test_utils_is_imported_by_nothing_inside_src():
    assert not [i for i in import_graph.scan() if i.dst == "megatron_core.utils"]


def test_megatron_paths_whose_code_moved_down_still_name_the_same_objects():
    """The Megatron-Core paths kept as aliases over lower-layer code give the very objects of the owner."""
    import importlib

    pairs = {
        "megatron_core.models.hybrid.hybrid_block": ("megatron_core.transformer.hybrid_stack", "HybridStack"),
        "megatron_core.ssm.mamba_block": ("megatron_core.transformer.hybrid_stack", "MambaStack"),
        "megatron_core.ssm.hybrid_stack": ("megatron_core.transformer.hybrid_stack", "HybridStack"),
        "megatron_core.models.hybrid.hybrid_layer_allocation": ("megatron_core._ground.hybrid_pattern", "Symbols"),
        "megatron_core.ssm.mamba_hybrid_layer_allocation": ("megatron_core._ground.hybrid_pattern",
                                                            "parse_hybrid_pattern"),
        "megatron_core.transformer.torch_norm": ("megatron_core.fusions.norms", "RMSNorm"),
        "megatron_core.transformer": ("megatron_core.fusions.fused_bias_dropout", "get_bias_dropout_add"),
    }
    for alias, (owner, name) in pairs.items():
        assert getattr(importlib.import_module(alias), name) is getattr(importlib.import_module(owner), name), alias


def test_ground_floor_imports_nothing_above_it():
    ground = {p for p in import_graph.LAYERS[0][1]}
    for imp in import_graph.scan():
        if import_graph.part_of(imp.src) == "_ground":
            assert import_graph.part_of(imp.dst) in ground, imp


def test_architecture_doc_quotes_the_layer_table():
    doc = (ROOT / "docs" / "architecture.md").read_text()
    begin, end = "<!-- layers: generated by tools/import_graph.py --layers-markdown -->", "<!-- end layers -->"
    quoted = doc.split(begin, 1)[1].split(end, 1)[0].strip()
    assert quoted == import_graph.layers_markdown()
