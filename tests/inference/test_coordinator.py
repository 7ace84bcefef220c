"""The data-parallel inference coordinator, client and engine link in one process (pyzmq + msgpack)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgpack")

from megatron_core.inference._zmq import pack, unpack  # noqa: E402
from megatron_core.inference.config import KVCacheManagementMode, PrefixCachingCoordinatorPolicy  # noqa: E402
from megatron_core.inference.data_parallel_inference_coordinator import (  # noqa: E402
    CONTROL_TRANSITIONS,
    HANDLERS,
    CoordinatorState,
    DataParallelInferenceCoordinator,
)
from megatron_core.inference.data_parallel_inference_coordinator.routing import EngineRouter  # noqa: E402
from megatron_core.inference.engines.dynamic_engine import EngineState  # noqa: E402
from megatron_core.inference.headers import (  # noqa: E402
    HEADER_ENUMS,
    Control,
    Headers,
    UnknownHeaderError,
    decode_header,
)
from megatron_core.inference.inference_client import InferenceClient  # noqa: E402
from megatron_core.inference.inference_request import Status  # noqa: E402
from megatron_core.inference.utils import InferenceMode  # noqa: E402
from tests.inference.coordinator_fixture import GREEDY, PROMPTS, engine, reference, tiny_gpt  # noqa: E402

WAIT_S = 60


def test_headers_values_and_decoding():
    values = [m.value for e in HEADER_ENUMS for m in e]
    assert len(values) == len(set(values))
    assert Headers.PAUSE is Control.PAUSE and Headers(45) is Control.STOP and decode_header(21) is Headers.ENGINE_REPLY
    assert (Headers.CONNECT, Headers.SUBMIT_REQUEST, Headers.DISCONNECT, Headers.TP_BROADCAST) == (0, 20, 60, 80)
    for bad in (99, -1, "PAUSE", None, True):
        with pytest.raises(UnknownHeaderError):
            decode_header(bad)
    with pytest.raises(AttributeError, match="NOPE"):
        getattr(Headers, "NOPE")  # noqa: B009
    assert set(CONTROL_TRANSITIONS) <= set(HANDLERS)
    assert CONTROL_TRANSITIONS[Headers.STOP].allowed_from == {CoordinatorState.PAUSED, CoordinatorState.SUSPENDED}


def test_router_least_loaded_and_prefix_affinity():
    router = EngineRouter(4, PrefixCachingCoordinatorPolicy.LOAD_BALANCED, 0.5, False)
    for ident in (b"a", b"b"):
        router.add(ident)
    picks = []
    for _ in range(4):
        picks.append(router.best([]))
        router.assign(picks[-1], [])
    assert picks == [b"a", b"b", b"a", b"b"]
    router.finish(b"b")
    assert router.least_loaded() == b"b"
    router = EngineRouter(4, PrefixCachingCoordinatorPolicy.LONGEST_PREFIX, 0.9, True)
    for ident in (b"a", b"b"):
        router.add(ident)
    router.assign(b"b", [11, 12, 13])
    assert router.best([11, 12, 99]) == b"b"  # shares two blocks with b despite b's load
    assert router.best([77]) == b"a"  # no match: the less loaded one
    router.remove(b"b")
    assert router.best([11, 12]) == b"a" and router.identities == [b"a"]


def test_coordinator_config_errors_name_the_field():
    with pytest.raises(ValueError, match="max_requests"):
        DataParallelInferenceCoordinator(None, 0, None, 0)
    with pytest.raises(ValueError, match="block_size_tokens"):
        DataParallelInferenceCoordinator(None, 0, None, 4, enable_prefix_caching=True)


def test_one_engine_matches_generate_and_control_signals():
    """Coordinator (spawned process) + engine + client in this process; outputs equal ``engine.generate``."""
    model = tiny_gpt()
    expected = reference(PROMPTS, model)
    served = engine(model)
    served.context.kv_cache_management_mode = KVCacheManagementMode.OFFLOAD

    async def main():
        address = await served.start_listening_to_data_parallel_coordinator(0, True)
        assert address.startswith("tcp://127.0.0.1:")
        client = InferenceClient(address, deserialize=True)
        client.start(connect_timeout_s=WAIT_S)
        try:
            first = [client.add_request(p, GREEDY) for p in PROMPTS[:4]]
            too_long = client.add_request(list(range(3, 103)), GREEDY)
            defaults = client.add_request(PROMPTS[0], None)  # SamplingParams() defaults
            raw = {99: {"top_k": -1}, 100: {"validate": 1}}  # sent by hand: SamplingParams would refuse them
            for rid, params in raw.items():
                client.completion_futures[rid] = asyncio.get_running_loop().create_future()
                client.socket.send(pack([Headers.SUBMIT_REQUEST.value, rid, PROMPTS[0], params]))
            bad = await asyncio.wait_for(asyncio.gather(*(client.completion_futures[r] for r in raw)), WAIT_S)
            assert [r.status for r in bad] == [Status.FAILED] * 2
            assert "top_k" in bad[0].error and "'validate' is not a setting" in bad[1].error
            done = await asyncio.wait_for(asyncio.gather(*first, too_long), WAIT_S)
            client.pause_engines()
            await asyncio.wait_for(served.wait_until(EngineState.PAUSED), WAIT_S)
            paused = [client.add_request(p, GREEDY) for p in PROMPTS[4:]]
            await asyncio.sleep(0.3)
            assert not any(f.done() for f in paused)  # queued, no steps while paused
            client.suspend_engines()
            await asyncio.wait_for(served.wait_until(EngineState.SUSPENDED), WAIT_S)
            assert served.context.kv_memory == {} and not InferenceMode.is_active()  # offloaded by suspend()
            client.resume_engines()
            await asyncio.wait_for(served.wait_until(EngineState.RESUMED), WAIT_S)
            assert served.context.kv_memory and served.context.is_tensor_state_allocated and InferenceMode.is_active()
            client.unpause_engines()
            await asyncio.wait_for(served.wait_until(EngineState.RUNNING), WAIT_S)
            done += await asyncio.wait_for(asyncio.gather(*paused), WAIT_S)
            unfinished = client.add_request(PROMPTS[0], GREEDY)
            client.pause_engines()
            await asyncio.wait_for(served.wait_until(EngineState.PAUSED), WAIT_S)
            client.stop_engines()
            await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
            stopped = await asyncio.wait_for(unfinished, WAIT_S)
            assert (await asyncio.wait_for(defaults, WAIT_S)).status == Status.COMPLETED
            client.shutdown_coordinator()
        finally:
            client.stop()
            handle = served.inference_coordinator_process
            handle.join(WAIT_S)
            if handle.is_alive():
                handle.terminate()
                handle.join(WAIT_S)
        return done, stopped, handle

    done, stopped, handle = asyncio.run(main())
    results = done[:4] + done[5:]
    assert [r.generated_tokens for r in results] == expected
    assert all(r.status == Status.COMPLETED and r.latency > 0 for r in results)
    assert results[0].generated_text == served.controller.tokenizer.detokenize(expected[0])
    refused = done[4]
    assert refused.status == Status.FAILED and "max_sequence_length" in refused.error
    assert stopped.status == Status.FAILED and "stopped" in stopped.error
    assert not handle.is_alive() and handle.exitcode == 0
    assert served.state == EngineState.STOPPED


def _serve_coordinator():
    """A coordinator (no engines yet) whose loop runs on a thread; returns ``(coordinator, thread)``."""
    coordinator = DataParallelInferenceCoordinator(None, 0, None, 8)
    thread = threading.Thread(target=coordinator.start, daemon=True)
    thread.start()
    return coordinator, thread


def _register(coordinator, engine: _Peer) -> None:
    """Register ``engine`` and wait until the coordinator has it (sockets are not ordered with each other)."""
    engine.send(b"")
    deadline = time.monotonic() + WAIT_S
    while not coordinator.identities_of_data_parallel_ranks:
        assert time.monotonic() < deadline, "the engine did not register"
        time.sleep(0.01)


def _close(coordinator, thread, *peers) -> None:
    coordinator.request_stop()
    thread.join(WAIT_S)
    assert not thread.is_alive()
    coordinator.stop()
    for peer in peers:
        peer.close()


class _Peer:
    """A raw DEALER socket speaking the protocol by hand."""

    def __init__(self, address: str, identity: bytes | None = None) -> None:
        import zmq

        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.connect(address)

    def send(self, payload) -> None:
        self.socket.send(payload if isinstance(payload, bytes) else pack(payload))

    def recv(self):
        assert self.socket.poll(WAIT_S * 1000), "no message within the timeout"
        return unpack(self.socket.recv())

    def close(self) -> None:
        self.socket.close(linger=0)
        self.context.term()


def test_malformed_messages_and_engine_disconnect_get_error_replies():
    coordinator, thread = _serve_coordinator()
    client, fake_engine = _Peer(coordinator.addr), _Peer(coordinator.addr, b"mp-coord-7")
    try:
        client.send([Headers.SUBMIT_REQUEST.value, 0, [5, 6], {}])
        header, rid, reply = client.recv()
        assert header == Headers.ENGINE_REPLY and rid == 0 and "before CONNECT" in reply["error"]
        client.send([Headers.CONNECT.value])
        assert client.recv() == [Headers.CONNECT_ACK.value]
        for bad, expected in ((b"\xc1 not msgpack", "msgpack"), (pack({"a": 1}), "array"),
                              (pack([99, 3]), "unknown message header"), (pack([Headers.SUBMIT_REQUEST.value, 4]), "fields"),
                              (pack([Headers.SUBMIT_REQUEST.value, 5, 3.5, {}]), "prompt"),
                              (pack([Headers.ENGINE_REPLY.value, []]), "engines only"),
                              (pack([Headers.SUBMIT_REQUEST.value, 6, [1, 2], {}]), "no inference engine")):
            client.send(bad)
            header, _, reply = client.recv()
            assert header == Headers.ENGINE_REPLY and reply["status"] == "FAILED" and expected in reply["error"], reply
        _register(coordinator, fake_engine)
        client.send([Headers.SUBMIT_REQUEST.value, 7, [1, 2, 3], {"top_k": 1}])
        header, engine_rid, prompt, params = fake_engine.recv()
        assert header == Headers.SUBMIT_REQUEST and prompt == [1, 2, 3] and params == {"top_k": 1}
        client.send([Headers.UNPAUSE.value])  # invalid while RUNNING: dropped, never forwarded
        client.send([Headers.PAUSE.value])
        assert fake_engine.recv() == [Headers.PAUSE.value]
        fake_engine.send([Headers.DISCONNECT.value])
        header, rid, reply = client.recv()
        assert rid == 7 and reply["request_id"] == engine_rid and "disconnected" in reply["error"]
        client.send([Headers.SHUTDOWN.value])
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        _close(coordinator, thread, client, fake_engine)


def test_shutdown_fails_requests_in_flight():
    coordinator, thread = _serve_coordinator()
    client, fake_engine = _Peer(coordinator.addr), _Peer(coordinator.addr, b"mp-coord-0")
    try:
        _register(coordinator, fake_engine)
        client.send([Headers.CONNECT.value])
        assert client.recv() == [Headers.CONNECT_ACK.value]
        client.send([Headers.SUBMIT_REQUEST.value, "r1", "hello", None])
        assert fake_engine.recv()[2] == "hello"
        client.send([Headers.SHUTDOWN.value])
        _, rid, reply = client.recv()
        assert rid == "r1" and "shut down" in reply["error"]
        thread.join(WAIT_S)
        assert not thread.is_alive()
    finally:
        _close(coordinator, thread, client, fake_engine)


def test_modules_import_without_the_extra_and_use_names_it():
    """Without pyzmq the modules import; first use raises ImportError naming the ``coordinator`` extra."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['zmq'] = None; sys.modules['msgpack'] = None\n"
        "import megatron_core.inference.inference_client as c, megatron_core.inference.engines.coordinator_link\n"
        "import megatron_core.inference.data_parallel_inference_coordinator\n"
        "try:\n    c.InferenceClient('tcp://127.0.0.1:1')\nexcept ImportError as e:\n    print(e)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=WAIT_S)
    assert out.returncode == 0, out.stderr
    assert "megatron-core-lite[coordinator]" in out.stdout


