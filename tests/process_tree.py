"""Find and kill whole process trees (torchrun starts its ranks in their own sessions, so killpg misses them)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

# After SIGKILL a process's pipes close at once; this bounds the read in case a stray holder keeps one open.
REAP_TIMEOUT_S = 30.0


def parent_pid(pid: int) -> int | None:
    """The parent process id of ``pid`` (read from /proc; ``None`` once it has gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            parent = parent_pid(int(entry))
            if parent is not None:
                parents.setdefault(parent, []).append(int(entry))
    found: set[int] = set()
    todo = [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found.update(children)
        todo += children
    return found


def kill_tree(proc: subprocess.Popen) -> str:
    """SIGKILL ``proc`` and everything below it at once; return what it printed."""
    for pid in [proc.pid, *descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        out, _ = proc.communicate(timeout=REAP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        out = f"(output not read: a pipe stayed open {REAP_TIMEOUT_S:.0f}s after SIGKILL)"
    return out or ""


def readline_within(proc: subprocess.Popen, timeout: float) -> str | None:
    """The next line ``proc`` writes to its stdout pipe, or ``None`` if none comes within ``timeout`` s."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else None


def communicate_all(procs: list[subprocess.Popen], timeout: float) -> list[str] | None:
    """Every process's output once each has exited within ``timeout`` s of being waited for; if one has not,
    kill every process tree and return ``None``."""
    try:
        return [proc.communicate(timeout=timeout)[0] or "" for proc in procs]
    except subprocess.TimeoutExpired:
        for proc in procs:
            kill_tree(proc)
        return None
