"""``strategies.async_utils``' ``TemporalAsyncCaller`` / ``PersistentAsyncCaller`` and the queue over them."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from megatron_core.dist_checkpointing.core import CheckpointingException
from megatron_core.dist_checkpointing.strategies.async_utils import (
    AsyncCaller,
    AsyncCallsQueue,
    AsyncRequest,
    PersistentAsyncCaller,
    TemporalAsyncCaller,
)
from tests.dist_harness import run_on_ranks


@pytest.fixture(autouse=True)
def no_shared_persistent_writer():
    """Each test starts and ends without the process-wide persistent writer (a class attribute)."""

    def reset() -> None:
        with AsyncCallsQueue._persistent_lock:
            writer, AsyncCallsQueue._persistent_caller = AsyncCallsQueue._persistent_caller, None
            AsyncCallsQueue._persistent_users.clear()
        if writer is not None:
            writer.close()

    reset()
    yield
    assert AsyncCallsQueue._persistent_caller is None  # every queue here closes what it used
    reset()


def test_temporal_caller_runs_one_request_in_its_own_thread():
    gate, seen = threading.Event(), []
    request = AsyncRequest(lambda: (gate.wait(5), seen.append(threading.current_thread().name)), (), [],
                           preload_fn=lambda: seen.append("preload"), call_idx=3)
    caller = TemporalAsyncCaller()
    assert isinstance(caller, AsyncCaller)
    caller.schedule_async_call(request)
    assert seen == ["preload"] and not caller.is_current_async_call_done(no_dist=True)
    gate.set()
    assert caller.is_current_async_call_done(blocking=True, no_dist=True)
    assert seen == ["preload", "mcore-ckpt-write-3"] and caller.error is None
    caller.close()


def test_persistent_caller_runs_requests_in_order_on_one_thread():
    order = []
    caller = PersistentAsyncCaller()
    for i in range(3):
        caller.schedule_async_call(AsyncRequest(lambda i=i: order.append((i, threading.current_thread().name)),
                                                (), [], call_idx=i))
    for _ in range(3):
        assert caller.is_current_async_call_done(blocking=True, no_dist=True)
        caller._retire_current_call()
    assert order == [(0, "mcore-ckpt-writer"), (1, "mcore-ckpt-writer"), (2, "mcore-ckpt-writer")]
    caller.close()


def _boom() -> None:
    raise OSError("disk gone")


@pytest.mark.parametrize("persistent", [False, True])
def test_queue_keeps_order_and_reports_failures(persistent):
    queue = AsyncCallsQueue(persistent=persistent)
    done = []
    assert queue.schedule_async_request(AsyncRequest(lambda: None, (), [lambda: done.append(0)])) == 0
    assert queue.schedule_async_request(AsyncRequest(_boom, (), [lambda: done.append(1)])) == 1
    with pytest.raises(CheckpointingException, match="save 1 failed: OSError: disk gone"):
        queue.maybe_finalize_async_calls(blocking=True, no_dist=True)
    assert done == [0] and queue.get_num_unfinalized_calls() == 0
    queue.close()


def _failure_on_one_rank(persistent: bool) -> str:
    queue = AsyncCallsQueue(persistent=persistent)
    fn = _boom if dist.get_rank() == 1 else (lambda: None)
    queue.schedule_async_request(AsyncRequest(fn, (), [lambda: None]))
    with pytest.raises(CheckpointingException) as info:
        queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return str(info.value)


@pytest.mark.parametrize("persistent", [False, True])
def test_a_failure_on_one_rank_fails_every_rank(persistent):
    messages = run_on_ranks(2, _failure_on_one_rank, persistent)
    assert "another rank" in messages[0] and "disk gone" in messages[1]
