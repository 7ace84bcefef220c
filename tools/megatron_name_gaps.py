"""List the public names Megatron-Core defines that ``megatron_core`` lacks, module by module.

Every ``megatron/core/**.py`` file at tag ``core_v0.19.0`` of a local Megatron-LM clone is parsed
(``git show``, no checkout); its public names are those that do not start with ``_`` among: its
top-level ``def``, ``class`` and assigned names; the strings of its ``__all__``; and, in a package's
``__init__.py`` or a module that only imports (an alias module such as ``inference_params``), the
names it imports from Megatron's own modules (re-exports users import from there). Each is then
resolved for real in ``megatron_core``:
import the same module path, ``getattr`` the name. A module that does not exist here counts all
of its names as missing. Nothing is exempt; ``--skip PATTERN`` only hides matching modules from
the listing, and the summary always reports the whole count beside what the listing shows.

Usage::

    python tools/megatron_name_gaps.py --repo /path/to/Megatron-LM             # summary
    python tools/megatron_name_gaps.py --repo R --missing                      # module: names
    python tools/megatron_name_gaps.py --repo R --missing --present-modules    # only modules we have
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import importlib
import io
import subprocess
import sys
import warnings
from dataclasses import dataclass, field

TAG = "core_v0.19.0"
SOURCE_ROOT = "megatron/core"
TARGET_PACKAGE = "megatron_core"


@dataclass
class ModuleGap:
    """One Megatron-Core module: its public names and those ``megatron_core`` lacks."""

    module: str
    names: list[str]
    missing: list[str] = field(default_factory=list)
    module_exists: bool = True


def _git(repo: str, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", repo, *args], check=True, capture_output=True, text=True
    ).stdout


def _all_entries(node: ast.AST) -> list[str]:
    """The strings of an ``__all__ = [...]`` (or tuple) assignment; none for anything else."""
    if not (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets)):
        return []
    if not isinstance(node.value, (ast.List, ast.Tuple)):
        return []
    return [e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]


def _megatron_imports(body: list[ast.stmt]) -> list[str]:
    """Names a module body imports from Megatron's own modules (relative, or absolute ``megatron.*``), also inside
    top-level ``try`` / ``if`` blocks."""
    names: list[str] = []
    for node in body:
        if isinstance(node, ast.ImportFrom) and (node.level > 0 or (node.module or "").startswith("megatron")):
            names.extend(a.asname or a.name for a in node.names if a.name != "*")
        elif isinstance(node, ast.Try):
            names.extend(_megatron_imports(node.body))
        elif isinstance(node, ast.If):
            names.extend(_megatron_imports(node.body))
    return names


def public_names(source: str, package_init: bool = False) -> list[str]:
    """A module's public names (see the module docstring): top-level ``def`` / ``class`` / assigned names,
    ``__all__``'s strings and, for a package ``__init__`` or a module that only imports, its imports from
    Megatron's own modules; those starting with ``_`` left out."""
    body = ast.parse(source).body
    names: list[str] = []
    defines = False
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.append(node.name)
            defines = True
        elif isinstance(node, ast.Assign):
            names.extend(t.id for t in node.targets if isinstance(t, ast.Name))
            names.extend(_all_entries(node))
            defines = defines or not _all_entries(node)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.append(node.target.id)
            defines = True
    if package_init or not defines:
        names.extend(_megatron_imports(body))
    return sorted({n for n in names if not n.startswith("_")})


def scan(repo: str, tag: str = TAG) -> list[ModuleGap]:
    """Resolve every public name of every Megatron-Core module at ``tag`` against ``megatron_core``."""
    files = _git(repo, "ls-tree", "-r", "--name-only", tag, SOURCE_ROOT).split()
    gaps: list[ModuleGap] = []
    for path in sorted(f for f in files if f.endswith(".py")):
        try:
            names = public_names(_git(repo, "show", f"{tag}:{path}"), path.endswith("/__init__.py"))
        except SyntaxError:
            continue
        if not names:
            continue
        dotted = path[: -len(".py")].replace("/", ".")
        dotted = dotted.removesuffix(".__init__")
        target = TARGET_PACKAGE + dotted[len("megatron.core") :]
        gap = ModuleGap(dotted, names)
        try:
            with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                warnings.simplefilter("ignore")
                module = importlib.import_module(target)
        except Exception:
            gap.module_exists = False
            gap.missing = list(names)
        else:
            gap.missing = [n for n in names if not hasattr(module, n)]
        gaps.append(gap)
    return gaps


def main(argv: list[str] | None = None) -> int:
    """Print the summary (and with ``--missing`` the missing names per module)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repo", required=True, help="a local Megatron-LM clone (git dir or work tree)")
    parser.add_argument("--tag", default=TAG)
    parser.add_argument("--missing", action="store_true", help="list the missing names per module")
    parser.add_argument(
        "--present-modules", action="store_true", help="list only modules that exist in megatron_core"
    )
    parser.add_argument("--skip", action="append", default=[], help="hide modules containing this text")
    args = parser.parse_args(argv)
    gaps = scan(args.repo, args.tag)
    total = sum(len(g.names) for g in gaps)
    missing = sum(len(g.missing) for g in gaps)
    present_modules = [g for g in gaps if g.module_exists]
    total_present = sum(len(g.names) for g in present_modules)
    missing_present = sum(len(g.missing) for g in present_modules)
    print(f"all modules: {total - missing}/{total} names ({100 * (total - missing) / total:.1f}%), "
          f"{len(present_modules)}/{len(gaps)} modules exist")
    print(f"modules that exist: {total_present - missing_present}/{total_present} names "
          f"({100 * (total_present - missing_present) / max(total_present, 1):.1f}%)")
    if args.missing:
        for gap in gaps:
            if not gap.missing or (args.present_modules and not gap.module_exists):
                continue
            if any(s in gap.module for s in args.skip):
                continue
            tag = "" if gap.module_exists else " (no module)"
            print(f"{gap.module}{tag}: {', '.join(gap.missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
