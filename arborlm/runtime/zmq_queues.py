"""Typed ZeroMQ queues: PUSH / PULL sockets that carry only `messages.Message` members.

`PushQueue.put` encodes a message with `messages.encode` (anything else is a TypeError) and
`PullQueue.get` / `AsyncPullQueue.get` decode it back, so no socket carries an untyped object.
A PUSH/PULL pair keeps order; with one producer and one consumer per address (the engine's
layout) nothing is dropped while both ends are open.

Sockets use the process-wide ZeroMQ context, close with `linger=0` by default (unsent messages
are dropped rather than blocking shutdown; a process that must get its last messages out closes
with a linger, then calls `terminate_context()`, which waits for them), and have a high-water
mark of `DEFAULT_HWM` messages per side: past it `put` blocks, which is back-pressure, not loss.
Addresses come from `arborlm.runtime.ipc.IpcAddresses`. This module knows nothing of what the
messages mean.
"""

from __future__ import annotations

import math

import zmq
import zmq.asyncio

from arborlm.runtime.messages import Message, decode, encode

DEFAULT_HWM = 100_000


def _open(ctx: zmq.Context, kind: int, addr: str, bind: bool, hwm: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, hwm)
    try:
        if bind:
            sock.bind(addr)
        else:
            sock.connect(addr)
    except zmq.ZMQError:
        sock.close(linger=0)
        raise
    return sock


def terminate_context() -> None:
    """Terminate the process-wide context once every queue is closed: returns when lingering
    messages are delivered or their linger time has run out. For a process about to exit."""
    zmq.Context.instance().term()


class _Queue:
    _sock: zmq.Socket

    @property
    def closed(self) -> bool:
        return self._sock.closed

    def close(self, linger_s: float = 0.0) -> None:
        """Close the socket, dropping anything not delivered within `linger_s` seconds (by
        default at once); safe to call twice."""
        if not self._sock.closed:
            self._sock.close(linger=int(linger_s * 1000))

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PushQueue(_Queue):
    """Sending end: `put(msg)` for `Message` members only."""

    def __init__(self, addr: str, bind: bool, *, hwm: int = DEFAULT_HWM):
        self.addr = addr
        self._sock = _open(zmq.Context.instance(), zmq.PUSH, addr, bind, hwm)

    def put(self, msg: Message) -> None:
        """Send one message; blocks only while the high-water mark is reached."""
        self._sock.send(encode(msg))


class PullQueue(_Queue):
    """Receiving end for blocking code (scheduler, detokenizer)."""

    def __init__(self, addr: str, bind: bool, *, hwm: int = DEFAULT_HWM):
        self.addr = addr
        self._sock = _open(zmq.Context.instance(), zmq.PULL, addr, bind, hwm)

    def get(self, timeout: float | None = None) -> Message | None:
        """Next message; waits at most `timeout` seconds (forever if None), then None."""
        if timeout is not None and not self._sock.poll(max(0, math.ceil(timeout * 1000))):
            return None
        return decode(self._sock.recv())

    def get_nowait_all(self) -> list[Message]:
        """Every message already received, in order; never blocks."""
        out: list[Message] = []
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            out.append(decode(data))


class AsyncPullQueue(_Queue):
    """Receiving end for asyncio code (the tokenizer manager)."""

    def __init__(self, addr: str, bind: bool, *, hwm: int = DEFAULT_HWM):
        self.addr = addr
        ctx = zmq.asyncio.Context.shadow(zmq.Context.instance())
        self._sock = _open(ctx, zmq.PULL, addr, bind, hwm)

    async def get(self) -> Message:
        """Next message, awaiting it as long as needed (cancel the task to stop waiting)."""
        return decode(await self._sock.recv())
