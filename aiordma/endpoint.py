"""``Endpoint``: a reliable, message-oriented RDMA connection (one RC QP) for asyncio.

The endpoint is the asyncio face of three parts, each with one reason to change:

* ``protocol.engine.MessageEngine`` -- the data path, sans-IO: state, credits, queues,
  frames, completions, rendezvous bookkeeping (``protocol/engine.pyx``: its sender and
  receiver);
* ``resources.Resources`` -- the verbs objects and buffers, and posting to them;
* ``lifecycle.Lifecycle`` -- the setup connection's watch, close, EOF, abort, teardown.

What is left here turns calls into queued operations and their futures, and waits;
the one-sided operations do so in ``onesided.OneSided``; a send that the engine does
not take in one call (an error, a cast, a rendezvous) is queued by
``sending.Sending``; a receive that finds no message waiting for it waits in
``receiving.Receiving``.

Messages: a message up to ``eager_size - 8`` bytes travels in one SEND (8-byte frame
header + payload); small messages queued in the same loop iteration share one SEND (a
BATCH frame, when the peer announced it understands them), one credit and one
completion, and are handed to the receiving application one by one. A larger one goes
by rendezvous: the sender SENDs a descriptor of a registered source (the user's own
region when the bytes lie in one registered for remote read, else a staging copy),
the receiver RDMA-READs it straight into the destination (``recv_into`` with a
registered buffer) or into staging, then sends RNDV_DONE, which completes the
sender's ``send()``.

Failure: the first error (a failed completion, a protocol violation, the peer gone)
moves the QP to ERR; every pending operation then fails with ``ConnectionClosed``
whose ``__cause__`` is that first error; an operation whose own completion carried an
access or length error raises that typed ``CompletionError``.
"""

from __future__ import annotations

import asyncio
import functools
import secrets
from collections.abc import Callable, Iterable
from typing import Any, Final, cast

from . import liveness
from .device import Device
from .errors import ConnectionClosed
from .lifecycle import Lifecycle, uncancelled
from .memory import MemoryRegion, RemoteBuffer
from .onesided import OneSided
from .options import EndpointOptions
from .protocol.engine import (
    HANDSHAKE_FLAG_BATCH,
    MessageEngine,
    Op,
)
from .protocol.handshake import Hello
from .protocol.heartbeat import HANDSHAKE_FLAG_LIVENESS
from .receiving import Receiving, writable_view
from .resources import Resources
from .sending import Sending
from .verbs import Access, AsyncEvent, EventType
from .waiters import future_kwargs, new_future

# Staging bytes read ahead while a receive is in progress (the engine's ``busy_ahead``),
# READs behind the receiver's own that keep the link busy meanwhile. Where CPU copies move
# a READ's bytes (``Context.reads_on_cpu``) none while the receiver READs straight into
# its own buffer (``direct_ahead`` 0): each staged message would cost the receiving CPU
# a copy in its receive's path for no overlap; a receive that needs staging anyway
# (``recv()``) still has the messages behind it read ahead.
_BUSY_READ_AHEAD: Final = 4 << 20


