"""Import graph of ``megatron_core``'s parts: edges, cycles and a declared layering.

A *part* is a subpackage (``transformer``, ``optimizer``, ...) or a top-level module (``utils``,
``process_groups_config``, ...). ``dist_checkpointing.training`` is a part of its own: it is the
training-loop layer (Megatron-LM keeps it in ``megatron/training``); it reads models and optimizers
only through their methods (``sharded_state_dict``, ``load_state_dict``), so it sits just above
``tensor_parallel`` (its RNG tracker), while the ``dist_checkpointing`` core sits below them. Private top-level modules
(``_misc_utils``, ``_rerun_parts``, ...) are counted with the public module that re-exports them
(see ``OWNER``).

Every ``import`` statement counts, at module level or inside a function (a lazy import). A lazy
import that is a deliberate upward edge must be documented on its own line with a
``# lazy-import: <reason>`` comment; it is then listed but left out of the cycle and layering
checks. Anything else is an edge like any other.

``LAYERS`` declares the layering, bottom first: a part may import only parts in its own layer or
below. Parts not named in ``LAYERS`` are not checked against it (they still count for cycles).

Usage::

    python tools/import_graph.py            # edges, cycles, layering violations; exit 1 on any
    python tools/import_graph.py --json     # the same as JSON
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "megatron_core"
SRC = Path(__file__).resolve().parents[1] / "src" / PACKAGE
LAZY_MARK = "lazy-import:"

# Parts that are one unit with another part (private implementation modules of a public one).
OWNER = {
    "_batch_utils": "utils", "_misc_utils": "utils", "_model_utils": "utils", "_nvtx": "utils",
    "_rank_utils": "utils", "_slurm_utils": "utils", "_straggler": "utils", "_version_utils": "utils",
    "_wrapped_model": "utils", "_nvml": "utils",
    "_rerun_checkpoint": "rerun_state_machine", "_rerun_parts": "rerun_state_machine",
    "_rerun_reporting": "rerun_state_machine",
}

# ``fusions`` modules that only re-export transformer pieces at Megatron-Core's paths (above ``transformer``);
# the other ``fusions`` modules are kernels that ``transformer`` uses (below it).
FUSION_ALIASES = {"fused_bias_dropout", "fused_layer_norm"}
# ``ssm`` modules that only re-export ``models.hybrid`` at their pre-0.19 paths (above ``models``, as in
# Megatron-Core 0.19); the other ``ssm`` modules are the Mamba mixer and layers that ``models.hybrid`` uses.
SSM_ALIASES = {"mamba_block", "mamba_hybrid_layer_allocation"}

# Bottom first. A part may import parts of its own layer or of a lower one.
LAYERS: list[set[str]] = [
    {"device", "package_info", "enums", "typed_torch", "jit", "msc_utils", "config", "config_rules", "export"},
    {"parallel_state", "utils", "hyper_comm_grid"},
    {"process_groups_config", "model_parallel_config", "num_microbatches_calculator", "timers",
     "packed_seq_params", "activations", "energy_monitor"},
    {"dist_checkpointing"},
    {"tensor_parallel", "rerun_state_machine", "fusions"},
    {"distributed", "pipeline_parallel", "transformer", "dist_checkpointing.training"},
    {"ssm"},  # Mamba mixer / layers: built on transformer, used by models.hybrid
    {"optimizer", "optimizer_param_scheduler", "models", "fusions.aliases", "ssm.aliases",
     "datasets", "tokenizers"},
    {"inference", "resharding"},
]


@dataclass(frozen=True)
class Import:
    """One import statement from part ``src`` of part ``dst`` (``lazy``: inside a function)."""

    src: str
    dst: str
    file: str
    line: int
    lazy: bool
    documented: bool


def part_of(module: str) -> str | None:
    """The part that dotted ``module`` (``megatron_core.x.y``) belongs to, or None outside the package."""
    names = module.split(".")
    if names[0] != PACKAGE or len(names) < 2:
        return None
    if names[1] == "dist_checkpointing" and len(names) > 2 and names[2] == "training":
        return "dist_checkpointing.training"
    if names[1] == "fusions" and len(names) > 2 and names[2] in FUSION_ALIASES:
        return "fusions.aliases"
    if names[1] == "ssm" and len(names) > 2 and names[2] in SSM_ALIASES:
        return "ssm.aliases"
    return OWNER.get(names[1], names[1])


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    if node.level == 0:
        base = node.module or ""
    else:
        anchor = module.split(".")
        if not is_package:
            anchor = anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join(anchor + ([node.module] if node.module else []))
    if base == PACKAGE:  # ``from megatron_core import parallel_state``: each name may be a part
        return [f"{base}.{a.name}" for a in node.names]
    return [base]


def scan_file(path: Path) -> list[Import]:
    """All imports of other parts made by ``path``."""
    module = _module_name(path)
    src = part_of(module) or PACKAGE  # the package's own ``__init__`` is the facade on top
    text = path.read_text()
    lines = text.splitlines()
    tree = ast.parse(text, filename=str(path))
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            targets: list[str] = []
            if isinstance(child, ast.Import):
                targets = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                targets = _resolve(child, module, path.name == "__init__.py")
            for target in targets:
                dst = part_of(target)
                if dst is None or dst == src:
                    continue
                documented = any(LAZY_MARK in lines[i] for i in range(child.lineno - 1, child.end_lineno or child.lineno))
                found.append(Import(src, dst, str(path.relative_to(SRC.parent.parent)), child.lineno, lazy,
                                    lazy and documented))
            visit(child, inner)

    visit(tree, False)
    return found


def scan(root: Path = SRC) -> list[Import]:
    """Every cross-part import under ``root``."""
    out: list[Import] = []
    for path in sorted(root.rglob("*.py")):
        out.extend(scan_file(path))
    return out


def edges(imports: list[Import]) -> dict[tuple[str, str], list[Import]]:
    """Imports grouped by (src, dst) part, documented lazy imports left out."""
    grouped: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        if not imp.documented:
            grouped.setdefault((imp.src, imp.dst), []).append(imp)
    return grouped


def find_cycles(graph_edges: set[tuple[str, str]]) -> list[list[str]]:
    """Strongly connected components of more than one part (Tarjan), each sorted."""
    graph: dict[str, list[str]] = {}
    for a, b in graph_edges:
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    sccs: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                sccs.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return sorted(sccs)


def layer_of(part: str) -> int | None:
    """Index of ``part``'s layer in ``LAYERS`` (None when undeclared)."""
    for i, layer in enumerate(LAYERS):
        if part in layer:
            return i
    return None


