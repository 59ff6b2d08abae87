"""The socket baselines: asyncio TCP and Unix-socket ping-pong and streaming, with the
Protocol API (``tcp-proto``, ``unix-proto``) and the streams API (``tcp-streams``,
``unix-streams``), on the same event loop as the aiordma run.

Each test uses the socket pattern of ``common.PATTERN`` with the same sizes and counts
as the aiordma test it is compared with:

* ``echo``   -- client writes ``size`` bytes, server writes ``size`` back (send_lat, atomic_lat)
* ``ack``    -- client writes ``size`` bytes, server answers 1 byte (write_lat)
* ``fetch``  -- client writes 1 byte, server answers ``size`` bytes (read_lat)
* ``sink``   -- client streams ``size``-byte writes (TCP's own flow control is the
  window), the server counts bytes; the test ends when the server has them all
  (send_bw, write_bw, msg_rate)
* ``source`` -- client keeps ``window`` 1-byte requests outstanding, the server answers
  each with ``size`` bytes (read_bw)

No framing: both sides know the sizes from the control channel, like netperf's TCP_RR
and TCP_STREAM.
"""

from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .common import PATTERN, bounded

READ_CHUNK = 256 * 1024


def _nodelay(transport: asyncio.BaseTransport) -> None:
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


# ======================================================================= server side
class _ServerProto(asyncio.Protocol):
    """The Protocol-API server: reacts to bytes according to the current pattern."""

    def __init__(self, owner: SocketServer) -> None:
        self.owner = owner
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)
        self.transport = transport  # type: ignore[assignment]  # uvloop's is no subclass
        self.owner._connected(self)

    def data_received(self, data: bytes) -> None:
        o = self.owner
        n = len(data)
        o.received += n
        pat = o.pattern
        t = self.transport
        assert t is not None
        if pat == "sink":
            o._check_target()
            return
        if pat == "echo" or pat == "ack":
            o.pending += n
            k, o.pending = divmod(o.pending, o.size)
        else:  # fetch / source: every byte is a request
            k = n
        if k == 1:
            t.write(o.resp)
        elif k:
            t.writelines([o.resp] * k)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.transport = None