def test_engine_joins_a_running_coordinator():
    """``launch_inference_coordinator=False``: the engine connects to a coordinator someone else started."""
    coordinator, thread = _serve_coordinator()
    model = tiny_gpt()
    expected = reference(PROMPTS[:2], model)
    served = engine(model)
    port = int(coordinator.addr.rsplit(":", 1)[1])

    async def main():
        with pytest.raises(ValueError, match="inference_coordinator_port"):
            await served.start_listening_to_data_parallel_coordinator(None, False)
        address = await served.start_listening_to_data_parallel_coordinator(port, False)
        # The engine's registration and the client's requests travel on different sockets: wait until the
        # coordinator has seen the engine (a request with no engine registered fails at once, by design).
        deadline = time.monotonic() + WAIT_S
        while not coordinator.identities_of_data_parallel_ranks:
            assert time.monotonic() < deadline, "the engine never registered"
            await asyncio.sleep(0.01)
        client = InferenceClient(address)
        client.start(connect_timeout_s=WAIT_S)
        try:
            replies = await asyncio.wait_for(asyncio.gather(*(client.add_request(p, GREEDY) for p in PROMPTS[:2])),
                                             WAIT_S)
            client.pause_engines()
            await asyncio.wait_for(served.wait_until(EngineState.PAUSED), WAIT_S)
            client.stop_engines()
            await asyncio.wait_for(served.wait_until(EngineState.STOPPED), WAIT_S)
        finally:
            client.stop()
        return replies

    try:
        replies = asyncio.run(main())
        assert [r["generated_tokens"] for r in replies] == expected
        assert served.inference_coordinator_process is None
        deadline = time.monotonic() + WAIT_S
        while coordinator.identities_of_data_parallel_ranks:  # the stopped engine sent DISCONNECT
            assert time.monotonic() < deadline, "the stopped engine never disconnected"
            time.sleep(0.01)
    finally:
        _close(coordinator, thread)
