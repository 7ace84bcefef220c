"""GPU kernels of torch.profiler Chrome traces, grouped by name: calls, total and mean time, side by side.

Reads the traces ``fp8_training.py --only step --profile --trace-dir DIR`` writes (or any ``export_chrome_trace``
output) and prints, for each kernel name (shortened), its calls and total milliseconds in every trace, sorted by
the largest total, and each trace's sum. Kernels launched inside CUDA graphs are in the trace too.

    python3 benchmarks/trace_kernels.py DIR/full_step_bf16*.json DIR/full_step_fp8_param*.json --rows 60 --functors
    python3 benchmarks/trace_kernels.py DIR/full_step_fp8_param*.json --functors --launchers CUDAFunctor_add
    python3 benchmarks/trace_kernels.py DIR/moe_fp8*.json --gaps 10    # where the GPU sat idle, and why
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


class _HostSide:
    """The host's side of a trace: runtime and driver calls (Triton launches through the driver) by correlation id,
    CPU operators by thread."""

    def __init__(self, events: list[dict]) -> None:
        self.runtime = {e["args"]["correlation"]: e for e in events
                        if e.get("cat") in ("cuda_runtime", "cuda_driver") and e.get("ph") == "X"
                        and "correlation" in e.get("args", {})}
        self.operators: dict[tuple, list[dict]] = defaultdict(list)
        for event in events:
            if event.get("cat") in ("cpu_op", "user_annotation", "python_function") and event.get("ph") == "X":
                self.operators[(event.get("pid"), event.get("tid"))].append(event)

    def stack_at(self, thread: tuple, ts: float, depth: int, outermost: bool = False) -> str:
        """The innermost ``depth`` CPU operators (outermost first) running on ``thread`` at time ``ts``; with
        ``outermost`` the outermost one first where it is not among them."""
        around = sorted((op for op in self.operators[thread] if op["ts"] <= ts <= op["ts"] + op.get("dur", 0)),
                        key=lambda op: op["ts"])
        names = [op["name"][:60] for op in around[-depth:]]
        if outermost and len(around) > depth:
            names = [around[0]["name"][:40], "..."] + names
        return " > ".join(names)

    def launch(self, kernel: dict) -> dict | None:
        """The runtime or driver call that launched ``kernel``, if the trace has it."""
        return self.runtime.get(kernel.get("args", {}).get("correlation"))

    def launch_stack(self, kernel: dict, depth: int, outermost: bool = False) -> str:
        """The CPU operators around the call that launched ``kernel``, and that call; ``?`` if unknown."""
        launch = self.launch(kernel)
        if launch is None:
            return "?"
        thread = (launch.get("pid"), launch.get("tid"))
        return self.stack_at(thread, launch["ts"], depth, outermost) + f" > {launch['name']}"


def launchers(path: Path, pattern: str, functors: bool = False, depth: int = 4) -> dict[str, list[float]]:
    """Durations (us) of the kernels whose name (as :func:`kernel_times` gives it) contains ``pattern``, by the
    innermost ``depth`` CPU operators (outermost first) around the runtime call that launched each; a kernel
    replayed by a CUDA graph is under the graph launch."""
    events = _events(path)
    host = _HostSide(events)
    times: dict[str, list[float]] = defaultdict(list)
    for event in events:
        if _is_kernel(event) and pattern in kernel_name(event["name"], functors):
            times[host.launch_stack(event, depth)].append(float(event["dur"]))
    return times


def _is_gpu_work(event: dict) -> bool:
    return event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and event.get("ph") == "X"


def idle_gaps(path: Path, min_us: float = 10.0, depth: int = 3) -> tuple[float, float, dict[str, list[float]]]:
    """Where the GPU sat idle: ``(busy us, span us, gaps)`` of the trace at ``path``, ``gaps`` the idle intervals of at
    least ``min_us`` (no kernel, copy or set running on any stream) by what the host was doing when the GPU went idle
    and the CPU operators that launched the work ending the gap (``idle at: ... | resumed by: ...``)."""
    events = _events(path)
    work = sorted((e for e in events if _is_gpu_work(e)), key=lambda e: e["ts"])
    host = _HostSide(events)
    threads = sorted(host.operators, key=lambda thread: -len(host.operators[thread]))
    busy, gaps = 0.0, defaultdict(list)
    if not work:
        return 0.0, 0.0, gaps
    start, end = work[0]["ts"], work[0]["ts"] + work[0]["dur"]
    for event in work[1:]:
        if event["ts"] > end + min_us:
            launch = host.launch(event)
            thread = (launch.get("pid"), launch.get("tid")) if launch else threads[0] if threads else None
            idle_at = host.stack_at(thread, end, depth, outermost=True) if thread else "?"
            resumed = host.launch_stack(event, depth)
            gaps[f"idle at: {idle_at} | resumed by: {resumed}"].append(event["ts"] - end)
        if event["ts"] > end:
            busy += end - start
            start = event["ts"]
        end = max(end, event["ts"] + event["dur"])
    busy += end - start
    return busy, end - work[0]["ts"], gaps


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


def print_idle_gaps(path: Path, min_us: float, rows: int) -> None:
    """Print :func:`idle_gaps` of one trace: busy and idle time, then the causes with the most idle time."""
    busy, span, gaps = idle_gaps(path, min_us)
    idle = sum(sum(v) for v in gaps.values())
    print(f"{path.name}: GPU busy {busy / 1e3:.2f} ms of {span / 1e3:.2f} ms; {sum(len(v) for v in gaps.values())} "
          f"gaps of >= {min_us:g} us, {idle / 1e3:.2f} ms idle")
    for cause, durations in sorted(gaps.items(), key=lambda item: -sum(item[1]))[:rows]:
        print(f"  {len(durations)} gaps, {sum(durations) / 1e3:.2f} ms (max {max(durations):.0f} us): {cause}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=50)
    parser.add_argument("--functors", action="store_true",
                        help="tell PyTorch's generic elementwise kernels apart by the functor they run")
    parser.add_argument("--launchers", default=None, metavar="PATTERN",
                        help="instead: the CPU operators that launched the kernels whose name contains PATTERN")
    parser.add_argument("--gaps", type=float, default=None, metavar="US",
                        help="instead: the GPU's idle gaps of at least US microseconds, by what the host was doing")
    args = parser.parse_args()
    if args.gaps is not None:
        for path in args.traces:
            print_idle_gaps(path, args.gaps, args.rows)
        return
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
