"""asyncio Transports over RDMA: ``RDMATransport`` (made by ``rdma_server.py``'s
``create_connection``/``create_server``).

Existing ``asyncio.Protocol`` / ``asyncio.BufferedProtocol`` code runs unchanged. The
callback grammar is asyncio's (Lib/asyncio/protocols.py)::

    start -> connection_made
        [-> data_received *]                       (Protocol)
        [-> (get_buffer -> buffer_updated) *]      (BufferedProtocol)
        [-> eof_received ?]
    -> connection_lost -> end

with ``pause_writing``/``resume_writing`` pairs anywhere between ``connection_made`` and
``connection_lost``. ``connection_lost`` is called exactly once, from its own loop
callback: with ``None`` after ``close()`` (everything written was delivered first),
``abort()``, or the EOF-close below; with the exception otherwise.

Mapping onto one ``Endpoint`` (a reliable, message-oriented RDMA connection):

* Byte stream, like TCP: ``write()`` never blocks or awaits; it queues the bytes, and
  small writes are coalesced into messages of at most ``write_chunk_size`` bytes (one
  ``Endpoint.send`` each, at most ``_MAX_INFLIGHT`` in flight). The default chunk is the
  endpoint's ``eager_payload`` (16 KiB - 8 by default): such messages travel in one SEND
  and are held back by receive credits alone, without a rendezvous' extra round trips.
  The reader gets ``data_received`` chunks; message boundaries are not promised.
* Write flow control is asyncio's ``_FlowControlMixin`` (``flow_control.py``), thresholds
  and texts included:
  the write buffer size is the bytes still queued plus the bytes handed to the endpoint
  and not yet delivered (waiting for receive credits, or posted and not completed).
  ``pause_writing`` above the high-water mark, ``resume_writing`` at or below the low.
* ``pause_reading`` stops consuming messages, so the endpoint stops returning receive
  credits and the peer's sends wait: the peer's write buffer grows until its protocol
  is paused. Nothing is lost. A message that arrives while a receive was already
  posted is held until ``resume_reading`` (like asyncio's proactor transport).
* ``write_eof`` -> ``Endpoint.send_eof()`` once everything queued is delivered; the
  peer's transport calls ``eof_received()``. If that returns a false value the peer
  transport closes itself; a true value keeps it open for writing.
* ``close`` flushes, closes the endpoint gracefully (the peer gets EOF), then
  ``connection_lost(None)``; ``abort`` drops what is queued, aborts the endpoint (the
  peer gets ``connection_lost(ConnectionClosed)``), then ``connection_lost(None)``.
* Failures take ONE path, as in selector_events.py: ``_fatal_error`` (an exception from
  a protocol callback, a failed send or receive, the peer gone) -> ``_force_close`` ->
  ``call_soon(_call_connection_lost, exc)``.

``get_extra_info``: ``peername``/``sockname`` (addresses of the connection-setup TCP
connection), ``device``, ``provider``, ``qp_num``, ``peer_qp_num``, ``endpoint``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from typing import Any, Protocol

from .endpoint import Endpoint
from .errors import ConnectionClosed, MessageTooLarge
from .flow_control import WriteFlowControl

log = logging.getLogger("aiordma")

_MAX_INFLIGHT = 16  # Endpoint.send calls in flight per transport
_LOG_THRESHOLD_FOR_CONNLOST_WRITES = 5  # asyncio.constants


class ServerPort(Protocol):
    """What a transport tells the server that accepted it (``RDMAServer``): it is
    attached when made, detached when its connection is lost."""

    def _attach(self, transport: RDMATransport) -> None: ...

    def _detach(self, transport: RDMATransport) -> None: ...


def _set_result_unless_cancelled(fut: asyncio.Future[None]) -> None:
    if not fut.cancelled():
        fut.set_result(None)


class RDMATransport(WriteFlowControl):
    """An ``asyncio.Transport`` over one ``Endpoint`` (see the module docstring).

    Made by ``create_connection``/``create_server``; not meant to be built directly.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, endpoint: Endpoint,
                 protocol: asyncio.BaseProtocol, *, waiter: asyncio.Future[None] | None = None,
                 server: ServerPort | None = None,
                 write_chunk_size: int | None = None) -> None:
        self._loop = loop
        self._protocol: Any = None
        super().__init__({
            "peername": endpoint.peer_address, "sockname": endpoint.local_address,
            "device": endpoint.device_name, "provider": endpoint.provider,
            "qp_num": endpoint.qp_num, "peer_qp_num": endpoint.peer_qp_num,
            "endpoint": endpoint,
        })
        if write_chunk_size is None:
            write_chunk_size = endpoint.eager_payload
        if not 1 <= write_chunk_size <= endpoint.max_message_size:
            raise ValueError(f"write_chunk_size must be in [1, {endpoint.max_message_size}]")
        self._ep = endpoint
        self._server = server
        self._chunk = write_chunk_size
        self._buffered = False
        self.set_protocol(protocol)
        self._closing = False  # close() called, or force-closed
        self._conn_lost = 0  # set when connection_lost is scheduled
        self._ignored_writes = 0
        self._eof = False  # write_eof() called
        self._paused = False  # pause_reading() called
        self._resume: asyncio.Future[None] | None = None
        self._chunks: collections.deque[bytearray | memoryview] = collections.deque()
        self._queued = 0  # bytes in _chunks
        self._sends: dict[asyncio.Task[None], int] = {}  # Endpoint.send in flight -> bytes
        self._inflight = 0
        self._flush_handle: asyncio.Handle | None = None
        self._read_task: asyncio.Task[None] | None = None
        self._close_task: asyncio.Task[None] | None = None
        self._eof_task: asyncio.Task[None] | None = None
        self._lost: asyncio.Future[None] = loop.create_future()
        if server is not None:
            server._attach(self)
        loop.call_soon(protocol.connection_made, self)
        loop.call_soon(self._start_reading)  # only after connection_made
        if waiter is not None:
            loop.call_soon(_set_result_unless_cancelled, waiter)

    def __repr__(self) -> str:
        info = [f"qp={self._ep.qp_num}->{self._ep.peer_qp_num}"]
        if self._conn_lost:
            info.append("closed")
        elif self._closing:
            info.append("closing")
        info.append("read=paused" if self._paused else "read=on")
        info.append(f"bufsize={self.get_write_buffer_size()}")
        return f"<RDMATransport {' '.join(info)}>"

    # ------------------------------------------------------------------ protocol
    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self._protocol = protocol
        self._buffered = isinstance(protocol, asyncio.BufferedProtocol)

    def get_protocol(self) -> asyncio.BaseProtocol:
        proto: asyncio.BaseProtocol = self._protocol
        return proto

    def is_closing(self) -> bool:
        return self._closing

    # ------------------------------------------------------------------ reading
    def is_reading(self) -> bool:
        return not self._closing and not self._paused

    def pause_reading(self) -> None:
        """No ``data_received`` until ``resume_reading``; the peer is held back by
        receive credits. Idempotent; ignored while closing."""
        if not self.is_reading():
            return
        self._paused = True
        if self._loop.get_debug():
            log.debug("%r pauses reading", self)

    def resume_reading(self) -> None:
        if self._closing or not self._paused:
            return
        self._paused = False
        if self._resume is not None and not self._resume.done():
            self._resume.set_result(None)
        if self._loop.get_debug():
            log.debug("%r resumes reading", self)

    def _reading(self) -> bool:
        return not self._closing and not self._conn_lost

    def _start_reading(self) -> None:
        if self._reading():
            self._read_task = self._loop.create_task(self._read_loop())

    def _stop_reading(self) -> None:
        task = self._read_task
        if task is not None and not task.done() and task is not asyncio.current_task(self._loop):
            task.cancel()  # a cancelled receive never loses a message (Endpoint contract)

    async def _wait_resumed(self) -> None:
        while self._paused and self._reading():
            self._resume = self._loop.create_future()
            await self._resume

    async def _read_loop(self) -> None:
        """Deliver messages to the protocol until EOF, close or failure."""
        ep = self._ep
        try:
            while self._reading():
                if self._paused:
                    await self._wait_resumed()
                elif self._buffered:
                    await self._read_buffered()
                else:
                    data = await ep.recv()
                    await self._wait_resumed()  # arrived after an outside pause_reading()
                    if data and self._reading():
                        self._call_protocol("data_received", data)
        except _Failed:
            return  # a protocol callback raised: _fatal_error has run
        except ConnectionClosed as exc:
            await self._wait_resumed()  # like TCP, EOF is noticed only while reading
            if not self._reading():
                return
            if ep.closed:  # failed or aborted, not a graceful EOF from the peer
                self._fatal_error(exc, "Fatal read error on RDMA transport")
            else:
                self._on_eof()
        except asyncio.CancelledError:
            if self._reading():
                raise  # not our own _stop_reading(): e.g. the loop is shutting down
        except Exception as exc:
            if self._reading():
                self._fatal_error(exc, "Fatal read error on RDMA transport")

    def _call_protocol(self, name: str, *args: Any) -> Any:
        """Call a protocol method and return its result; if it raises, the exception
        goes down the one fatal-error path and _Failed is raised to unwind the reader."""
        try:
            return getattr(self._protocol, name)(*args)
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            self._fatal_error(exc, f"Fatal error: protocol.{name}() call failed.")
            raise _Failed from None

    async def _read_buffered(self) -> None:
        """One receive for a BufferedProtocol: straight into its buffer when the message
        fits, else into bytes copied over in as many get_buffer/buffer_updated rounds
        as the buffers it offers need."""
        ep = self._ep
        try:
            buf = self._get_buffer(-1)
            try:
                n = await ep.recv_into(buf)
            except MessageTooLarge:
                data = await ep.recv()
                await self._wait_resumed()
                await self._feed_buffered(data)
                return
            await self._wait_resumed()
            if n and self._reading():
                self._call_protocol("buffer_updated", n)
        except _Failed:
            pass

    def _get_buffer(self, sizehint: int) -> memoryview:
        buf = self._call_protocol("get_buffer", sizehint)
        try:
            mv = memoryview(buf)
            if mv.ndim != 1 or mv.format != "B":
                mv = mv.cast("B")
            if not mv.nbytes:
                raise RuntimeError("get_buffer() returned an empty buffer")
            if mv.readonly:
                raise TypeError("get_buffer() returned a read-only buffer")
        except (TypeError, RuntimeError, ValueError) as exc:
            self._fatal_error(exc, "Fatal error: protocol.get_buffer() call failed.")
            raise _Failed from None
        return mv

    async def _feed_buffered(self, data: bytes) -> None:
        src = memoryview(data)
        while src and self._reading():
            await self._wait_resumed()
            if not self._reading():
                return
            dst = self._get_buffer(src.nbytes)
            k = min(dst.nbytes, src.nbytes)
            dst[:k] = src[:k]
            src = src[k:]
            self._call_protocol("buffer_updated", k)

    def _on_eof(self) -> None:
        if self._loop.get_debug():
            log.debug("%r received EOF", self)
        try:
            keep_open = self._call_protocol("eof_received")
        except _Failed:
            return
        if not keep_open:
            self.close()
        # else: nothing more to read; the transport stays open for writing

    # ------------------------------------------------------------------ writing
    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Queue ``data``; never blocks. Raises TypeError for a non-bytes-like object,
        RuntimeError after ``write_eof()``. After ``close()``/``abort()`` or a failure
        the data is dropped (a warning is logged from the fifth such write on)."""
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise TypeError(f"data argument must be a bytes-like object, "
                            f"not {type(data).__name__!r}")
        if self._eof:
            raise RuntimeError("Cannot call write() after write_eof()")
        if not data:
            return
        if self._closing or self._conn_lost:
            if self._ignored_writes >= _LOG_THRESHOLD_FOR_CONNLOST_WRITES:
                log.warning("RDMATransport.write() on a closed transport: data dropped")
            self._ignored_writes += 1
            return
        self._enqueue(data)
        self._maybe_pause_protocol()
        if self._flush_handle is None:
            self._flush_handle = self._loop.call_soon(self._flush)

    def _enqueue(self, data: bytes | bytearray | memoryview) -> None:
        """Cut ``data`` into messages of at most ``_chunk`` bytes: slices of an immutable
        ``bytes`` as they are; anything else copied, appended to the last queued
        message while it has room (coalescing small writes)."""
        mv = memoryview(data)
        if mv.ndim != 1 or mv.format != "B":
            mv = mv.cast("B")
        n = mv.nbytes
        chunk = self._chunk
        chunks = self._chunks
        if isinstance(data, bytes) and n >= chunk:
            for off in range(0, n, chunk):
                chunks.append(mv[off: off + chunk])
        else:
            off = 0
            if chunks:
                tail = chunks[-1]
                if isinstance(tail, bytearray) and len(tail) < chunk:
                    off = min(chunk - len(tail), n)
                    tail += mv[:off]
            while off < n:
                chunks.append(bytearray(mv[off: off + chunk]))
                off += chunk
        self._queued += n

    def _flush(self) -> None:
        """Hand queued messages to the endpoint, at most _MAX_INFLIGHT at a time."""
        self._flush_handle = None
        chunks = self._chunks
        while chunks and len(self._sends) < _MAX_INFLIGHT and not self._conn_lost:
            data = chunks.popleft()
            n = len(data)
            self._queued -= n
            self._inflight += n
            # Tasks start in creation order, and Endpoint.send queues at its first
            # step: messages go out in write() order.
            task = self._loop.create_task(self._ep.send(data))
            self._sends[task] = n
            task.add_done_callback(self._on_sent)

    def _on_sent(self, task: asyncio.Task[None]) -> None:
        self._inflight -= self._sends.pop(task, 0)
        exc = None if task.cancelled() else task.exception()
        if self._conn_lost:
            return
        if exc is not None:
            self._fatal_error(exc, "Fatal write error on RDMA transport")
            return
        self._maybe_resume_protocol()  # may write more
        self._flush()
        if not self._chunks and not self._sends:
            if self._closing:
                self._start_close()
            elif self._eof:
                self._start_eof()

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        """Half-close: the peer gets ``eof_received()`` after everything written so
        far; reading goes on. Idempotent; ignored while closing."""
        if self._closing or self._eof:
            return
        self._eof = True
        if not self._chunks and not self._sends:
            self._start_eof()

    def _start_eof(self) -> None:
        if self._eof_task is None and not self._conn_lost:
            self._eof_task = self._loop.create_task(self._ep.send_eof())
            self._eof_task.add_done_callback(self._on_eof_sent)

    def _on_eof_sent(self, task: asyncio.Task[None]) -> None:
        exc = None if task.cancelled() else task.exception()
        # While closing, close() reports (it sends the EOF itself if still needed).
        if exc is not None and not self._closing and not self._conn_lost:
            self._fatal_error(exc, "Fatal error on RDMA transport: write_eof() failed")

    # ------------------------------------------------------------------ flow control
    # asyncio.transports._FlowControlMixin, kept word for word where it counts.
    def get_write_buffer_size(self) -> int:
        """Bytes queued plus bytes handed to the endpoint and not yet delivered."""
        return self._queued + self._inflight

    # ------------------------------------------------------------------ closing
    def close(self) -> None:
        """Stop reading; deliver everything queued; close the endpoint gracefully (the
        peer gets EOF); then ``connection_lost(None)``. Idempotent."""
        if self._closing:
            return
        self._closing = True
        self._stop_reading()
        if not self._chunks and not self._sends:
            self._start_close()

    def _start_close(self) -> None:
        if self._close_task is None and not self._conn_lost:
            self._close_task = self._loop.create_task(self._close_endpoint())

    async def _close_endpoint(self) -> None:
        try:
            await self._ep.close()
        except Exception as exc:  # not expected: Endpoint.close() reports nothing
            self._fatal_error(exc, "Fatal error on RDMA transport: close failed")
            return
        if self._conn_lost:
            return
        self._conn_lost += 1
        self._loop.call_soon(self._call_connection_lost, None)

    def abort(self) -> None:
        """Drop what is queued, abort the endpoint, then ``connection_lost(None)``.
        Idempotent."""
        self._force_close(None)

    def _fatal_error(self, exc: BaseException, message: str = "Fatal error on transport") -> None:
        if isinstance(exc, OSError):
            if self._loop.get_debug():
                log.debug("%r: %s", self, message, exc_info=True)
        else:
            self._loop.call_exception_handler({
                "message": message,
                "exception": exc,
                "transport": self,
                "protocol": self._protocol,
            })
        self._force_close(exc)

    def _force_close(self, exc: BaseException | None) -> None:
        if self._conn_lost:
            return
        self._chunks.clear()
        self._queued = 0
        self._sends.clear()  # they fail with ConnectionClosed once the endpoint aborts
        self._inflight = 0
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        self._closing = True
        self._stop_reading()
        self._conn_lost += 1
        self._ep.abort()
        self._loop.call_soon(self._call_connection_lost, exc)

    def _call_connection_lost(self, exc: BaseException | None) -> None:
        try:
            self._protocol.connection_lost(exc)
        finally:
            if not self._ep.closed:
                self._ep.abort()
            self._protocol = None
            if self._resume is not None and not self._resume.done():
                self._resume.set_result(None)
            if not self._lost.done():
                self._lost.set_result(None)
            server, self._server = self._server, None
            if server is not None:
                server._detach(self)

    async def _wait_lost(self) -> None:
        """Wait until ``connection_lost`` has been called."""
        await asyncio.shield(self._lost)


class _Failed(Exception):
    """A protocol callback raised; ``_fatal_error`` has handled it."""
