"""AsyncStream (Megatron-Core's ``inference.async_stream``): items in order, normal end, exceptions, reader
cancellation, puts from another thread, and the errors for a wrong or closed event loop."""

from __future__ import annotations

import asyncio
import threading

import pytest

from megatron_core.inference.async_stream import STOP_ITERATION, AsyncStream
from megatron_core.inference.inference_request import InferenceRequest

WAIT_S = 30


def _item(i: int) -> InferenceRequest:
    return InferenceRequest(request_id=7, generated_tokens=list(range(i + 1)))


async def _read(stream: AsyncStream) -> list[InferenceRequest]:
    async def collect() -> list[InferenceRequest]:
        return [item async for item in stream.generator()]

    return await asyncio.wait_for(collect(), WAIT_S)


def test_items_then_normal_end_and_late_puts_dropped():
    cancels = []

    async def main():
        stream = AsyncStream(7, lambda: cancels.append(7))
        assert stream.loop is asyncio.get_running_loop() and stream.request_id == 7
        for i in range(3):
            stream.put(_item(i))
        stream.finish()
        stream.finish()  # idempotent
        stream.put(_item(9))  # after finish: dropped
        assert stream.finished
        return await _read(stream)

    items = asyncio.run(main())
    assert [item.generated_tokens for item in items] == [[0], [0, 1], [0, 1, 2]]
    assert cancels == []  # a stream read to its end is not cancelled
    assert isinstance(STOP_ITERATION, Exception)


@pytest.mark.parametrize("exception", [ValueError("boom"), ValueError])
def test_finish_with_exception_raises_in_reader_after_items(exception):
    async def main():
        stream = AsyncStream(1, lambda: None)
        stream.put(_item(0))
        stream.finish(exception=exception)
        got = []
        with pytest.raises(ValueError):
            async for item in stream.generator():
                got.append(item)
        return got

    assert len(asyncio.run(asyncio.wait_for(main(), WAIT_S))) == 1


def test_finish_with_a_non_exception_ends_normally():
    async def main():
        stream = AsyncStream(1, lambda: None)
        stream.put(_item(0))
        stream.finish(exception="not an exception")  # type: ignore[arg-type]
        return await _read(stream)

    assert len(asyncio.run(main())) == 1


def test_reader_closing_early_cancels_the_stream():
    cancels = []

    async def main():
        stream = AsyncStream(3, lambda: cancels.append(3))
        stream.put(_item(0))
        stream.put(_item(1))
        gen = stream.generator()
        first = await asyncio.wait_for(gen.__anext__(), WAIT_S)
        await gen.aclose()
        return first

    assert asyncio.run(main()).generated_tokens == [0]
    assert cancels == [3]


def test_cancelled_reader_task_cancels_the_stream():
    cancels = []

    async def main():
        stream = AsyncStream(4, lambda: cancels.append(4))
        started = asyncio.Event()

        async def reader():
            started.set()
            async for _ in stream.generator():
                pass

        task = asyncio.create_task(reader())
        await asyncio.wait_for(started.wait(), WAIT_S)
        await asyncio.sleep(0)  # let the reader block on the empty queue
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, WAIT_S)

    asyncio.run(main())
    assert cancels == [4]


def test_puts_from_another_thread_reach_the_reader():
    async def main():
        stream = AsyncStream(5, lambda: None)

        def produce():
            for i in range(20):
                stream.put(_item(i))
            stream.finish()

        thread = threading.Thread(target=produce)
        thread.start()
        items = await _read(stream)
        thread.join(WAIT_S)
        return items

    items = asyncio.run(main())
    assert [len(item.generated_tokens) for item in items] == list(range(1, 21))


def test_reading_on_another_loop_raises():
    other = asyncio.new_event_loop()
    try:
        stream = AsyncStream(6, lambda: None, loop=other)

        async def main():
            with pytest.raises(RuntimeError, match="request 6 belongs to another event loop"):
                await _read(stream)

        asyncio.run(main())
    finally:
        other.close()


def test_closed_loop_errors():
    loop = asyncio.new_event_loop()
    loop.close()
    with pytest.raises(RuntimeError, match="cannot stream request 8: its event loop is closed"):
        AsyncStream(8, lambda: None, loop=loop)
    live = asyncio.new_event_loop()
    stream = AsyncStream(9, lambda: None, loop=live)
    live.close()
    with pytest.raises(RuntimeError, match="cannot stream request 9: its event loop was closed"):
        stream.put(_item(0))
    stream.finish()  # nobody can read it: just marked finished
    assert stream.finished