def layering_violations(grouped: dict[tuple[str, str], list[Import]]) -> list[Import]:
    """Imports from a part of a lower layer to a part of a higher one."""
    bad = []
    for (src, dst), imps in sorted(grouped.items()):
        ls, ld = layer_of(src), layer_of(dst)
        if ls is not None and ld is not None and ld > ls:
            bad.extend(imps)
    return bad


def report(imports: list[Import]) -> dict:
    """Edges, documented lazy imports, cycles and layering violations as plain data."""
    grouped = edges(imports)
    return {
        "edges": [{"src": a, "dst": b, "imports": len(v), "lazy": sum(i.lazy for i in v)}
                  for (a, b), v in sorted(grouped.items())],
        "documented_lazy": [f"{i.file}:{i.line} {i.src} -> {i.dst}" for i in imports if i.documented],
        "cycles": find_cycles(set(grouped)),
        "violations": [f"{i.file}:{i.line} {i.src} -> {i.dst}" for i in layering_violations(grouped)],
    }


def main(argv: list[str] | None = None) -> int:
    """Print the graph; exit status 1 on a cycle or a layering violation."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parser.parse_args(argv)
    result = report(scan())
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{len(result['edges'])} edges between parts of {PACKAGE}:")
        for e in result["edges"]:
            lazy = f" ({e['lazy']} lazy)" if e["lazy"] else ""
            print(f"  {e['src']} -> {e['dst']}  [{e['imports']}]{lazy}")
        print(f"documented lazy imports (not counted): {len(result['documented_lazy'])}")
        for line in result["documented_lazy"]:
            print(f"  {line}")
        print(f"cycles: {len(result['cycles'])}")
        for cycle in result["cycles"]:
            print("  " + " <-> ".join(cycle))
        print(f"layering violations: {len(result['violations'])}")
        for line in result["violations"]:
            print(f"  {line}")
    return 1 if result["cycles"] or result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
