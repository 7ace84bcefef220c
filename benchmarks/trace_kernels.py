"""GPU kernels of torch.profiler Chrome traces, grouped by name: calls, total and mean time, side by side.

Reads the traces ``fp8_training.py --only step --profile --trace-dir DIR`` writes (or any ``export_chrome_trace``
output) and prints, for each kernel name (shortened), its calls and total milliseconds in every trace, sorted by
the largest total, and each trace's sum. Kernels launched inside CUDA graphs are in the trace too.

    python3 benchmarks/trace_kernels.py DIR/full_step_bf16*.json DIR/full_step_fp8_param*.json --rows 60 --functors
    python3 benchmarks/trace_kernels.py DIR/full_step_fp8_param*.json --functors --launchers CUDAFunctor_add
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def kernel_times(path: Path, functors: bool = False) -> dict[str, list[float]]:
    """Durations (us) of the GPU kernels in the Chrome trace at ``path``, by shortened kernel name.

    With ``functors``, PyTorch's generic elementwise and reduction kernels are told apart by the functor they run.
    """
    times: dict[str, list[float]] = defaultdict(list)
    for event in _events(path):
        if _is_kernel(event):
            times[kernel_name(event["name"], functors)].append(float(event["dur"]))
    return times


def _events(path: Path) -> list[dict]:
    """The events of the Chrome trace at ``path``."""
    events = json.loads(path.read_text())
    return events.get("traceEvents", events) if isinstance(events, dict) else events


def _is_kernel(event: dict) -> bool:
    return event.get("cat") == "kernel" and event.get("ph") == "X"


def kernel_name(name: str, functors: bool = False) -> str:
    """:func:`short_name` of a kernel, with :func:`functor_of` appended when ``functors``."""
    return short_name(name) + (functor_of(name) if functors else "")


def short_name(name: str) -> str:
    """``name`` without template arguments and parameter lists (Inductor's kernel names kept whole)."""
    name = name.replace("(anonymous namespace)::", "")
    name = re.sub(r"\(.*\)$", "", name)
    depth, out = 0, []
    for char in name:
        if char == "<":
            depth += 1
        elif char == ">":
            depth -= 1
        elif depth == 0:
            out.append(char)
    return "".join(out)[:110]


def launchers(path: Path, pattern: str, functors: bool = False, depth: int = 4) -> dict[str, list[float]]:
    """Durations (us) of the kernels whose name (as :func:`kernel_times` gives it) contains ``pattern``, by the
    innermost ``depth`` CPU operators (outermost first) around the runtime call that launched each; a kernel
    replayed by a CUDA graph is under the graph launch."""
    events = _events(path)
    runtime = {e["args"]["correlation"]: e for e in events
               if e.get("cat") == "cuda_runtime" and e.get("ph") == "X" and "correlation" in e.get("args", {})}
    operators: dict[tuple, list[dict]] = defaultdict(list)
    for event in events:
        if event.get("cat") in ("cpu_op", "user_annotation", "python_function") and event.get("ph") == "X":
            operators[(event.get("pid"), event.get("tid"))].append(event)
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if not _is_kernel(event) or pattern not in kernel_name(event["name"], functors):
            continue
        launch = runtime.get(event.get("args", {}).get("correlation"))
        stack = "?"
        if launch is not None:
            around = sorted((op for op in operators[(launch.get("pid"), launch.get("tid"))]
                             if op["ts"] <= launch["ts"] <= op["ts"] + op.get("dur", 0)), key=lambda op: op["ts"])
            stack = " > ".join(op["name"][:60] for op in around[-depth:]) + f" > {launch['name']}"
        times[stack].append(float(event["dur"]))
    return times


def functor_of(name: str) -> str:
    """`` [functor]`` for a templated ``at::native`` kernel: the template argument naming what it computes, else ``""``."""
    if "at::native::" not in name or "<" not in name:
        return ""
    arguments = name.replace("(anonymous namespace)::", "").split("<", 1)[1]
    for pattern in (r"\b\w+_kernel_cuda\b", r"\b\w*Functor\w*", r"\b\w+_kernel_impl\w*"):
        found = re.search(pattern, arguments)
        if found:
            return f" [{found.group(0)}]"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--functors", action="store_true",
                        help="tell PyTorch's generic elementwise kernels apart by the functor they run")
    parser.add_argument("--launchers", default=None, metavar="PATTERN",
                        help="instead: the CPU operators that launched the kernels whose name contains PATTERN")
    args = parser.parse_args()
    if args.launchers is not None:
        for path in args.traces:
            print(f"{path.name}: kernels matching {args.launchers!r} by launching CPU operators")
            stacks = launchers(path, args.launchers, args.functors)
            for stack, durations in sorted(stacks.items(), key=lambda item: -sum(item[1])):
                print(f"  {len(durations)} calls, {sum(durations) / 1e3:.2f} ms: {stack}")
        return
    tables = [kernel_times(p, args.functors) for p in args.traces]
    names = sorted({n for t in tables for n in t}, key=lambda n: -max(sum(t.get(n, [])) for t in tables))
    for i, path in enumerate(args.traces):
        total = sum(sum(v) for v in tables[i].values())
        print(f"[{i}] {path.name}: {total / 1e3:.1f} ms of kernels, {sum(len(v) for v in tables[i].values())} launches")
    header = " | ".join(f"[{i}] calls, ms, us/call" for i in range(len(tables)))
    print(f"kernel | {header}")
    for name in names[:args.rows]:
        cells = []
        for table in tables:
            durations = table.get(name, [])
            cells.append(f"{len(durations)}, {sum(durations) / 1e3:.2f}, {sum(durations) / max(len(durations), 1):.0f}"
                         if durations else "-")
        print(f"{name} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
