"""Small collectives over ZMQ that yield to the event loop (Megatron-Core's ``AsyncZMQCommunicator``).

An engine loop that runs in asyncio must not block the loop in a ``torch.distributed`` collective
while it waits for peers. This communicator reduces a few integers over a process group with
ZMQ sockets instead: every rank pushes its values to the group's first rank (the leader, a PULL
socket), which publishes the element-wise maximum back (an XPUB socket; the constructor waits
until every peer's subscription has arrived, so no result is published before a peer listens).
Socket addresses are exchanged once with ``torch.distributed`` broadcasts of bytes
(:func:`broadcast_bytes`, also used by the coordinator link). For a handful of integers only.
"""

from __future__ import annotations

import asyncio
import struct
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_core.inference._zmq import LOOPBACK, pack, unpack, zmq_module

__all__ = ["AsyncZMQCommunicator", "broadcast_bytes"]

_POLL_S = 0.001
_SUBSCRIBE_TIMEOUT_S = 60.0


def broadcast_bytes(data: bytes | None, group: Any) -> bytes:
    """``data`` from the first rank of ``group`` to all its ranks: a length, then a uint8 tensor (never pickled)."""
    src = dist.get_process_group_ranks(group)[0]
    device = torch.device("cpu")
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    is_src = dist.get_rank() == src
    length = torch.tensor([len(data) if is_src and data else 0], dtype=torch.int64, device=device)
    dist.broadcast(length, src, group=group)
    n = int(length.item())
    if n == 0:
        return b""
    if is_src:
        buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
    else:
        buffer = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src, group=group)
    return buffer.cpu().numpy().tobytes()


class AsyncZMQCommunicator:
    """Element-wise max all-reduce of a few ints over ``process_group`` (``None``: the world), via ZMQ."""

    def __init__(self, zmq_context: Any, process_group: Any = None, hostname: str | None = None) -> None:
        zmq = zmq_module()
        group = process_group if process_group is not None else dist.group.WORLD
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.is_leader = self.rank == 0
        self.gather_sock: Any = None
        self.bcast_sock: Any = None
        if self.world_size == 1:
            return
        host = hostname or LOOPBACK
        addresses = None
        if self.is_leader:
            self.gather_sock = zmq_context.socket(zmq.PULL)
            self.gather_sock.bind_to_random_port(f"tcp://{host}")
            self.bcast_sock = zmq_context.socket(zmq.XPUB)
            self.bcast_sock.bind_to_random_port(f"tcp://{host}")
            addresses = pack([self.gather_sock.getsockopt_string(zmq.LAST_ENDPOINT),
                              self.bcast_sock.getsockopt_string(zmq.LAST_ENDPOINT)])
        gather_addr, bcast_addr = unpack(broadcast_bytes(addresses, group))
        if self.is_leader:
            self._await_subscribers(self.world_size - 1)
        else:
            self.gather_sock = zmq_context.socket(zmq.PUSH)
            self.gather_sock.connect(gather_addr)
            self.bcast_sock = zmq_context.socket(zmq.SUB)
            self.bcast_sock.setsockopt_string(zmq.SUBSCRIBE, "")
            self.bcast_sock.connect(bcast_addr)

    def _await_subscribers(self, count: int) -> None:
        deadline = time.monotonic() + _SUBSCRIBE_TIMEOUT_S
        seen = 0
        while seen < count:
            remaining_ms = int(max(0.0, deadline - time.monotonic()) * 1000)
            if not self.bcast_sock.poll(remaining_ms):
                raise TimeoutError(f"AsyncZMQCommunicator: {seen} of {count} peers subscribed within "
                                   f"{_SUBSCRIBE_TIMEOUT_S} s")
            if self.bcast_sock.recv()[:1] == b"\x01":  # a subscription (b"\x00" would be an unsubscription)
                seen += 1

    @staticmethod
    def _result(values: tuple[int, ...]) -> int | tuple[int, ...]:
        return values[0] if len(values) == 1 else values

    def _leader_reduce(self, rows: list[tuple[int, ...]], fmt: str) -> tuple[int, ...]:
        maxes = tuple(max(column) for column in zip(*rows))
        self.bcast_sock.send(struct.pack(fmt, *maxes))
        return maxes

    async def all_reduce_max(self, *local_vals: int, async_op: bool = True) -> int | tuple[int, ...]:
        """The element-wise max of ``local_vals`` over the group (one int back for one int in).

        With ``async_op`` the waits poll the sockets and sleep on the event loop; without it they block
        (for callers that want no other coroutine to run meanwhile).
        """
        zmq = zmq_module()
        if not local_vals:
            raise ValueError("all_reduce_max needs at least one value")
        if self.world_size == 1:
            return self._result(tuple(local_vals))
        fmt = f"!{len(local_vals)}i"
        flags = zmq.NOBLOCK if async_op else 0
        if self.is_leader:
            rows = [tuple(local_vals)]
            while len(rows) < self.world_size:
                try:
                    rows.append(struct.unpack(fmt, self.gather_sock.recv(flags=flags)))
                except zmq.Again:
                    await asyncio.sleep(_POLL_S)
            result = self._leader_reduce(rows, fmt)
        else:
            self.gather_sock.send(struct.pack(fmt, *local_vals))
            while True:
                try:
                    result = struct.unpack(fmt, self.bcast_sock.recv(flags=flags))
                    break
                except zmq.Again:
                    await asyncio.sleep(_POLL_S)
        if not async_op:
            await asyncio.sleep(0)
        return self._result(result)

    def sync_all_reduce_max(self, *local_vals: int) -> int | tuple[int, ...]:
        """:meth:`all_reduce_max` with blocking sends and receives, for code outside the event loop."""
        if not local_vals:
            raise ValueError("sync_all_reduce_max needs at least one value")
        if self.world_size == 1:
            return self._result(tuple(local_vals))
        fmt = f"!{len(local_vals)}i"
        if self.is_leader:
            rows = [tuple(local_vals)]
            while len(rows) < self.world_size:
                rows.append(struct.unpack(fmt, self.gather_sock.recv()))
            return self._result(self._leader_reduce(rows, fmt))
        self.gather_sock.send(struct.pack(fmt, *local_vals))
        return self._result(struct.unpack(fmt, self.bcast_sock.recv()))

    def close(self) -> None:
        """Close both sockets at once (queued messages are dropped)."""
        for sock in (self.gather_sock, self.bcast_sock):
            if sock is not None:
                sock.close(linger=0)
