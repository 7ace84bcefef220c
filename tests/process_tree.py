"""Find and kill whole process trees (torchrun starts its ranks in their own sessions, so killpg misses them)."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
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
    out, _ = proc.communicate()
    return out
