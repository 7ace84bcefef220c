"""Run test functions on N CPU ranks with gloo, reusing one group of ranks across many checks.

A :class:`RankPool` starts ``world_size`` processes once (forked from a fork server that has torch and
megatron_core imported), rendezvoused through a FileStore (no ports), with a short process-group timeout.
:meth:`RankPool.run` sends a module-level function to every rank and returns the per-rank results. A failure on any rank raises with each failing
rank's traceback; a hang past the per-call wall limit kills the pool (a new one is spawned on the
next call). Workers exit when the parent dies, so no process is left behind.

Usage in a test::

    from tests.dist_harness import run_on_ranks

    def _check():                          # module level, so workers can import it
        rank = torch.distributed.get_rank()
        ...
        return value

    def test_something():
        results = run_on_ranks(4, _check)  # one result per rank
"""

from __future__ import annotations

import atexit
import gc
import importlib
import multiprocessing as mp
import os
import queue
import sys
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from datetime import timedelta
from typing import Any

DEFAULT_CALL_TIMEOUT_S = float(os.environ.get("MCORE_TEST_CALL_TIMEOUT", "180"))
PROCESS_GROUP_TIMEOUT_S = float(os.environ.get("MCORE_TEST_PG_TIMEOUT", "60"))
# TORCH_DISTRIBUTED_DEBUG of the rank pools' workers (section 7 check 10); "" leaves the environment's. Tests
# marked ``distributed_debug_off`` get pools without it (see ``debug_mode_for``).
DISTRIBUTED_DEBUG = os.environ.get("MCORE_TEST_DISTRIBUTED_DEBUG", "")
_debug_off_for_current_test = False
FAILURE_GRACE_S = 5.0
MAX_LIVE_POOLS = 3


class DistributedTestError(AssertionError):
    """One or more ranks failed or hung; the message holds each rank's traceback."""


def _resolve(module_name: str, qualname: str) -> Callable[..., Any]:
    obj: Any = importlib.import_module(module_name)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker_main(rank: int, world_size: int, store_path: str, tasks: mp.Queue, results: mp.Queue,
                 parent_pid: int, sys_path: list[str], debug: str = "", environ: dict[str, str] | None = None) -> None:
    sys.path[:] = sys_path
    if environ is not None:  # forked from the fork server: the test process's environment now, not at its start
        os.environ.clear()
        os.environ.update(environ)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ["MCORE_TEST_RANK"] = str(rank)
    # This worker's own rank variables, as torchrun sets them: a test that leaves e.g. WORLD_SIZE=1 in the parent's
    # environment (the in-process CLI setup does) must not reach pools spawned after it (HyperCommGrid reads it).
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    if debug:
        # Read when the process group is created: with DETAIL, gloo checks every collective's op and shapes
        # across ranks first, so a desync raises a RuntimeError naming them instead of hanging or aborting.
        os.environ["TORCH_DISTRIBUTED_DEBUG"] = debug
    elif DISTRIBUTED_DEBUG:
        os.environ.pop("TORCH_DISTRIBUTED_DEBUG", None)
    import torch
    import torch.distributed as dist

    dist.set_debug_level_from_env()  # read at import, which a forked rank's fork server did with its environment
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size,
        timeout=timedelta(seconds=PROCESS_GROUP_TIMEOUT_S),
    )
    from megatron_core import parallel_state

    _short_subgroup_timeouts(parallel_state)
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if _gone(parent_pid):
                os._exit(0)
            continue
        if task is None:
            break
        task_id, module_name, qualname, args, kwargs = task
        try:
            fn = _resolve(module_name, qualname)
            value = fn(*args, **kwargs)
            results.put((task_id, rank, True, value))
        except BaseException:  # noqa: BLE001 - report everything, including CheckpointException
            results.put((task_id, rank, False, traceback.format_exc()))
        finally:
            parallel_state.destroy_model_parallel()
            _collect_dead_groups()
    dist.destroy_process_group()
    _exit_without_teardown()


