"""Compute, check and (with ``--write``) regenerate the pinned public-name lists in tests/public_api/.

A module's public names are its ``__all__`` when it defines one, else every attribute not starting
with an underscore that is not itself a module.
"""

from __future__ import annotations

import argparse
import importlib
import types
from pathlib import Path

LIST_DIR = Path(__file__).parent / "public_api"


def public_names(module_name: str) -> list[str]:
    """Sorted public names of ``module_name``."""
    module = importlib.import_module(module_name)
    names = getattr(module, "__all__", None)
    if names is None:
        names = [
            n for n in vars(module)
            if not n.startswith("_") and not isinstance(getattr(module, n), types.ModuleType)
            and getattr(getattr(module, n), "__module__", module_name).startswith("megatron_core")
        ]
    return sorted(set(names))


def pinned_modules() -> list[str]:
    """Modules that have a checked-in list."""
    return sorted(p.stem for p in LIST_DIR.glob("*.txt"))


def read_list(module_name: str) -> list[str]:
    """The checked-in list for ``module_name``."""
    text = (LIST_DIR / f"{module_name}.txt").read_text()
    return [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]


def write_list(module_name: str) -> None:
    """Write the current public names of ``module_name`` as its checked-in list."""
    LIST_DIR.mkdir(exist_ok=True)
    body = "\n".join(public_names(module_name))
    (LIST_DIR / f"{module_name}.txt").write_text(f"# public names of {module_name}\n{body}\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite the lists from the current code")
    parser.add_argument("modules", nargs="*", help="modules to (re)write; default: every pinned module")
    args = parser.parse_args()
    for module_name in args.modules or pinned_modules():
        if args.write:
            write_list(module_name)
        else:
            print(module_name, public_names(module_name) == read_list(module_name))


if __name__ == "__main__":
    main()
