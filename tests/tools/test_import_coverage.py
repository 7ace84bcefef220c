"""tools/import_coverage.py runs, its numbers add up, and coverage of Megatron's imported names holds a floor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tools import import_coverage

ROOT = Path(__file__).resolve().parents[2]

# Raised as names land; coverage may only go up. Baseline (before issue 12 section 4): 80/343, 266/724.
FLOOR_DISTINCT = 188
FLOOR_WEIGHTED = 523


def test_pairs_file_is_the_scan_of_megatron_lm():
    pairs = import_coverage.read_pairs()
    assert len(pairs) == 343
    assert sum(p.files for p in pairs) == 724
    assert len({(p.module, p.name) for p in pairs}) == len(pairs)
    assert all(p.files >= 1 and p.module.startswith("megatron.core") for p in pairs)
    top = max(pairs, key=lambda p: p.files)
    assert (top.module, top.name) == ("megatron.core", "mpu")


def test_parser_handles_parenthesised_and_plain_imports():
    source = (
        "from megatron.core.utils import (\n    a,\n    b as c,\n)\n"
        "import megatron.core.tensor_parallel\n"
        "def f():\n    from megatron.core import mpu\n"
        "from megatron.training import x\n"
    )
    assert import_coverage._pairs_in_source(source) == {
        ("megatron.core.utils", "a"), ("megatron.core.utils", "b"),
        ("megatron.core", "tensor_parallel"), ("megatron.core", "mpu"),
    }


def test_resolution_is_real():
    Pair = import_coverage.Pair
    assert import_coverage.resolves(Pair("megatron.core", "parallel_state", 1))
    assert import_coverage.resolves(Pair("megatron.core.transformer.transformer_config", "TransformerConfig", 1))
    assert not import_coverage.resolves(Pair("megatron.core.utils", "no_such_name_xyz", 1))
    assert not import_coverage.resolves(Pair("megatron.core.no_such_module", "x", 1))


def test_coverage_is_consistent_and_above_floor():
    result = import_coverage.coverage(import_coverage.read_pairs())
    assert result["resolved"] + len(result["missing"]) == result["pairs"]
    missing_w = sum(m[2] for m in result["missing"])
    assert result["weighted_resolved"] + missing_w == result["weighted_total"]
    assert result["resolved"] >= FLOOR_DISTINCT, result["missing"]
    assert result["weighted_resolved"] >= FLOOR_WEIGHTED


def test_script_runs_from_the_command_line():
    out = subprocess.run(
        [sys.executable, "tools/import_coverage.py"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=120,
        env={"PYTHONPATH": f"{ROOT / 'src'}:{ROOT}", "PATH": "/usr/bin:/bin"},
    ).stdout
    assert out.startswith("distinct: ") and "/343 pairs" in out and "/724 file-imports" in out