class Endpoint:
    """A connected RDMA endpoint. Create with ``aiordma.connect`` or ``aiordma.listen``.

    Methods are coroutine-safe on one event loop: concurrent ``send``s are delivered in
    the order they were called; ``recv``/``recv_into`` serve callers in FIFO order and
    a cancelled receive never loses a message. ``async with ep:`` closes gracefully.
    """

    def __init__(self, device: Device, opts: EndpointOptions, loop: asyncio.AbstractEventLoop,
                 *, auth_key: bytes | None = None) -> None:
        """``auth_key``: the connection key both sides derived in the handshake
        (``protocol.auth``), which a ``soft`` device makes the peer prove."""
        self._loop = loop
        self._opts = opts
        self.provider = device.provider
        self.device_name = device.name
        self._device = device
        res = self._res = Resources(device, opts, loop, auth_key)
        busy_ahead = min(opts.rndv_prefetch, _BUSY_READ_AHEAD)
        self._reactor = res.reactor
        self._regions = res.regions
        self._engine = MessageEngine(
            res, spool=res.spool, rpool=res.rpool, frame_wrs=res.frame_wrs,
            eager=opts.eager_size, max_message_size=opts.max_message_size,
            inline_cap=res.inline_cap, send_depth=res.send_depth,
            signal_interval=opts.signal_interval, signal_bytes=opts.signal_bytes,
            repost_batch=opts.repost_batch, rndv_prefetch=opts.rndv_prefetch,
            busy_ahead=busy_ahead, direct_ahead=0 if device.ctx.reads_on_cpu else busy_ahead)
        # the per-message calls, bound once (a method looked up by name, or a bound
        # method made, at every call costs more than the call itself)
        self._future_kw = future_kwargs(loop)  # new_future makes them with it
        self._engine.set_waiter_maker(self._future_kw, loop.create_future)
        self._send_now: Callable[[Any], Op | None] = self._engine.send_now
        self._take_data: Callable[[], bytes | None] = self._engine.rx.take_data
        self._take_into: Callable[[Any], int] = self._engine.rx.take_into
        self._rx: Any = self._engine.rx
        self._rxq: Any = self._engine.rx.rx  # the received messages (a Fifo, kept)
        self._life = Lifecycle(self, loop, self._engine, res, opts.close_timeout)
        self._one = OneSided(self)
        self._rcv = Receiving(self)
        self._snd = Sending(self)
        res.bind(self._engine.tx.on_wc, self._engine.rx.on_wc, self._life)
        res.attach(self._engine)
        self.qp_num = res.qp.qp_num
        device.watch_qp(self.qp_num, self._on_async_event, loop)
        self._psn = secrets.randbelow(1 << 24)  # unpredictable, as a NIC's initial PSN
        self._gid_index = 0
        self._peer_heartbeat = False  # the peer answers heartbeat PINGs (handshake flag)
        self.local_address: tuple[Any, ...] | None = None
        self.peer_address: tuple[Any, ...] | None = None
        self.peer_qp_num = 0
        self.messages_sent = 0
        self.bytes_sent = 0
        slots = [res.rpool.acquire() for _ in range(res.recv_depth)]
        try:
            self._engine.rx.post([s for s in slots if s is not None])
        except BaseException:
            self._life.destroy_now()
            raise

    # ---------------------------------------------------------------- setup
    def local_hello(self, local_ip: str) -> Hello:
        """Our half of the handshake: QP number, PSN, GID for ``local_ip``, limits."""
        ctx = self._device.ctx
        port = self._res.port
        self._gid_index = ctx.gid_index_for(local_ip)
        gid = ctx.query_gid(1, self._gid_index)
        return Hello(qp_num=self.qp_num, psn=self._psn, gid=gid, lid=port.lid,
                     mtu=int(port.active_mtu), recv_credits=self._res.recv_depth,
                     eager_size=self._engine.eager, max_message_size=self.max_message_size,
                     provider=self.provider,
                     flags=HANDSHAKE_FLAG_BATCH | HANDSHAKE_FLAG_LIVENESS)

    async def establish(self, peer: Hello) -> None:
        """Move the QP to RTS towards ``peer``. Raises RDMAError on failure.

        Where the QP's RTR transition releases the GIL (``QP.modify_releases_gil``: the
        compiled verbs path, in which the kernel resolves the peer's address, for
        seconds when nobody answers) it runs in the loop's default executor while the
        loop goes on. A cancellation then waits for that thread before it propagates,
        so that the QP is never destroyed under it."""
        self._engine.connect(peer.recv_credits, self._res.recv_depth, peer.eager_size,
                             peer.max_message_size, bool(peer.flags & HANDSHAKE_FLAG_BATCH))
        self.peer_qp_num = peer.qp_num
        self._peer_heartbeat = bool(peer.flags & HANDSHAKE_FLAG_LIVENESS)
        connect = functools.partial(
            self._res.connect, peer.gid, peer.lid, peer.qp_num, peer.psn, peer.mtu,
            self._gid_index, self._psn, timeout=self._opts.qp_timeout(self.provider),
            retry_cnt=self._opts.retry_cnt)
        if not self._res.qp.modify_releases_gil:
            connect()
            return
        fut = self._loop.run_in_executor(None, connect)
        cancelled: asyncio.CancelledError | None = None
        while not fut.done():  # bounded by the kernel's address-resolution timeout
            try:
                await asyncio.wait((fut,))
            except asyncio.CancelledError as exc:
                # (no await inside an except block: mypyc's compiled coroutine then
                # leaves the exception set as the thread's current one)
                cancelled = exc
        if cancelled is not None:
            if not fut.cancelled():
                fut.exception()  # retrieved: the cancellation is what the caller sees
            raise cancelled
        fut.result()

    def start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
              accepting: bool = False) -> None:
        """Begin watching the out-of-band TCP connection (``liveness``): its EOF means the
        peer is gone, the heartbeat finds a peer frozen or cut off. ``accepting``: this
        side is the listener's."""
        self.local_address = writer.get_extra_info("sockname")
        self.peer_address = writer.get_extra_info("peername")
        self._life.start(reader, writer, liveness.heartbeat_for(
            self._opts, peer_answers=self._peer_heartbeat, accepting=accepting,
            now=self._loop.time()))

    # ---------------------------------------------------------------- properties
    @property
    def max_message_size(self) -> int:
        """Largest message ``send``/``recv`` accept (negotiated with the peer)."""
        return self._engine.max_message_size

    @property
    def eager_payload(self) -> int:
        """Largest message that travels in one SEND (negotiated with the peer); larger
        ones go by rendezvous. Messages up to this size are held back by receive
        credits alone, which makes it the natural unit for byte streams."""
        return self._engine.eager_payload

    @property
    def closed(self) -> bool:
        """True once ``close()`` or ``abort()`` was called or the connection failed."""
        return self._engine.state.failed or self._life.closing is not None

    @property
    def _control(self) -> asyncio.StreamWriter | None:
        return self._life.control

    @property
    def _qp(self) -> Any:
        return self._res.qp

    @_qp.setter
    def _qp(self, qp: Any) -> None:  # (tests stand a QP in)
        self._res.qp = qp

    def __repr__(self) -> str:
        state = ("failed" if self._engine.state.failed
                 else "closing" if self._life.closing else "open")
        return (f"<Endpoint {self.provider}:{self.device_name} qp={self.qp_num}->"
                f"{self.peer_qp_num} {state} peer={self.peer_address}>")

    def statistics(self) -> dict[str, Any]:
        """Counters and queue levels of this endpoint (also after it is closed: the
        counters keep their last values). ``reactor``: the statistics of the CQ
        reactor this endpoint shares with the device's other endpoints on its loop
        (poll mode, spins, quiet periods; ``CQReactor.statistics``). ``c_path``: the
        engine posts and polls through the provider's C-level operations (the QP and CQ
        offer them: ``soft``, and ``verbs`` with its compiled data path)."""
        e = self._engine
        c = e.credits
        return {
            "messages_sent": self.messages_sent,
            "messages_batched": e.tx.messages_batched,
            "messages_received": e.rx.messages_received,
            "rndv_staged": e.rx.rndv_staged,
            "bytes_sent": self.bytes_sent,
            "bytes_received": e.rx.bytes_received,
            "send_queue_used": e.tx.sq.used,
            "queued": e.tx.queued,
            "peer_credits": c.peer_credits if c else 0,
            "owed_credits": c.owed if c else 0,
            "posted_recvs": e.rx.posted,
            "rx_queued": len(e.rx.rx),
            "staging_registrations": self._res.staging_registrations(),
            "work_requests_posted": e.tx.work_requests_posted,
            "c_path": e.c_path,
            "state": e.state.state.name,
            "reactor": self._reactor.statistics(),
            "heartbeat": liveness.statistics(self._life.heartbeat),
        }

    # ---------------------------------------------------------------- memory
    def register(self, buffer: Any, *, remote_read: bool = False, remote_write: bool = False,
                 remote_atomic: bool = False) -> MemoryRegion:
        """Register a writable buffer with this endpoint's PD.

        Rights: LOCAL_WRITE plus exactly the remote rights asked for. Raises TypeError
        for a read-only or non-contiguous buffer, ConnectionClosed when closed.
        """
        self._check_open()
        access = Access.LOCAL_WRITE
        if remote_read:
            access |= Access.REMOTE_READ
        if remote_write:
            access |= Access.REMOTE_WRITE
        if remote_atomic:
            access |= Access.REMOTE_ATOMIC
        region = MemoryRegion(self._res.pd.reg_mr(buffer, access), self._regions)
        self._regions.add(region)
        return region

    # ---------------------------------------------------------------- two-sided
    async def send(self, data: Any) -> None:
        """Send one message (any bytes-like object, 0 bytes to ``max_message_size``).

        Returns when the peer's device has the whole message. Raises TypeError for a
        non-bytes-like object, MessageTooLarge, ConnectionClosed. If cancelled before
        the message was handed to the device it is not sent; after that it is
        delivered, and its buffers stay pinned until the device is done. The data is
        copied (eager) or must not change until ``send`` returns (rendezvous from a
        registered region).
        """
        e = self._engine
        fut: asyncio.Future[None]
        op: Op | None = None
        if self._life.closing is None:
            # the usual case: one call into the engine, which posts the message and
            # then makes its future (nothing else runs before the post)
            op = self._send_now(data)
        if op is None:
            fut = new_future(self._loop, self._future_kw)
            op, n = self._snd.queue(fut, data)
        else:
            fut = cast("asyncio.Future[None]", op.fut)
            n = len(data)
        try:
            if self._reactor.waits:
                await self._reactor.wait(fut, op.posted)
            else:
                await fut
        except asyncio.CancelledError:
            if not op.posted:
                e.tx.unqueue(e.tx.sendq, [op])
            raise
        self.messages_sent += 1
        self.bytes_sent += n

    async def send_many(self, messages: Iterable[Any]) -> None:
        """Send each of ``messages`` (bytes-like objects) as one message, in order, as
        that many ``send`` calls would: the peer receives them one by one, boundaries
        kept. Returns when the peer's device has all of them. One wait for all: the
        small ones cost no future and no task wake-up each.

        Raises TypeError (``messages`` one bytes-like object or string, or an item not
        bytes-like), MessageTooLarge or ConnectionClosed before anything is sent: every
        item is checked first. If cancelled, the messages already handed to the device
        are delivered, each whole, and the rest are not sent: the peer gets a prefix of
        ``messages``. An item must not change until this returns.
        """
        if isinstance(messages, (bytes, bytearray, memoryview, str)):
            raise TypeError("send_many takes an iterable of messages (one message: send)")
        msgs = messages if type(messages) is list else list(messages)
        if not msgs:
            return
        loop, kw = self._loop, self._future_kw
        ops, futs, n = self._snd.queue_many(msgs, lambda: new_future(loop, kw))
        try:
            if len(futs) == 1:
                if self._reactor.waits:
                    await self._reactor.wait(futs[0], ops[-1].posted)
                else:
                    await futs[0]
            else:
                await asyncio.gather(*futs)
        except asyncio.CancelledError:
            tx = self._engine.tx
            tx.unqueue(tx.sendq, ops)
            raise
        self.messages_sent += len(msgs)
        self.bytes_sent += n

    async def recv(self) -> bytes:
        """The next whole message, as bytes.

        Raises ConnectionClosed after the peer closed (once everything it sent before
        is delivered) or when the connection failed. Cancellation never loses a message.
        """
        rx = self._rx
        rxq = self._rxq
        miss = None
        if not rxq and not rx.receivers and self._reactor.in_place:
            miss = self._rcv.wait_in_place()
        if rxq and not rx.receivers:
            data = self._take_data()  # already here, nobody queued before us: no lock
            if data is not None:
                return data
        rx.receivers += 1
        try:
            data = await self._rcv.recv()
        finally:
            rx.receivers -= 1
            rx.receive_done()
        if miss is not None:
            self._rcv.resumed(miss)
        return data

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer``; returns its length.

        A buffer registered with this endpoint gets large messages by zero-copy RDMA
        READ. Raises TypeError for a read-only buffer, MessageTooLarge (message kept for
        the next receive) when it does not fit, ConnectionClosed as ``recv``.
        """
        rx = self._rx
        miss = None
        out: memoryview | None = None
        if not self._rxq and self._reactor.in_place and not rx.receivers:
            out = writable_view(buffer)  # a bad buffer raises before the wait
            miss = self._rcv.wait_in_place()
        n = self._take_into(buffer)  # already here, nobody queued before us: no await
        if n >= 0:
            return n
        if out is None:
            out = writable_view(buffer)
        rx.receivers += 1
        try:
            n = await self._rcv.recv_into(out)
        finally:
            rx.receivers -= 1
            rx.receive_done()
        if miss is not None:
            self._rcv.resumed(miss)
        return n

    # ---------------------------------------------------------------- one-sided
    # (the work: onesided.OneSided)
    async def write(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA WRITE all of ``local`` (a MemoryRegion or a buffer inside one registered
        with this endpoint) to the start of ``remote``.

        Raises ValueError (unregistered buffer, longer than ``remote``), TypeError,
        RemoteAccessError (peer refused: bad rkey, range, or right), ConnectionClosed.
        """
        await self._one.write(local, remote)

    async def read(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA READ ``len(local)`` bytes from the start of ``remote`` into ``local``.

        Raises as ``write``; ``local`` must be writable.
        """
        await self._one.read(local, remote)

    async def write_with_imm(self, local: Any, remote: RemoteBuffer, imm: int) -> None:
        """RDMA WRITE with a 32-bit immediate; the peer gets ``imm`` from ``recv_imm()``
        after the data is in place. Consumes one receive credit of the peer. Raises as
        ``write``, and ValueError for an ``imm`` outside 0..2**32-1."""
        await self._one.write_with_imm(local, remote, imm)

    async def recv_imm(self) -> int:
        """The immediate of the next ``write_with_imm`` from the peer (in order).

        Raises ConnectionClosed like ``recv``.
        """
        return await self._one.recv_imm()

    async def fetch_add(self, remote: RemoteBuffer, value: int) -> int:
        """Atomically add ``value`` (mod 2**64) to the 8-byte word at ``remote``;
        returns the old value. ``remote.addr`` must be 8-byte aligned (ValueError)."""
        return await self._one.fetch_add(remote, value)

    async def compare_swap(self, remote: RemoteBuffer, expected: int, new: int) -> int:
        """Atomically replace the 8-byte word at ``remote`` with ``new`` if it equals
        ``expected``; returns the old value (the swap happened iff it == expected)."""
        return await self._one.compare_swap(remote, expected, new)

    # ---------------------------------------------------------------- device events
    def _on_async_event(self, ev: AsyncEvent) -> None:
        """A fatal async event for our QP (or the whole port/device) kills the connection."""
        if ev.event_type in (EventType.COMM_EST, EventType.SQ_DRAINED,
                             EventType.QP_LAST_WQE_REACHED):
            return
        self._engine.fail(ConnectionClosed(f"device reported {ev.event_type} for this "
                                           "connection"))

    # ---------------------------------------------------------------- state checks
    def _check_open(self) -> None:
        if self._engine.state.failed or self._life.closing is not None:
            raise self._engine.closed_error()

    # ---------------------------------------------------------------- close / abort
    async def close(self) -> None:
        """Graceful close: queued and posted sends complete, then the peer gets EOF
        (its ``recv`` raises ConnectionClosed after everything sent before), then the
        resources are destroyed (after ``send_eof()`` the peer already has its EOF).
        Idempotent; waits at most ``close_timeout`` for the pending sends, then aborts."""
        await self._life.close()

    async def send_eof(self) -> None:
        """Half-close, like ``socket.shutdown(SHUT_WR)``: once every message already
        passed to ``send`` is delivered, send the peer EOF (its ``recv`` raises
        ConnectionClosed after everything sent before) without tearing anything down.

        The connection stays open in the other direction: the peer may still send,
        this endpoint still receives (and keeps returning credits), one-sided operations
        still work. From this call on ``send``/``write_with_imm`` raise ConnectionClosed;
        ``close()`` later finishes the connection without a second EOF. Returns when the
        peer's device has the EOF; cancelling the wait does not withdraw it. Idempotent.
        Raises ConnectionClosed if the endpoint is closed, or fails before the EOF went.
        """
        self._check_open()
        if self._engine.credits is None:
            raise ConnectionClosed("endpoint is not connected")
        await self._life.send_eof()

    def abort(self) -> None:
        """Immediate close: every pending operation fails with ConnectionClosed now;
        the peer sees the connection drop. Idempotent."""
        self._life.abort()

    def _abort_now(self) -> None:
        """``abort`` that also destroys every resource before returning: for a task being
        cancelled, whose loop may be shutting down (``asyncio.run`` at exit)."""
        self._life.abort(now=True)

    async def wait_closed(self) -> None:
        """Wait until every resource of the endpoint is destroyed."""
        await uncancelled(self._life.done)

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