def _gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (the test process: a rank forked by the fork server is not its child)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def _exit_without_teardown() -> None:
    """End a worker that was asked to stop: the exit handlers run (the results queue is flushed, helper pools
    are shut down, temporary files removed), the interpreter's teardown does not. Freeing every module and object
    of a process that has torch loaded costs about 1.5 s of CPU per rank, which ``close`` (a pool evicted or
    recycled between tests) would wait for."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# A worker at rest holds about 8 threads; every live gloo group adds two or more per peer.
GC_THREADS_ABOVE = 32
_threads_after_gc = [0]


def _collect_dead_groups() -> None:
    """After a task: when the destroyed groups' gloo threads are still alive, free what kept them (models and
    wrappers in reference cycles, which hold their groups), so the pool is not recycled for them. Threads that
    a collection could not free do not trigger another one until more have appeared."""
    threads = _thread_count(os.getpid())
    if threads > max(GC_THREADS_ABOVE, _threads_after_gc[0] + 16):
        gc.collect()
        _threads_after_gc[0] = _thread_count(os.getpid())


def _short_subgroup_timeouts(parallel_state: Any) -> None:
    """Make ``initialize_model_parallel`` in tests create its subgroups with the pool's short timeout
    (its own default is 30 minutes), so a hang in any subgroup fails within the per-call limit."""
    original = parallel_state.initialize_model_parallel

    def initialize_model_parallel(*args: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("distributed_timeout_minutes", PROCESS_GROUP_TIMEOUT_S / 60.0)
        return original(*args, **kwargs)

    initialize_model_parallel.__doc__ = original.__doc__
    parallel_state.initialize_model_parallel = initialize_model_parallel


# Imported once by the fork server the ranks are forked from (a spawned rank imported them itself: about 4 s of CPU
# per rank, 15-20 s of wall time for an 8-rank pool on 2 cores).
FORK_SERVER_PRELOAD = ["torch", "torch.distributed", "megatron_core.parallel_state", "megatron_core.distributed",
                       "megatron_core.transformer"]


def _worker_context() -> Any:
    """The multiprocessing context of the ranks: ``forkserver`` with torch and megatron_core preloaded (a fresh
    process forked from a server that imported nothing else and started no work), ``spawn`` where there is none
    or ``MCORE_TEST_POOL_START=spawn``."""
    method = os.environ.get("MCORE_TEST_POOL_START", "forkserver")
    if method not in mp.get_all_start_methods():
        method = "spawn"
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(FORK_SERVER_PRELOAD)
    return ctx


class RankPool:
    """``world_size`` CPU ranks in one gloo process group, fed functions through queues."""

    def __init__(self, world_size: int, debug: str = "") -> None:
        self.world_size = world_size
        self.debug = debug
        self._ctx = _worker_context()
        self._tmpdir = tempfile.mkdtemp(prefix=f"mcore_pool{world_size}_")
        store_path = os.path.join(self._tmpdir, "store")
        self._results: mp.Queue = self._ctx.Queue()
        self._tasks = [self._ctx.Queue() for _ in range(world_size)]
        self._procs = [
            self._ctx.Process(
                target=_worker_main,
                args=(r, world_size, store_path, self._tasks[r], self._results, os.getpid(), list(sys.path), debug,
                      dict(os.environ)),
                daemon=True,
            )
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0

    def alive(self) -> bool:
        """True while every rank process is running."""
        return all(p.is_alive() for p in self._procs)

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float = DEFAULT_CALL_TIMEOUT_S,
            **kwargs: Any) -> list[Any]:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results ordered by rank."""
        if "<locals>" in fn.__qualname__:
            raise ValueError(f"{fn.__qualname__} must be defined at module level so ranks can import it")
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn.__module__, fn.__qualname__, args, kwargs))
        values: dict[int, Any] = {}
        errors: dict[int, str] = {}
        deadline = time.monotonic() + timeout
        while len(values) + len(errors) < self.world_size:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, now + FAILURE_GRACE_S)
            try:
                tid, rank, ok, value = self._results.get(timeout=max(0.05, min(1.0, deadline - now)))
            except queue.Empty:
                dead = [r for r, p in enumerate(self._procs) if not p.is_alive()]
                if time.monotonic() >= deadline or dead:
                    missing = sorted(set(range(self.world_size)) - set(values) - set(errors))
                    self.close(force=True)
                    reason = f"ranks {dead} died" if dead else f"no answer within {timeout:.0f}s"
                    raise DistributedTestError(
                        f"{fn.__qualname__} on {self.world_size} ranks: {reason}; ranks {missing} did not "
                        f"return.\n" + _format_errors(errors)
                    ) from None
                continue
            if tid != task_id:
                continue
            (values if ok else errors)[rank] = value
        if errors:
            raise DistributedTestError(
                f"{fn.__qualname__} failed on ranks {sorted(errors)} of {self.world_size}:\n" + _format_errors(errors)
            )
        return [values[r] for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        """Stop every rank (politely unless ``force``) and wait for them to exit."""
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=5)


