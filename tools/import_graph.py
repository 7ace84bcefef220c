"""Import graph of ``megatron_core``: circles between files, cycles between subpackages, upward imports.

Every ``import`` statement counts, at module level or inside a function: a function-level import is
still an import, and nothing is exempt. Each file is a node of its own (private modules too); an
import points at the file that defines the imported module (``from pkg import sub`` points at
``pkg/sub.py`` when ``sub`` is a module, else at ``pkg/__init__.py``).

Three checks, each reported with the imports behind it:

* **file circles**: strongly connected components of the file graph with more than one file,
  largest first;
* **subpackage cycles**: strongly connected components of the graph between *parts*, where a part
  is a top-level subpackage (``transformer``, ``optimizer``, ...) or a top-level module
  (``utils``, ``_ground``, ...) -- each cycle is reported as the components' edges that close it;
* **upward imports**: an import from a part of a lower layer of ``LAYERS`` into a part of a higher
  layer. Every part must be declared in ``LAYERS`` (an undeclared part is an error).

**Aliases are files like any other.** Megatron-Core's import paths are kept by thin re-export
modules (*aliases*) while the code lives in the layer that owns it. An alias's imports count at its own
directory's part, like every other file's: so an alias may only re-export from its own layer or a lower
one. Where Megatron-Core's path sits in a lower layer than the code it names, the code moves down to the
lowest layer its own imports allow and the higher path becomes the alias (``docs/architecture.md``).

``LAYERS`` below is the one place where the layer order is written; ``docs/architecture.md`` quotes
it between markers and a test checks the two agree (``python tools/import_graph.py --layers-markdown``
prints the block).

Usage::

    python tools/import_graph.py            # summary; exit 1 on any circle, cycle, upward import
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

# Bottom first: (name, parts, what it holds). A part may import parts of its own layer or a lower one.
LAYERS: list[tuple[str, tuple[str, ...], str]] = [
    ("ground", ("_ground", "device", "enums", "package_info", "typed_torch", "jit", "msc_utils", "_nvtx",
                "_nvml", "_version_utils", "_slurm_utils", "_wrapped_model", "config", "config_rules", "megatron_only_fields", "command_line",
                "_activation_offload", "fp4_utils"),
     "primitives that import nothing of ours above them: divide, group size/rank helpers, init methods, "
     "version and logging helpers, device selection, enums, Transformer Engine tensor-class checks (``fp4_utils``)"),
    ("process groups", ("parallel_state", "hyper_comm_grid", "process_groups_config", "_rank_utils"),
     "the global group registry and the explicit group collections"),
    ("configuration", ("model_parallel_config", "num_microbatches_calculator", "timers", "packed_seq_params",
                       "activations", "energy_monitor", "_batch_utils", "_packed_batch",
                       "progress", "_straggler", "_misc_utils", "_model_utils", "config_logger", "quantization"),
     "configs, timers, microbatch arithmetic, optional kernels' feature checks, per-module quantization recipes"),
    ("storage", ("dist_checkpointing",),
     "sharded checkpoint storage and its tracker file: knows tensors and shardings, no model"),
    ("parallel primitives", ("tensor_parallel", "fusions", "rerun_state_machine", "_rerun_parts",
                             "_rerun_checkpoint", "_rerun_reporting"),
     "tensor-parallel layers and mappings, RNG tracker, fused kernels, the rerun state machine"),
    ("blocks", ("transformer", "pipeline_parallel", "distributed", "extensions", "fp8_utils", "full_cuda_graph",
                "recompute"),
     "transformer layers and blocks, pipeline schedules, DDP/FSDP wrappers and gradient finalisation (with the "
     "FP8 parameters they store, re-exported at Megatron-Core's ``fp8_utils``), Transformer Engine modules"),
    ("layers", ("ssm",), "the Mamba mixer and layers, built on transformer"),
    ("models", ("models", "fp8", "optimizer", "optimizer_param_scheduler", "datasets", "tokenizers", "export"),
     "model families, optimizers, data and tokenizers"),
    ("training", ("training", "training_metrics", "fault_injector", "safe_globals"),
     "the training loop's own state: run checkpoints, RNG state, architecture records, get_model"),
    ("applications", ("inference", "inference_params", "resharding", "post_training"),
     "inference engines and servers, weight resharding, post-training quantization for deployment (it quantizes "
     "the engine's KV cache)"),
    ("facades", ("utils", PACKAGE),
     "``utils`` (Megatron-Core's grab-bag of helpers, kept for users) and the package's ``__init__``; nothing "
     "inside the package imports them"),
]


@dataclass(frozen=True)
class Import:
    """One import statement: file ``src`` imports module file ``dst`` (``lazy``: inside a function)."""

    src: str
    dst: str
    line: int
    lazy: bool


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules(root: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file under ``root``."""
    return {_module_name(p, root): p for p in sorted(root.rglob("*.py"))}


