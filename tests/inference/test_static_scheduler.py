"""Scheduler (Megatron-Core's ``inference.scheduler``): ids, active / waiting / completed pool transitions, streams,
and the errors for bad input."""

from __future__ import annotations

import asyncio

import pytest

from megatron_core.inference.inference_request import InferenceRequest, Status
from megatron_core.inference.sampling_params import SamplingParams
from megatron_core.inference.scheduler import Scheduler

WAIT_S = 30


def _fill(scheduler: Scheduler, count: int) -> list[int]:
    return [scheduler.add_request(prompt=f"p{i}", prompt_tokens=[1, 2, i]) for i in range(count)]


def _statuses(pool) -> list[Status]:
    return [r.status for r in pool.values()]


def test_ids_and_pools_fill_in_arrival_order():
    scheduler = Scheduler(max_batch_size=2)
    ids = _fill(scheduler, 5)
    assert ids == [0, 1, 2, 3, 4]
    assert list(scheduler.active_request_pool) == [0, 1]
    assert list(scheduler.waiting_request_pool) == [2, 3, 4]
    assert _statuses(scheduler.active_request_pool) == [Status.ACTIVE_BUT_NOT_GENERATING_TOKENS] * 2
    assert _statuses(scheduler.waiting_request_pool) == [Status.WAITING_IN_QUEUE] * 3
    assert scheduler.num_requests_pending() == 5 and scheduler.have_requests_pending()
    assert list(scheduler.requests) == ids and scheduler.requests[3].prompt == "p3"
    assert scheduler.requests[3].prompt_tokens == [1, 2, 3] and scheduler.requests[3].arrival_time is not None
    assert scheduler.streams == {}


def test_update_retires_finished_and_refills_fifo():
    scheduler = Scheduler(max_batch_size=2)
    _fill(scheduler, 5)
    batch = scheduler.active_request_pool.copy()
    batch[0].status = Status.COMPLETED  # request 1 is still running
    scheduler.update_requests_pools(result_dict=batch)
    assert list(scheduler.completed_request_pool) == [0]
    assert list(scheduler.active_request_pool) == [1, 2]
    assert scheduler.active_request_pool[2].status == Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
    assert list(scheduler.waiting_request_pool) == [3, 4]
    scheduler.active_request_pool[1].status = Status.COMPLETED
    scheduler.active_request_pool[2].status = Status.FAILED  # an ended request leaves the active pool too
    scheduler.update_requests_pools(result_dict=scheduler.active_request_pool.copy())
    assert list(scheduler.completed_request_pool) == [0, 1, 2]
    assert list(scheduler.active_request_pool) == [3, 4] and not scheduler.waiting_request_pool
    for request in scheduler.active_request_pool.values():
        request.status = Status.COMPLETED
    scheduler.update_requests_pools(result_dict=scheduler.active_request_pool.copy())
    assert not scheduler.have_requests_pending() and len(scheduler.completed_request_pool) == 5


def test_update_without_results_only_refills():
    scheduler = Scheduler(max_batch_size=2)
    _fill(scheduler, 3)
    scheduler.active_request_pool.pop(0)
    scheduler.update_requests_pools()
    assert list(scheduler.active_request_pool) == [1, 2] and not scheduler.waiting_request_pool
    with pytest.raises(ValueError, match=r"active request pool is full \(2 of max_batch_size 2\)"):
        scheduler.add_earliest_waiting_request_to_active_pool()


def test_whole_requests_keep_their_ids_and_new_ids_skip_them():
    scheduler = Scheduler(max_batch_size=4)
    params = SamplingParams(num_tokens_to_generate=3)
    given = InferenceRequest(request_id=0, prompt_tokens=[5, 6], sampling_params=params)
    assert scheduler.add_request(inference_request=given) == 0
    assert scheduler.requests[0] is given and given.status == Status.ACTIVE_BUT_NOT_GENERATING_TOKENS
    assert scheduler.add_request(prompt_tokens=[1]) == 1  # id 0 is taken
    with pytest.raises(ValueError, match="request_id 0 is already pending"):
        scheduler.add_request(inference_request=InferenceRequest(request_id=0, prompt_tokens=[1]))
    given.status = Status.COMPLETED
    scheduler.update_requests_pools(result_dict={0: given})
    again = InferenceRequest(request_id=0, prompt_tokens=[7])
    scheduler.add_request(inference_request=again)  # a finished id may be reused; the new request replaces it
    assert scheduler.requests[0] is again and 0 not in scheduler.completed_request_pool


def test_bad_input():
    with pytest.raises(ValueError, match=r"max_batch_size \(0\) must be a positive int"):
        Scheduler(max_batch_size=0)
    scheduler = Scheduler(max_batch_size=1)
    with pytest.raises(ValueError, match="prompt_tokens is None"):
        scheduler.add_request(prompt="text only")
    with pytest.raises(ValueError, match="request 'r' has prompt_tokens=None"):
        scheduler.add_request(inference_request=InferenceRequest(request_id="r", prompt="x"))
    with pytest.raises(ValueError, match="request 5 is not in the active pool"):
        scheduler.update_requests_pools(result_dict={5: InferenceRequest(request_id=5)})
    with pytest.raises(ValueError, match="unknown request_id 12"):
        scheduler.abort_request(12)
    assert not scheduler.requests  # nothing was added by the failed calls


def test_deprecated_inference_parameters():
    scheduler = Scheduler(max_batch_size=1)
    params = SamplingParams(num_tokens_to_generate=4)
    with pytest.warns(DeprecationWarning, match="renamed to `sampling_params`"):
        request_id = scheduler.add_request(prompt_tokens=[1], inference_parameters=params)
    assert scheduler.requests[request_id].sampling_params is params


def test_streams_abort_and_fail_requests():
    async def main():
        scheduler = Scheduler(max_batch_size=1)
        streaming = scheduler.add_request(prompt_tokens=[1], streaming=True)
        plain = scheduler.add_request(prompt_tokens=[2])
        waiting = scheduler.add_request(prompt_tokens=[3], streaming=True)
        assert list(scheduler.streams) == [streaming, waiting]
        assert scheduler.streams[streaming].loop is asyncio.get_running_loop()
        scheduler.abort_request(plain)  # no stream: nothing to do
        scheduler.abort_request(streaming)  # ends the reader; the request stays pending
        assert [r async for r in scheduler.streams[streaming].generator()] == []
        assert scheduler.num_requests_pending() == 3
        error = ValueError("batch failed")
        scheduler.fail_requests([waiting, 99], error)  # unknown / non-pending ids are ignored
        assert scheduler.completed_request_pool[waiting].status == Status.FAILED
        with pytest.raises(ValueError, match="batch failed"):
            async for _ in scheduler.streams[waiting].generator():
                pass
        scheduler.fail_requests([streaming], error)  # the active pool is refilled from the waiting one
        assert list(scheduler.active_request_pool) == [plain] and not scheduler.waiting_request_pool
        interrupted = scheduler.add_request(prompt_tokens=[4], streaming=True)
        scheduler.fail_requests([interrupted], KeyboardInterrupt())  # readers get a RuntimeError instead
        with pytest.raises(RuntimeError, match=r"generation was interrupted \(KeyboardInterrupt\(\)\)"):
            async for _ in scheduler.streams[interrupted].generator():
                pass

    asyncio.run(asyncio.wait_for(main(), WAIT_S))