def _format_errors(errors: dict[int, str]) -> str:
    return "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))


_POOLS: OrderedDict[tuple[int, str], RankPool] = OrderedDict()


def set_debug_off_for_current_test(off: bool) -> None:
    """Called by the test session before each test: ``True`` for tests marked ``distributed_debug_off``."""
    global _debug_off_for_current_test
    _debug_off_for_current_test = off


def debug_mode_for() -> str:
    """The ``TORCH_DISTRIBUTED_DEBUG`` value the current test's pools use.

    DETAIL's per-group sequence numbers count collectives and point-to-point ops alike, so a group that
    carries pipeline ``send``/``recv`` (different counts on different ranks) and later a collective is
    reported as a desync; tests doing that are marked ``distributed_debug_off``.
    """
    return "" if _debug_off_for_current_test else DISTRIBUTED_DEBUG


def get_pool(world_size: int) -> RankPool:
    """A live pool of ``world_size`` ranks, reused across tests (at most ``MAX_LIVE_POOLS`` pools stay alive;
    the least recently used one is closed to make room)."""
    key = (world_size, debug_mode_for())
    pool = _POOLS.pop(key, None)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        while len(_POOLS) >= MAX_LIVE_POOLS:
            _, old = _POOLS.popitem(last=False)
            old.close()
        pool = RankPool(*key)
    _POOLS[key] = pool
    return pool


def run_on_ranks(world_size: int, fn: Callable[..., Any], *args: Any,
                 timeout: float = DEFAULT_CALL_TIMEOUT_S, **kwargs: Any) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` CPU ranks; return the per-rank results."""
    return get_pool(world_size).run(fn, *args, timeout=timeout, **kwargs)


MAX_WORKER_THREADS = int(os.environ.get("MCORE_TEST_MAX_WORKER_THREADS", "256"))


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:  # not Linux, or the process is gone
        return 0


def recycle_bloated_pools(max_threads: int = MAX_WORKER_THREADS) -> list[int]:
    """Close the pools whose workers hold more than ``max_threads`` threads; return their world sizes.

    Every process group a test creates keeps gloo's TCP threads alive in the reused workers until the
    process exits, and together they cost CPU even when idle. Between tests (no state is carried over)
    a bloated pool is closed; the next ``get_pool`` spawns a fresh one.
    """
    closed = []
    for key, pool in list(_POOLS.items()):
        if any(_thread_count(p.pid) > max_threads for p in pool._procs if p.pid is not None):
            _POOLS.pop(key)
            pool.close()
            closed.append(key[0])
    return closed


def close_all_pools() -> None:
    """Stop every pool (called at the end of the test session)."""
    while _POOLS:
        _, pool = _POOLS.popitem()
        pool.close()


atexit.register(close_all_pools)
