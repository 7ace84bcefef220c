"""Measure how many Megatron-Core names that downstream code imports resolve in ``megatron_core``.

The pairs live in ``tools/megatron_import_pairs.tsv`` (module, name, number of downstream files that
import it). They were derived by scanning Megatron-LM at tag ``core_v0.19.0``: every
``from megatron.core... import X`` and ``import megatron.core.x`` in its ``examples/``,
``megatron/training/`` and ``pretrain_gpt.py`` (``--regenerate REPO`` redoes that scan from a local
clone). Each pair is resolved for real against ``megatron_core``: import the module, then
``getattr`` the name (or import ``module.name`` as a submodule).

Usage::

    python tools/import_coverage.py                 # coverage summary
    python tools/import_coverage.py --missing       # also list the missing pairs, most used first
    python tools/import_coverage.py --json          # machine-readable summary
    python tools/import_coverage.py --regenerate /path/to/Megatron-LM   # rescan (needs git)
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import importlib
import io
import json
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

PAIRS_FILE = Path(__file__).with_name("megatron_import_pairs.tsv")
TAG = "core_v0.19.0"
SCANNED_PATHS = ("examples", "megatron/training", "pretrain_gpt.py")
SOURCE_PACKAGE = "megatron.core"
TARGET_PACKAGE = "megatron_core"


@dataclass(frozen=True)
class Pair:
    """One imported name: ``from <module> import <name>`` (module spelled the Megatron way)."""

    module: str
    name: str
    files: int


def _pairs_in_source(text: str) -> set[tuple[str, str]]:
    """The (module, name) pairs a Python source imports from ``megatron.core``."""
    pairs: set[tuple[str, str]] = set()
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return pairs
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mod = node.module
            if mod == SOURCE_PACKAGE or mod.startswith(SOURCE_PACKAGE + "."):
                for alias in node.names:
                    if alias.name != "*":
                        pairs.add((mod, alias.name))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                mod = alias.name
                if mod.startswith(SOURCE_PACKAGE + "."):
                    parent, _, leaf = mod.rpartition(".")
                    pairs.add((parent, leaf))
    return pairs


def scan_repository(repo: Path, tag: str = TAG) -> list[Pair]:
    """Scan ``repo`` (a Megatron-LM git clone) at ``tag``; return pairs with downstream file counts."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True
        ).stdout

    files = [f for f in git("ls-tree", "-r", "--name-only", tag, "--", *SCANNED_PATHS).split() if f.endswith(".py")]
    counts: collections.Counter[tuple[str, str]] = collections.Counter()
    for path in files:
        for pair in _pairs_in_source(git("show", f"{tag}:{path}")):
            counts[pair] += 1
    return sorted(
        (Pair(m, n, c) for (m, n), c in counts.items()), key=lambda p: (-p.files, p.module, p.name)
    )


def write_pairs(pairs: list[Pair], path: Path = PAIRS_FILE) -> None:
    """Write ``pairs`` as the kept TSV."""
    lines = [f"# (module, name, downstream files) imported by Megatron-LM {TAG}: {', '.join(SCANNED_PATHS)}"]
    lines.append("module\tname\tfiles")
    lines += [f"{p.module}\t{p.name}\t{p.files}" for p in pairs]
    path.write_text("\n".join(lines) + "\n")


def read_pairs(path: Path = PAIRS_FILE) -> list[Pair]:
    """Read the kept TSV."""
    pairs = []
    for line in path.read_text().splitlines():
        if not line or line.startswith("#") or line.startswith("module\t"):
            continue
        module, name, files = line.split("\t")
        pairs.append(Pair(module, name, int(files)))
    return pairs


def target_module(module: str) -> str:
    """Megatron's module path rewritten to ours (``megatron.core.x`` -> ``megatron_core.x``)."""
    return TARGET_PACKAGE + module[len(SOURCE_PACKAGE):]


def resolves(pair: Pair) -> bool:
    """True when ``from <ours> import <name>`` works."""
    module_name = target_module(pair.module)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            module = importlib.import_module(module_name)
        except Exception:
            return False
        try:
            getattr(module, pair.name)
            return True
        except Exception:
            pass
        try:
            importlib.import_module(f"{module_name}.{pair.name}")
            return True
        except Exception:
            return False


def coverage(pairs: list[Pair]) -> dict:
    """Distinct and file-weighted coverage of ``pairs``, plus the missing ones."""
    found = [p for p in pairs if resolves(p)]
    missing = [p for p in pairs if p not in set(found)]
    total_w = sum(p.files for p in pairs)
    found_w = sum(p.files for p in found)
    return {
        "pairs": len(pairs),
        "resolved": len(found),
        "distinct_pct": 100.0 * len(found) / max(len(pairs), 1),
        "weighted_total": total_w,
        "weighted_resolved": found_w,
        "weighted_pct": 100.0 * found_w / max(total_w, 1),
        "missing": [(p.module, p.name, p.files) for p in missing],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=Path, default=PAIRS_FILE, help="TSV of (module, name, files)")
    parser.add_argument("--missing", action="store_true", help="list missing pairs, most used first")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    parser.add_argument("--regenerate", type=Path, metavar="REPO", help="rescan a Megatron-LM clone first")
    args = parser.parse_args(argv)
    if args.regenerate:
        write_pairs(scan_repository(args.regenerate), args.pairs)
    result = coverage(read_pairs(args.pairs))
    if args.json:
        print(json.dumps(result))
        return 0
    print(
        f"distinct: {result['resolved']}/{result['pairs']} pairs ({result['distinct_pct']:.1f}%)\n"
        f"weighted: {result['weighted_resolved']}/{result['weighted_total']} file-imports "
        f"({result['weighted_pct']:.1f}%)"
    )
    if args.missing:
        for module, name, files in sorted(result["missing"], key=lambda m: (-m[2], m[0], m[1])):
            print(f"  {module}: {name} x{files}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
