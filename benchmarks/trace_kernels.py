"""GPU kernels of torch.profiler Chrome traces, grouped by name: calls, total and mean time, side by side.

Reads the traces ``fp8_training.py --only step --profile --trace-dir DIR`` writes (or any ``export_chrome_trace``
output) and prints, for each kernel name (shortened), its calls and total milliseconds in every trace, sorted by
the largest total, and each trace's sum. Kernels launched inside CUDA graphs are in the trace too.

    python3 benchmarks/trace_kernels.py DIR/full_step_bf16*.json DIR/full_step_fp8_param*.json --rows 60
"""

from __future__ import annotations

import argparse
import json
import re
from collections import defaultdict
from pathlib import Path


def kernel_times(path: Path) -> dict[str, list[float]]:
    """Durations (us) of the GPU kernels in the Chrome trace at ``path``, by shortened kernel name."""
    events = json.loads(path.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if event.get("cat") == "kernel" and event.get("ph") == "X":
            times[short_name(event["name"])].append(float(event["dur"]))
    return times


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=50)
    args = parser.parse_args()
    tables = [kernel_times(p) for p in args.traces]
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
