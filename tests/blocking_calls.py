"""Find blocking calls without a timeout in test sources (checked by ``tests/reliability/test_suite_hygiene.py``).

A hung child process or queue would otherwise stall a test until pytest-timeout's 300 s limit (or
forever, for a read in a session hook). Flagged: ``subprocess.run``/``check_output``/``check_call``/
``call``, ``.communicate()``, ``.wait()``, ``.join()`` and ``.get()`` without arguments,
``.result()``, and reads of a process pipe (``<x>.stdout.read*()``), unless a ``timeout`` is passed or the
call is awaited through ``asyncio.wait_for(call, timeout)``. ``torch.distributed`` calls are bounded by the
process-group timeout and are not flagged.
"""

from __future__ import annotations

import ast
from pathlib import Path

_SUBPROCESS = {"run", "check_output", "check_call", "call"}
_NO_ARG_WAITS = {"communicate", "wait", "join", "get", "result"}
# Lines allowed to block: a pipe read on a daemon thread whose join is bounded.
ALLOWED = {("process_tree.py", "proc.stdout.readline()")}


def _flag(node: ast.Call) -> str | None:
    func = node.func
    if not isinstance(func, ast.Attribute) or any(k.arg == "timeout" for k in node.keywords):
        return None
    base, name = ast.unparse(func.value), func.attr
    if base == "subprocess" and name in _SUBPROCESS:
        return ast.unparse(node)
    if name in _NO_ARG_WAITS and not node.args and base not in ("dist", "torch.distributed"):
        return ast.unparse(node)
    if name in ("read", "readline", "readlines") and base.endswith((".stdout", ".stderr")):
        return ast.unparse(node)
    return None


def _bounded_by_wait_for(tree: ast.AST) -> set[int]:
    """Ids of the calls passed as the awaitable of ``asyncio.wait_for(call, timeout)`` (bounded by its timeout)."""
    bounded = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and ast.unparse(node.func) in ("asyncio.wait_for", "wait_for")
                and node.args and isinstance(node.args[0], ast.Call)
                and (len(node.args) > 1 or any(k.arg == "timeout" for k in node.keywords))):
            bounded.add(id(node.args[0]))
    return bounded


def unbounded_blocking_calls(root: Path) -> list[str]:
    """``path:line: call`` for each flagged call in the ``.py`` files under ``root``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        bounded = _bounded_by_wait_for(tree)
        for node in ast.walk(tree):
            call = _flag(node) if isinstance(node, ast.Call) and id(node) not in bounded else None
            if call is not None and (path.name, call) not in ALLOWED:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {call[:100]}")
    return found
