"""The aiordma side of the benchmark: the same tests over ``aiordma.Endpoint``.

* ``send_lat``   -- client ``send(size)`` + ``recv_into``; the server echoes (recv_into,
  send). One round trip of two messages.
* ``write_lat``  -- ``await ep.write(size)``: data to the target, acknowledgement back
  (the target's application does nothing).
* ``read_lat``   -- ``await ep.read(size)``: request to the target, data back.
* ``atomic_lat`` -- ``await ep.fetch_add(8 bytes)``.
* ``send_bw`` / ``msg_rate`` -- ``window`` tasks each awaiting ``send``; the server
  receives with ``recv_into`` into a registered buffer (large messages by zero-copy
  rendezvous); ends when the server has received every message. With ``--rate-api
  many``, msg_rate's client calls ``send_many`` with ``window // 2`` messages a call,
  two calls in flight.
* ``write_bw`` / ``read_bw`` -- ``window`` tasks each awaiting ``write``/``read``
  (one-sided: ends with the last completion).

Half the round trip is what perftest prints for send_lat/write_lat; here every
latency is the full round trip, as for the socket ping-pong it is compared with.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiordma

from .common import Config, batched, bounded, windowed


def _opts(cfg: Config) -> dict[str, Any]:
    o: dict[str, Any] = {"max_message_size": max(max(cfg.sizes), 16 * 1024)}
    if cfg.provider:
        o["provider"] = cfg.provider
    if cfg.device:
        o["device"] = cfg.device
    if cfg.poll_mode:
        o["poll_mode"] = cfg.poll_mode
    if cfg.spin_us is not None:
        o["spin_us"] = cfg.spin_us
    return o


def _region_size(cfg: Config) -> int:
    return max(8, (max(cfg.sizes) + 7) // 8 * 8)


class RdmaServer:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.ep: aiordma.Endpoint | None = None
        self._ep_fut: asyncio.Future[aiordma.Endpoint] | None = None
        self.listener: aiordma.Listener | None = None
        self.buf = bytearray(_region_size(cfg))
        self.rbuf = bytearray(_region_size(cfg))
        self.mr: aiordma.MemoryRegion | None = None
        self.rmr: aiordma.MemoryRegion | None = None
        self.received = 0
        self.target = -1
        self.reached: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    async def start(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self._ep_fut = loop.create_future()

        async def handler(ep: aiordma.Endpoint) -> None:
            self.mr = ep.register(self.buf, remote_read=True, remote_write=True,
                                  remote_atomic=True)
            # remote_read: the echo of a large message goes by zero-copy rendezvous
            self.rmr = ep.register(self.rbuf, remote_read=True)
            self.ep = ep
            if not self._ep_fut.done():  # type: ignore[union-attr]
                self._ep_fut.set_result(ep)  # type: ignore[union-attr]
            await self._stop.wait()

        self.listener = await aiordma.listen(handler, "127.0.0.1", 0, **_opts(self.cfg))
        return {"host": "127.0.0.1", "port": self.listener.port}

    async def begin(self, test: str, size: int, window: int, timeout: float) -> dict[str, Any]:
        assert self._ep_fut is not None
        ep = await bounded(asyncio.shield(self._ep_fut), timeout, "the aiordma connection")
        assert self.mr is not None
        self.received = 0
        loop = asyncio.get_running_loop()
        if test == "send_lat":
            self._task = loop.create_task(self._echo(ep, size))
        elif test in ("send_bw", "msg_rate"):
            self._task = loop.create_task(self._sink(ep))
        return {"remote": self.mr.remote().pack().hex()}

    async def _echo(self, ep: aiordma.Endpoint, size: int) -> None:
        view = memoryview(self.rbuf)
        while True:
            n = await ep.recv_into(view)
            await ep.send(view[:n])
            self._count()

    async def _sink(self, ep: aiordma.Endpoint) -> None:
        view = memoryview(self.rbuf)
        while True:
            await ep.recv_into(view)
            self._count()

    def _count(self) -> None:
        self.received += 1
        if self.reached is not None and self.received >= self.target \
                and not self.reached.done():
            self.reached.set_result(None)

    async def _wait_received(self, n: int, timeout: float) -> None:
        if self.received >= n:
            return
        self.target = n
        self.reached = asyncio.get_running_loop().create_future()
        try:
            await bounded(self.reached, timeout, f"server receiving {n} messages")
        except TimeoutError:
            ep = self.ep
            if ep is not None:
                import sys
                print(f"bench server: stuck at {self.received} of {n}: {ep.statistics()} "
                      f"task={self._task}", file=sys.stderr, flush=True)
            raise
        self.reached = None

    async def mark(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        if self._task is not None:
            await self._wait_received(sent_msgs, timeout)
        self.received = 0

    async def end(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        if self._task is not None:
            await self._wait_received(sent_msgs, timeout)
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    def statistics(self) -> dict[str, Any]:
        return self.ep.statistics() if self.ep is not None else {}

    async def close(self) -> None:
        # The client said quit and closes its side: nothing is pending here, and nothing
        # after the last round trip is measured, so abort rather than close gracefully.
        if self.ep is not None:
            self.ep.abort()
        self._stop.set()
        if self.listener is not None:
            self.listener.close()
            await asyncio.wait_for(self.listener.wait_closed(), 10)


class RdmaClient:
    def __init__(self, cfg: Config, info: dict[str, Any]) -> None:
        self.cfg = cfg
        self.info = info
        self.ep: aiordma.Endpoint | None = None
        self.sbuf = bytearray(_region_size(cfg))
        self.rbuf = bytearray(_region_size(cfg))
        self.smr: aiordma.MemoryRegion | None = None
        self.regions: list[aiordma.MemoryRegion] = []
        self.api = ""  # the Endpoint call the last stream() sent with (Result.extra)

    async def connect(self) -> None:
        self.ep = await aiordma.connect(self.info["host"], self.info["port"], timeout=30,
                                        **_opts(self.cfg))
        # remote_read: large sends go by zero-copy rendezvous from this buffer
        self.smr = self.ep.register(self.sbuf, remote_read=True)
        self.regions.append(self.smr)
        self.regions.append(self.ep.register(self.rbuf))

    def _local(self, size: int) -> aiordma.MemoryRegion:
        """A region of exactly ``size`` bytes (one-sided ops take the whole region)."""
        assert self.ep is not None
        mr = self.ep.register(bytearray(size))
        self.regions.append(mr)
        return mr

    def lat_op(self, test: str, size: int, info: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        ep = self.ep
        assert ep is not None
        remote = aiordma.RemoteBuffer.unpack(bytes.fromhex(info["remote"])).slice(0, size)
        if test == "send_lat":
            out = memoryview(self.sbuf)[:size]
            into = memoryview(self.rbuf)
            send, recv_into = ep.send, ep.recv_into

            async def pingpong() -> None:
                await send(out)
                await recv_into(into)
            return pingpong
        if test == "write_lat":
            mr = self._local(size)
            write = ep.write
            return lambda: write(mr, remote)
        if test == "read_lat":
            mr = self._local(size)
            read = ep.read
            return lambda: read(mr, remote)
        if test == "atomic_lat":
            fetch_add = ep.fetch_add
            r8 = remote.slice(0, 8)
            return lambda: fetch_add(r8, 1)
        raise ValueError(test)

    async def stream(self, test: str, size: int, count: int, window: int, max_seconds: float,
                     info: dict[str, Any]) -> int:
        ep = self.ep
        assert ep is not None
        remote = aiordma.RemoteBuffer.unpack(bytes.fromhex(info["remote"])).slice(0, size)
        op: Callable[[], Awaitable[Any]]
        if test == "msg_rate" and self.cfg.rate_api == "many":
            out = memoryview(self.sbuf)[:size]
            self.api = "send_many"
            ops, _secs = await batched(ep.send_many, out, count, max(1, window // 2), 2,
                                       max_seconds)
            return ops
        self.api = "send"
        if test in ("send_bw", "msg_rate"):
            out = memoryview(self.sbuf)[:size]
            send = ep.send
            op = lambda: send(out)  # noqa: E731
        elif test == "write_bw":
            mr = self._local(size)
            write = ep.write
            op = lambda: write(mr, remote)  # noqa: E731
        elif test == "read_bw":
            mr = self._local(size)
            read = ep.read
            op = lambda: read(mr, remote)  # noqa: E731
        else:
            raise ValueError(test)
        ops, _secs = await windowed(op, count, window, max_seconds)
        return ops

    def end_test(self) -> None:
        keep = {id(self.smr)}
        for mr in self.regions[2:]:
            if id(mr) not in keep:
                mr.close()
        del self.regions[2:]

    def statistics(self) -> dict[str, Any]:
        return self.ep.statistics() if self.ep is not None else {}

    async def close(self) -> None:
        if self.ep is not None:
            await asyncio.wait_for(self.ep.close(), 15)