class SocketServer:
    """Server half of one socket baseline (``family`` tcp|unix, ``api`` proto|streams)."""

    def __init__(self, family: str, api: str) -> None:
        self.family = family
        self.api = api
        self.pattern = "sink"
        self.size = 1
        self.resp = b"\0"
        self.pending = 0
        self.received = 0
        self.target = -1
        self.reached: asyncio.Future[None] | None = None
        self._conn: asyncio.Future[Any] | None = None
        self._server: asyncio.AbstractServer | None = None
        self._task: asyncio.Task[None] | None = None
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._path: str | None = None

    async def start(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self._conn = loop.create_future()
        if self.api == "proto":
            def factory() -> asyncio.Protocol:
                return _ServerProto(self)
            if self.family == "tcp":
                self._server = await loop.create_server(factory, "127.0.0.1", 0)
            else:
                self._path = tempfile.mktemp(prefix="aiordma-bench-", suffix=".sock")
                self._server = await loop.create_unix_server(factory, self._path)
        else:
            if self.family == "tcp":
                self._server = await asyncio.start_server(self._on_stream, "127.0.0.1", 0,
                                                          limit=READ_CHUNK)
            else:
                self._path = tempfile.mktemp(prefix="aiordma-bench-", suffix=".sock")
                self._server = await asyncio.start_unix_server(self._on_stream, self._path,
                                                               limit=READ_CHUNK)
        if self.family == "tcp":
            return {"host": "127.0.0.1", "port": self._server.sockets[0].getsockname()[1]}
        return {"path": self._path}

    def _connected(self, proto: Any) -> None:
        if self._conn is not None and not self._conn.done():
            self._conn.set_result(proto)

    async def _on_stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        _nodelay(writer.transport)
        self._reader, self._writer = reader, writer
        self._connected((reader, writer))

    def _check_target(self) -> None:
        if self.reached is not None and self.received >= self.target and not self.reached.done():
            self.reached.set_result(None)

    async def _wait_received(self, nbytes: int, timeout: float) -> None:
        loop = asyncio.get_running_loop()
        self.target = nbytes
        self.reached = loop.create_future()
        self._check_target()
        await bounded(self.reached, timeout, f"server receiving {nbytes} bytes")
        self.reached = None

    # --- control ----------------------------------------------------------------------
    async def begin(self, test: str, size: int, window: int, timeout: float) -> dict[str, Any]:
        assert self._conn is not None
        await bounded(asyncio.shield(self._conn), timeout, "the data connection")
        pat = PATTERN[test]
        self.pattern, self.size = pat, size
        self.resp = b"\1" if pat == "ack" else bytes(size)
        self.pending = 0
        self.received = 0
        if self.api == "streams":
            self._task = asyncio.get_running_loop().create_task(self._stream_loop())
        return {}

    async def mark(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        if self.pattern == "sink":
            await self._wait_received(sent_bytes, timeout)
        self.received = 0

    async def end(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        if self.pattern == "sink":
            await self._wait_received(sent_bytes, timeout)
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
            self._task = None

    async def _stream_loop(self) -> None:
        r, w = self._reader, self._writer
        assert r is not None and w is not None
        pat, size, resp = self.pattern, self.size, self.resp
        if pat in ("echo", "ack"):
            while True:
                await r.readexactly(size)
                self.received += size
                w.write(resp)
                await w.drain()
        elif pat == "sink":
            while True:
                data = await r.read(READ_CHUNK)
                if not data:
                    return
                self.received += len(data)
                self._check_target()
        else:  # fetch / source
            while True:
                data = await r.read(READ_CHUNK)
                if not data:
                    return
                self.received += len(data)
                if len(data) == 1:
                    w.write(resp)
                else:
                    w.writelines([resp] * len(data))
                await w.drain()

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        if self._server is not None:
            self._server.close()
        if self._path:
            try:
                os.unlink(self._path)
            except OSError:
                pass


# ======================================================================= client side
class _ClientProto(asyncio.Protocol):
    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.received = 0
        self.need = 0
        self.fut: asyncio.Future[None] | None = None
        self.paused = False
        self.resume: asyncio.Future[None] | None = None
        self.on_data: Callable[[int], None] | None = None
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _nodelay(transport)
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        if self.on_data is not None:
            self.on_data(len(data))
        elif self.fut is not None and self.received >= self.need:
            fut, self.fut = self.fut, None
            if not fut.done():
                fut.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.resume is not None and not self.resume.done():
            self.resume.set_result(None)

    def connection_lost(self, exc: BaseException | None) -> None:
        for f in (self.fut, self.resume):
            if f is not None and not f.done():
                f.set_exception(ConnectionError("baseline connection lost"))
        if not self.lost.done():
            self.lost.set_result(None)


class SocketClient:
    def __init__(self, family: str, api: str, info: dict[str, Any]) -> None:
        self.family = family
        self.api = api
        self.info = info
        self.proto: _ClientProto | None = None
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        if self.api == "proto":
            if self.family == "tcp":
                _t, p = await loop.create_connection(_ClientProto, self.info["host"],
                                                     self.info["port"])
            else:
                _t, p = await loop.create_unix_connection(_ClientProto, self.info["path"])
            self.proto = p
        else:
            if self.family == "tcp":
                self.reader, self.writer = await asyncio.open_connection(
                    self.info["host"], self.info["port"], limit=READ_CHUNK)
            else:
                self.reader, self.writer = await asyncio.open_unix_connection(
                    self.info["path"], limit=READ_CHUNK)
            _nodelay(self.writer.transport)

    async def close(self) -> None:
        if self.proto is not None and self.proto.transport is not None:
            self.proto.transport.close()
        if self.writer is not None:
            self.writer.close()

    # --- ping-pong -----------------------------------------------------------------
    def lat_op(self, test: str, size: int) -> Callable[[], Awaitable[Any]]:
        pat = PATTERN[test]
        req = b"\0" if pat == "fetch" else bytes(size)
        rsize = 1 if pat == "ack" else size
        if self.api == "proto":
            p = self.proto
            assert p is not None and p.transport is not None
            t = p.transport
            loop = asyncio.get_running_loop()
            p.on_data = None

            async def op_proto() -> None:
                fut = loop.create_future()
                p.fut = fut
                p.need = p.received + rsize
                t.write(req)
                await fut
            return op_proto
        r, w = self.reader, self.writer
        assert r is not None and w is not None

        async def op_streams() -> None:
            w.write(req)
            await w.drain()
            await r.readexactly(rsize)
        return op_streams

    # --- streaming -----------------------------------------------------------------
    async def stream(self, test: str, size: int, count: int, window: int,
                     max_seconds: float) -> int:
        """Run ``count`` messages (or until ``max_seconds``); returns how many. For the
        sink pattern the caller then waits for the server to have received them."""
        if PATTERN[test] == "source":
            return await self._source(size, count, window, max_seconds)
        buf = bytes(size)
        deadline = time.perf_counter() + max_seconds
        clock = time.perf_counter
        n = 0
        if self.api == "proto":
            p = self.proto
            assert p is not None and p.transport is not None
            write = p.transport.write
            loop = asyncio.get_running_loop()
            while n < count:
                write(buf)
                n += 1
                if p.paused:
                    p.resume = loop.create_future()
                    await p.resume
                if clock() > deadline:
                    break
            return n
        w = self.writer
        assert w is not None
        while n < count:
            w.write(buf)
            await w.drain()
            n += 1
            if clock() > deadline:
                break
        return n

    async def _source(self, size: int, count: int, window: int, max_seconds: float) -> int:
        deadline = time.perf_counter() + max_seconds
        loop = asyncio.get_running_loop()
        if self.api == "proto":
            p = self.proto
            assert p is not None and p.transport is not None
            t = p.transport
            base = p.received
            done_fut: asyncio.Future[None] = loop.create_future()
            state = {"requested": min(window, count), "limit": count}

            def on_data(_n: int) -> None:
                done = (p.received - base) // size
                if time.perf_counter() > deadline:
                    state["limit"] = state["requested"]
                want = min(state["limit"], done + window)
                if want > state["requested"]:
                    t.write(bytes(want - state["requested"]))
                    state["requested"] = want
                if done >= state["requested"] and not done_fut.done():
                    done_fut.set_result(None)

            p.on_data = on_data
            t.write(bytes(state["requested"]))
            try:
                await done_fut
            finally:
                p.on_data = None
            return state["requested"]
        r, w = self.reader, self.writer
        assert r is not None and w is not None
        requested = min(window, count)
        w.write(bytes(requested))
        done = 0
        while done < requested:
            await r.readexactly(size)
            done += 1
            if requested < count and time.perf_counter() <= deadline:
                w.write(b"\0")
                requested += 1
        return done