def _targets(node: ast.AST, module: str, is_package: bool, known: dict[str, Path]) -> list[str]:
    """The module files an import statement loads (only those of the package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    else:
        assert isinstance(node, ast.ImportFrom)
        if node.level == 0:
            base = node.module or ""
        else:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
    out = []
    for name in names:
        while name and name not in known:  # ``import a.b.c`` of a name defined in a.b
            name = name.rpartition(".")[0]
        if name.split(".")[0] == PACKAGE and name in known and name not in out:
            out.append(name)
    return out


def scan(root: Path = SRC) -> list[Import]:
    """Every import between files of the package under ``root``, module level or lazy."""
    known = modules(root)
    found: list[Import] = []
    for module, path in known.items():
        tree = ast.parse(path.read_text(), filename=str(path))

        def visit(node: ast.AST, lazy: bool, module: str = module, path: Path = path) -> None:
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.Import, ast.ImportFrom)):
                    for dst in _targets(child, module, path.name == "__init__.py", known):
                        if dst != module:
                            found.append(Import(module, dst, child.lineno, lazy))
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                visit(child, inner)

        visit(tree, False)
    return found


def part_of(module: str) -> str:
    """The part of dotted ``module``: its top-level subpackage or module (the package for its ``__init__``)."""
    names = module.split(".")
    return names[1] if len(names) > 1 else PACKAGE


def strongly_connected(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Components of more than one node (iterative Tarjan), each sorted; largest first."""
    graph: dict[str, list[str]] = {}
    for a, b in sorted(edges):
        graph.setdefault(a, []).append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    comps: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(graph[w])))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return sorted(comps, key=lambda c: (-len(c), c))


def layer_of(part: str) -> int | None:
    """Index of ``part``'s layer in ``LAYERS`` (None when undeclared)."""
    for i, (_, parts, _) in enumerate(LAYERS):
        if part in parts:
            return i
    return None


def _where(imp: Import) -> str:
    return f"{imp.src}:{imp.line} -> {imp.dst}"


def report(imports: list[Import]) -> dict:
    """File circles, subpackage cycles, upward imports and undeclared parts as plain data."""
    file_edges = {(i.src, i.dst) for i in imports}
    circles = strongly_connected(file_edges)
    by_part: dict[tuple[str, str], list[Import]] = {}
    for imp in imports:
        a, b = part_of(imp.src), part_of(imp.dst)
        if a != b:
            by_part.setdefault((a, b), []).append(imp)
    part_comps = strongly_connected(set(by_part))
    cycles = []
    for comp in part_comps:  # each edge inside a component closes a cycle
        members = set(comp)
        cycles.extend(
            {"src": a, "dst": b, "imports": [_where(i) for i in imps]}
            for (a, b), imps in sorted(by_part.items()) if a in members and b in members
        )
    parts = {part_of(m) for m in modules(SRC)} if SRC.exists() else set()
    parts |= {p for edge in by_part for p in edge}
    upward = []
    for (a, b), imps in sorted(by_part.items()):
        la, lb = layer_of(a), layer_of(b)
        if la is not None and lb is not None and lb > la:
            upward.extend(_where(i) for i in imps)
    return {
        "imports": len(imports),
        "lazy_imports": sum(i.lazy for i in imports),
        "file_circles": circles,
        "largest_circle": len(circles[0]) if circles else 0,
        "subpackage_components": part_comps,
        "subpackage_cycles": cycles,
        "upward_imports": upward,
        "undeclared_parts": sorted(p for p in parts if layer_of(p) is None),
    }


def failed(result: dict) -> bool:
    """Whether the report shows any circle, cycle, upward import or undeclared part."""
    return bool(result["file_circles"] or result["subpackage_cycles"] or result["upward_imports"]
                or result["undeclared_parts"])


def layers_markdown() -> str:
    """The layer table that ``docs/architecture.md`` quotes (top layer first, as a reader scans it)."""
    rows = ["| layer | parts | holds |", "| --- | --- | --- |"]
    for i, (name, parts, holds) in reversed(list(enumerate(LAYERS))):
        rows.append(f"| {i} {name} | {', '.join(f'`{p}`' for p in parts)} | {holds} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit status 1 on a circle, cycle, upward import or undeclared part."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument("--layers-markdown", action="store_true", help="print the layer table of the docs")
    args = parser.parse_args(argv)
    if args.layers_markdown:
        print(layers_markdown())
        return 0
    result = report(scan())
    if args.json:
        print(json.dumps(result, indent=1))
        return 1 if failed(result) else 0
    print(f"{result['imports']} imports between files of {PACKAGE} ({result['lazy_imports']} inside functions)")
    print(f"file circles: {len(result['file_circles'])} (largest {result['largest_circle']} files)")
    for comp in result["file_circles"]:
        print(f"  [{len(comp)}] " + " ".join(comp))
    print(f"subpackage cycles: {len(result['subpackage_cycles'])} edges in "
          f"{len(result['subpackage_components'])} components")
    for comp in result["subpackage_components"]:
        print("  component: " + " <-> ".join(comp))
    for c in result["subpackage_cycles"]:
        print(f"  {c['src']} -> {c['dst']}: " + "; ".join(c["imports"]))
    print(f"upward imports: {len(result['upward_imports'])}")
    for line in result["upward_imports"]:
        print(f"  {line}")
    print(f"undeclared parts: {len(result['undeclared_parts'])} {' '.join(result['undeclared_parts'])}")
    return 1 if failed(result) else 0


__all__ = ["Import", "LAYERS", "failed", "layer_of", "layers_markdown", "main", "modules", "part_of",
           "report", "scan", "strongly_connected"]

if __name__ == "__main__":
    sys.exit(main())
