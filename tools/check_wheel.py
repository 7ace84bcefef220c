"""Check an installed ``megatron-core-lite`` wheel: every public module imports, and the package data is there.

Run with the Python of a fresh virtual environment that holds the wheel and no extras, from outside the
source tree (so that ``src/`` cannot stand in for the installed package)::

    python tools/check_wheel.py tests/public_api

The public modules are the names of the contract files in ``tests/public_api`` (one ``<module>.txt`` each).
Exits 1 naming each module that fails to import, each missing data file, or a package found in the source tree.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback
from pathlib import Path

# Files that must ship inside the wheel beside the Python modules (``[tool.setuptools.package-data]``).
PACKAGE_DATA = {"megatron_core.transformer.moe.cutlass_grouped_gemm": ("*.cu",)}


def public_modules(contract_dir: Path) -> list[str]:
    """The public modules whose API lists make up the release contract."""
    return sorted(path.stem for path in contract_dir.glob("megatron_core*.txt"))


def check(contract_dir: Path) -> list[str]:
    """Every problem found, one line each; empty when the wheel is whole."""
    problems = []
    import megatron_core

    location = Path(megatron_core.__file__).resolve()
    if "site-packages" not in location.parts:
        problems.append(f"megatron_core was imported from {location}, not from an installed wheel")
    for name in public_modules(contract_dir):
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - every failure is reported, not just the first
            problems.append(f"{name}: " + traceback.format_exc(limit=1).strip().splitlines()[-1])
    for package, patterns in PACKAGE_DATA.items():
        folder = Path(importlib.import_module(package).__file__).parent
        for pattern in patterns:
            if not list(folder.glob(pattern)):
                problems.append(f"{package}: no {pattern} file in {folder}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("contract_dir", type=Path, help="the folder of public-API lists (tests/public_api)")
    args = parser.parse_args(argv)
    modules = public_modules(args.contract_dir)
    if not modules:
        print(f"no public-API lists in {args.contract_dir}", file=sys.stderr)
        return 1
    problems = check(args.contract_dir)
    for line in problems:
        print(line, file=sys.stderr)
    import megatron_core

    print(f"wheel {megatron_core.__version__}: {len(modules)} public modules imported, "
          f"{len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
