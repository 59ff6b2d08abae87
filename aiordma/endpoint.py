"""``Endpoint``: a reliable, message-oriented RDMA connection (one RC QP).

Resources of one endpoint: its own protection domain (keys handed to this peer are
useless on any other QP), one RC QP, a CQ reservation on the device's reactor, a
registered pool of receive buffers posted for the peer (the peer's credits), a pool of
eager send buffers, and staging caches for rendezvous. Nothing is registered per
message.

Messages: a message up to ``eager_size - 8`` bytes travels in one SEND (8-byte frame
header + payload); small messages queued in the same loop iteration share one SEND (a
BATCH frame, when the peer announced it understands them), one credit and one
completion, and are handed to the receiving application one by one. A larger one goes by rendezvous: the sender SENDs a descriptor of a
registered source (the user's own region when the bytes lie in one registered for
remote read, else a staging copy), the receiver RDMA-READs it straight into the
destination (``recv_into`` with a registered buffer) or into staging, then sends
RNDV_DONE, which completes the sender's ``send()``.

Flow control: receive credits (``protocol.credits``); RNR never happens by design.

Failure: the first error (a failed completion, a protocol violation, the peer gone)
moves the QP to ERR; every pending operation then fails with ``ConnectionClosed``
whose ``__cause__`` is that first error; an operation whose own completion carried an
access or length error raises that typed ``CompletionError``.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import secrets
import struct
from collections.abc import Callable
from typing import Any, Final

from . import liveness
from .cq_reactor import CQReactor
from .device import Device
from .errors import (
    CompletionError,
    ConnectionClosed,
    FlushedError,
    MessageTooLarge,
    PeerUnresponsive,
    RDMAError,
    RetryExceededError,
    RNRRetryExceededError,
    completion_error,
)
from .memory import (
    LocalSpan,
    MemoryRegion,
    RegionTable,
    RemoteBuffer,
    SlotPool,
    Staging,
    StagingCache,
)
from .options import EndpointOptions
from .protocol.credits import CreditState
from .protocol.errors import RemoteProtocolError
from .protocol.framing import (
    BATCH_RECORD,
    HANDSHAKE_FLAG_BATCH,
    HEADER_SIZE,
    FrameType,
    batch_records,
    parse_frame,
    write_batch,
    write_close,
    write_credit,
    write_data_header,
    write_rndv,
    write_rndv_done,
)
from .protocol.handshake import Hello
from .protocol.heartbeat import HANDSHAKE_FLAG_LIVENESS
from .sendq import SendQueue
from .verbs import (
    MTU,
    SGE,
    WC,
    Access,
    AHAttr,
    AsyncEvent,
    EventType,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCOpcode,
    WCStatus,
    WROpcode,
)

log = logging.getLogger("aiordma")

_U64: Final = struct.Struct("<Q")
# hot path: plain ints (flag-enum arithmetic builds a new enum object per operation)
_SIGNALED: Final = int(SendFlags.SIGNALED)
_INLINE: Final = int(SendFlags.INLINE)
_REMOTE_READ: Final = int(Access.REMOTE_READ)
_SEND: Final = WROpcode.SEND
_MASK64: Final = (1 << 64) - 1

# op kinds (_BATCH: several _DATA ops sent as one BATCH frame; its payload lists them)
_DATA: Final = 0
_RNDV: Final = 1
_CTRL: Final = 2
_WRITE: Final = 3
_READ: Final = 4
_ATOMIC: Final = 5
_IMM: Final = 6
_RNDV_READ: Final = 7
_BATCH: Final = 8
_BUSY_READ_AHEAD: Final = 4 << 20  # staging bytes read ahead while a receive is in progress
_GRACE_S: Final = 1.0  # after the peer's EOF, how long posted work may take to complete
_PEER_GONE: Final = (WCStatus.RETRY_EXC_ERR, WCStatus.RNR_RETRY_EXC_ERR)


async def _uncancelled(fut: asyncio.Future[Any], timeout: float | None = None) -> Any:
    """Wait for ``fut`` without ever cancelling it (unlike ``asyncio.shield``, a failure
    after our caller was cancelled is not reported to the loop's exception handler).

    Returns its result or raises its exception; TimeoutError after ``timeout``.
    """
    if not fut.done():
        if timeout is not None:
            await asyncio.wait((fut,), timeout=timeout)
            if not fut.done():
                raise TimeoutError(f"not done after {timeout:g}s")
        else:  # asyncio.wait without its sets and timer (the rendezvous receive path)
            waiter = fut.get_loop().create_future()

            def wake(_f: asyncio.Future[Any]) -> None:
                if not waiter.done():
                    waiter.set_result(None)

            fut.add_done_callback(wake)
            try:
                await waiter
            finally:
                fut.remove_done_callback(wake)
    return fut.result()


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class _Op:
    """One operation on the send queue (or waiting for resources to be posted)."""

    __slots__ = ("kind", "fut", "slot", "keep", "wr", "payload", "msg_id", "posted")

    def __init__(self, kind: int, fut: asyncio.Future[Any] | None, payload: Any = None, *,
                 wr: SendWR | None = None, keep: Any = None, msg_id: int = 0) -> None:
        self.kind = kind
        self.fut = fut
        self.slot: int | None = None
        self.keep = keep
        self.wr = wr
        self.payload = payload
        self.msg_id = msg_id
        self.posted = False


class _Rx:
    """A received message waiting for the application (head of the receive queue)."""

    __slots__ = ("kind", "slot", "offset", "length", "addr", "rkey", "msg_id", "read_fut",
                 "staging", "done_sent", "deferred")

    def __init__(self, kind: int, slot: int = -1, offset: int = 0, length: int = 0, *,
                 addr: int = 0, rkey: int = 0, msg_id: int = 0) -> None:
        self.kind = kind
        self.slot = slot
        self.offset = offset
        self.length = length
        self.addr = addr
        self.rkey = rkey
        self.msg_id = msg_id
        self.read_fut: asyncio.Future[None] | None = None
        self.staging: Staging | None = None
        self.done_sent = False
        self.deferred = False  # a rendezvous message not read ahead on arrival


_RX_DATA: Final = 0
_RX_RNDV: Final = 1
_RX_EOF: Final = 2


class Endpoint:
    """A connected RDMA endpoint. Create with ``aiordma.connect`` or ``aiordma.listen``.

    Methods are coroutine-safe on one event loop: concurrent ``send``s are delivered in
    the order they were called; ``recv``/``recv_into`` serve callers in FIFO order and
    a cancelled receive never loses a message. ``async with ep:`` closes gracefully.
    """

    # released by _destroy_resources (deleted: the endpoint holds them no more)
    __deletable__ = ("_qp", "_staging_out", "_staging_in", "_spool", "_rpool", "_pd")

    def __init__(self, device: Device, opts: EndpointOptions, loop: asyncio.AbstractEventLoop,
                 *, auth_key: bytes | None = None) -> None:
        """``auth_key``: the connection key both sides derived in the handshake
        (``protocol.auth``), which a ``soft`` device makes the peer prove."""
        self._loop = loop
        self._device = device
        self._opts = opts
        self.max_message_size = opts.max_message_size
        self.provider = device.provider
        self.device_name = device.name
        ctx = device.ctx
        try:
            self._reactor: CQReactor = device.reactor(loop, mode=opts.poll_mode,
                                                      spin_us=opts.spin_us)
            dattr = ctx.query_device()
            self._port = ctx.query_port(1)
            self._pd = ctx.alloc_pd()
        except BaseException:
            device.release()  # the caller's reference: nothing else was made yet
            raise
        # One work request moves at most the port's max_msg_sz (rxe on 6.1: 8 MiB):
        # longer READs/WRITEs are posted as several, in order (see _wr_chunks).
        self._max_wr = min(opts.max_wr_size or self._port.max_msg_sz, self._port.max_msg_sz)
        self._inline_cap = min(opts.inline_threshold, dattr.max_inline_data)
        self._recv_depth = min(opts.recv_depth, dattr.max_qp_wr)
        self._send_depth = min(opts.send_depth, dattr.max_qp_wr)
        self._eager = opts.eager_size
        self._eager_payload = opts.eager_size - HEADER_SIZE
        self._closers: list[Any] = []  # what teardown destroys, in reverse order
        self._staging_registered = 0  # registrations by staging caches already closed
        try:
            entries = self._send_depth + self._recv_depth
            self._cq = self._reactor.acquire_cq(entries)
            self._cq_entries = entries
            self._rpool = SlotPool(self._pd, self._eager, self._recv_depth)
            self._spool = SlotPool(self._pd, self._eager, self._send_depth)
            self._staging_out = StagingCache(self._pd, Access.LOCAL_WRITE | Access.REMOTE_READ)
            # READ targets: shared memory where the provider fills it by a plain copy
            self._staging_in = StagingCache(self._pd, Access.LOCAL_WRITE,
                                            shared=self._pd.context.maps_shared_memory)
            self._qp = self._pd.create_qp(self._cq, self._cq, QPCap(
                max_send_wr=self._send_depth, max_recv_wr=self._recv_depth,
                max_send_sge=1, max_recv_sge=1, max_inline_data=self._inline_cap))
            self._qp.modify(QPAttr(QPState.INIT, port_num=1, qp_access_flags=(
                Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
                | Access.REMOTE_ATOMIC), auth_key=auth_key))
        except BaseException:
            self._destroy_resources()
            raise
        self.qp_num = self._qp.qp_num
        # One work request per buffer slot, re-used for every post of that slot (a
        # provider copies what it needs at post time): no allocation per message.
        rp, sp = self._rpool, self._spool
        self._recv_wrs = [RecvWR(0, [SGE(rp.addr(i), rp.slot_size, rp.lkey)])
                          for i in range(rp.count)]
        self._send_wrs = [SendWR(0, _SEND, [SGE(sp.addr(i), 0, sp.lkey)], 0)
                          for i in range(sp.count)]
        device.watch_qp(self.qp_num, self._on_async_event, loop)
        self._psn = secrets.randbelow(1 << 24)  # unpredictable, as a NIC's initial PSN
        self._sq = SendQueue(self._send_depth, opts.signal_interval, opts.signal_bytes)
        self._regions = RegionTable()
        self._credits: CreditState | None = None
        self._batching = False  # the peer accepts BATCH frames (handshake flag)
        self._peer_heartbeat = False  # the peer answers heartbeat PINGs (handshake flag)
        self._heartbeat: liveness.Heartbeat | None = None
        self._ctrlq: collections.deque[_Op] = collections.deque()
        self._oneq: collections.deque[_Op] = collections.deque()
        self._sendq: collections.deque[_Op] = collections.deque()
        self._rx: collections.deque[_Rx] = collections.deque()
        self._rx_waiters: list[asyncio.Future[None]] = []
        self._imm: collections.deque[int] = collections.deque()
        self._imm_waiters: list[asyncio.Future[None]] = []
        self._recv_lock = asyncio.Lock()
        self._rndv_out: dict[int, _Op] = {}
        self._prefetched = 0  # bytes of rendezvous messages read ahead into staging
        self._deferred = 0  # rendezvous messages queued without a READ (rx.deferred)
        self._busy_ahead = min(opts.rndv_prefetch, _BUSY_READ_AHEAD)
        self._prefetch_scheduled = False
        self._msg_ids = itertools.count(1)
        self._posted_recvs = 0
        self._repost_q: list[int] = []  # consumed receive buffers not re-posted yet
        self._receivers = 0  # recv/recv_into calls in progress (the fast path needs none)
        self._in_tick = False  # the post fast path was used (see _kick)
        self._repost_batch = 1  # from the credit state once connected (rule 6)
        self._pump_scheduled = False
        self._first_error: BaseException | None = None
        self._failed = False
        self._close_sent = False
        self._eof: asyncio.Future[None] | None = None  # our CLOSE frame (send_eof/close)
        self._eof_queued = False
        self._remote_closed = False
        self._peer_gone = False  # CLOSE received, then the peer's endpoint went away
        self._closing: asyncio.Future[None] | None = None
        self._teardown_task: asyncio.Task[None] | None = None
        self._drained = loop.create_future()
        self._done = loop.create_future()
        self._control: asyncio.StreamWriter | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.local_address: tuple[Any, ...] | None = None
        self.peer_address: tuple[Any, ...] | None = None
        self.peer_qp_num = 0
        # counters
        self.messages_sent = 0
        self.work_requests_posted = 0  # send-queue work requests, every kind
        self.messages_batched = 0  # of messages_sent, those that went in BATCH frames
        self.messages_received = 0
        self.rndv_staged = 0  # rendezvous messages READ into staging (then copied)
        self.bytes_sent = 0
        self.bytes_received = 0
        for _i in range(self._recv_depth):
            slot = self._rpool.acquire()
            assert slot is not None
            self._post_recv_slot(slot)

    # ---------------------------------------------------------------- setup helpers
    def local_hello(self, local_ip: str) -> Hello:
        """Our half of the handshake: QP number, PSN, GID for ``local_ip``, limits."""
        ctx = self._device.ctx
        self._gid_index = ctx.gid_index_for(local_ip)
        gid = ctx.query_gid(1, self._gid_index)
        return Hello(qp_num=self.qp_num, psn=self._psn, gid=gid, lid=self._port.lid,
                     mtu=int(self._port.active_mtu), recv_credits=self._recv_depth,
                     eager_size=self._eager, max_message_size=self.max_message_size,
                     provider=self.provider,
                     flags=HANDSHAKE_FLAG_BATCH | HANDSHAKE_FLAG_LIVENESS)

    def establish(self, peer: Hello) -> None:
        """Move the QP to RTS towards ``peer``. Raises RDMAError on failure."""
        if peer.eager_size != self._eager:
            # Frames must fit the peer's receive buffers: use the smaller size.
            self._eager = min(self._eager, peer.eager_size)
            self._eager_payload = self._eager - HEADER_SIZE
        self.max_message_size = min(self.max_message_size, peer.max_message_size)
        self.peer_qp_num = peer.qp_num
        self._batching = bool(peer.flags & HANDSHAKE_FLAG_BATCH)
        self._peer_heartbeat = bool(peer.flags & HANDSHAKE_FLAG_LIVENESS)
        mtu = MTU(min(peer.mtu, int(self._port.active_mtu)))
        self._qp.modify(QPAttr(QPState.RTR, path_mtu=mtu, dest_qp_num=peer.qp_num,
                               rq_psn=peer.psn, max_dest_rd_atomic=16, min_rnr_timer=12,
                               ah_attr=AHAttr(dgid=peer.gid, dlid=peer.lid,
                                              sgid_index=self._gid_index, port_num=1)))
        self._qp.modify(QPAttr(QPState.RTS, sq_psn=self._psn,
                               timeout=self._opts.qp_timeout(self.provider),
                               retry_cnt=self._opts.retry_cnt, rnr_retry=7, max_rd_atomic=16))
        self._credits = CreditState(peer.recv_credits, self._recv_depth,
                                    repost_batch=self._opts.repost_batch)
        self._repost_batch = self._credits.repost_batch

    def start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
              accepting: bool = False) -> None:
        """Begin watching the out-of-band TCP connection (``liveness``): its EOF means the
        peer is gone, the heartbeat finds a peer frozen or cut off. ``accepting``: this
        side is the listener's."""
        self._control = writer
        self.local_address = writer.get_extra_info("sockname")
        self.peer_address = writer.get_extra_info("peername")
        hb = self._heartbeat = liveness.heartbeat_for(
            self._opts, peer_answers=self._peer_heartbeat, accepting=accepting,
            now=self._loop.time())
        self._watch_task = self._loop.create_task(self._watch_control(reader, writer, hb))

    async def _watch_control(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                             hb: liveness.Heartbeat | None) -> None:
        try:
            await liveness.watch(reader, writer, hb)
        except (PeerUnresponsive, RemoteProtocolError) as exc:
            self._fail(exc)
            return
        except asyncio.CancelledError:
            return
        if self._failed or self._done.done():
            return
        # The peer's CLOSE frame, if it sent one, is in our CQ by now (its SEND was
        # acknowledged before it dropped the connection): collect it first.
        self._reactor.drain_cq(self._cq)
        if not self._remote_closed:
            # Give posted work a moment, so that callers see the precise error.
            await self._grace_for_posted()
            self._fail(ConnectionClosed("peer closed the connection"))
        else:
            # Like TCP's CLOSE_WAIT: the application still reads what was sent before
            # the peer's CLOSE, then closes us. Nothing can reach the peer any more.
            self._on_peer_gone()
            # Sends posted before we knew that end with their completion if the peer
            # acknowledged them in time. The rest never reached its application: rxe
            # may retransmit them into the void for longer than any close waits (seen:
            # over 20 s), so after the grace period their senders get ConnectionClosed
            # (their buffers stay pinned until the teardown).
            await self._grace_for_posted()
            if not self._failed:
                for op in self._posted_ops():
                    if op.fut is not None and not op.fut.done():
                        op.fut.set_exception(ConnectionClosed("the peer closed the connection"))

    async def _grace_for_posted(self) -> None:
        """Wait up to ``_GRACE_S`` (the peer's QP is in ERR or gone) for posted work that
        somebody awaits to end with its own completion; returns early on a failure."""
        deadline = self._loop.time() + _GRACE_S
        while self._sq.awaited and not self._failed and self._loop.time() < deadline:
            await asyncio.sleep(0.005)

    def _on_peer_gone(self) -> None:
        """The peer sent CLOSE and then tore its endpoint down. What we received stays
        readable, but nothing can be sent: fail what waits to be posted (sends short of
        credits, one-sided work) or for RNDV_DONE (it would wait forever), post nothing
        more (a frame to the dead QP would fail the endpoint and lose what is left to
        read), refuse new sends."""
        self._peer_gone = True

        def gone() -> ConnectionClosed:
            return ConnectionClosed("the peer closed the connection")

        self._fail_queued(gone)
        in_sq = {id(op) for _w, op in self._sq._q}
        for msg_id, op in list(self._rndv_out.items()):
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(gone())
            if id(op) not in in_sq:  # else its completion (or teardown) releases it
                del self._rndv_out[msg_id]
                self._release_source(op.payload)
        eof = self._eof
        if eof is not None and self._eof_queued and not eof.done():
            # Our CLOSE is posted but the peer's QP is gone: no ACK will come (rxe
            # retransmits into the void), so neither close() nor send_eof() waits for it.
            eof.set_exception(gone())
        if self._closing is not None:
            self._wake_closer()  # for the same reason, posted sends will not complete

    # ---------------------------------------------------------------- properties
    @property
    def eager_payload(self) -> int:
        """Largest message that travels in one SEND (negotiated with the peer); larger
        ones go by rendezvous. Messages up to this size are held back by receive
        credits alone, which makes it the natural unit for byte streams."""
        return self._eager_payload

    @property
    def closed(self) -> bool:
        """True once ``close()`` or ``abort()`` was called or the connection failed."""
        return self._failed or self._closing is not None

    def __repr__(self) -> str:
        state = "failed" if self._failed else "closing" if self._closing else "open"
        return (f"<Endpoint {self.provider}:{self.device_name} qp={self.qp_num}->"
                f"{self.peer_qp_num} {state} peer={self.peer_address}>")

    def statistics(self) -> dict[str, Any]:
        """Counters and queue levels of this endpoint (also after it is closed: the
        counters keep their last values). ``reactor``: the statistics of the CQ
        reactor this endpoint shares with the device's other endpoints on its loop
        (poll mode, spins, quiet periods; ``CQReactor.statistics``)."""
        c = self._credits
        staging = [getattr(self, name, None) for name in ("_staging_in", "_staging_out")]
        registered = self._staging_registered + sum(st.registrations for st in staging
                                                    if st is not None)
        return {
            "messages_sent": self.messages_sent,
            "messages_batched": self.messages_batched,
            "messages_received": self.messages_received,
            "rndv_staged": self.rndv_staged,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "send_queue_used": self._sq.used,
            "queued": len(self._sendq) + len(self._oneq) + len(self._ctrlq),
            "peer_credits": c.peer_credits if c else 0,
            "owed_credits": c.owed if c else 0,
            "posted_recvs": self._posted_recvs,
            "rx_queued": len(self._rx),
            "staging_registrations": registered,
            "work_requests_posted": self.work_requests_posted,
            "reactor": self._reactor.statistics(),
            "heartbeat": liveness.statistics(self._heartbeat),
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
        region = MemoryRegion(self._pd.reg_mr(buffer, access), self._regions)
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
        if (self._failed or self._closing is not None or self._eof is not None
                or self._peer_gone or self._credits is None):
            self._check_send()  # raises the precise error
        try:
            mv = memoryview(data)
        except TypeError:
            raise TypeError(f"a bytes-like object is required, not {type(data).__name__!r}") from None
        if mv.ndim != 1 or mv.format != "B":
            if not mv.c_contiguous:
                raise TypeError("a C-contiguous buffer is required")
            mv = mv.cast("B")
        n = mv.nbytes
        if n > self.max_message_size:
            raise MessageTooLarge(f"message of {n} bytes exceeds max_message_size "
                                  f"{self.max_message_size}", n)
        fut: asyncio.Future[None] = self._loop.create_future()
        if n <= self._eager_payload:
            op = _Op(_DATA, fut, mv)
        else:
            op = _Op(_RNDV, fut, payload=self._rndv_source(mv), msg_id=next(self._msg_ids))
        # _submit, inlined (one coroutine frame less per message)
        q = self._sendq
        q.append(op)
        self._kick()
        try:
            if self._reactor.in_place:
                await self._reactor.wait(fut, op.posted)
            else:
                await fut
        except asyncio.CancelledError:
            if not op.posted:
                self._unqueue(q, op)
            raise
        self.messages_sent += 1
        self.bytes_sent += n

    def _rndv_source(self, mv: memoryview) -> Any:
        """A registered, remotely readable copy of (or view on) ``mv`` for rendezvous."""
        try:
            span = self._regions.resolve(mv, writable=False)
        except (ValueError, TypeError):
            span = None
        if span is not None and isinstance(span.keep, tuple):
            region = span.keep[1]
            if int(region.access) & _REMOTE_READ:  # (no flag-enum arithmetic per send)
                return span
        st = self._staging_out.lease(mv.nbytes)
        st.view[:] = mv
        return st

    async def recv(self) -> bytes:
        """The next whole message, as bytes.

        Raises ConnectionClosed after the peer closed (once everything it sent before
        is delivered) or when the connection failed. Cancellation never loses a message.
        """
        rxq = self._rx
        if not rxq and not self._receivers and self._reactor.in_place:
            self._rx_in_place()
        if rxq and not self._receivers and not self._failed:
            rx = rxq[0]
            if rx.kind == _RX_DATA:  # already here, nobody queued before us: no lock
                data = bytes(self._rpool.view[rx.offset: rx.offset + rx.length])
                self._consume_data(rx)
                return data
        self._receivers += 1
        try:
            return await self._recv_locked()
        finally:
            self._receivers -= 1
            if not self._receivers and self._deferred:
                self._schedule_prefetch()

    def _rx_in_place(self) -> None:
        """polling mode, nothing received yet and nobody else receiving: wait in place
        (cq_reactor.wait_in_place) for the next frame, so that a message that comes in
        time takes the no-lock path of ``recv``/``recv_into`` instead of the waiter
        machinery. The caller then looks at the receive queue; this never suspends."""
        if self._failed or self._closing is not None:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        waiters = self._rx_waiters
        waiters.append(fut)
        if not self._reactor.wait_in_place(fut) and fut in waiters:
            waiters.remove(fut)

    async def _recv_locked(self) -> bytes:
        async with self._recv_lock:
            rx = await self._next_rx()
            if rx.kind == _RX_DATA:
                data = bytes(self._rpool.view[rx.offset: rx.offset + rx.length])
                self._consume_data(rx)
                return data
            st = await self._rndv_fetch(rx, None)
            assert st is not None
            data = bytes(st.view)
            self._consume_rndv(rx)
            return data

    async def recv_into(self, buffer: Any) -> int:
        """Receive the next message into ``buffer``; returns its length.

        A buffer registered with this endpoint gets large messages by zero-copy RDMA
        READ. Raises TypeError for a read-only buffer, MessageTooLarge (message kept for
        the next receive) when it does not fit, ConnectionClosed as ``recv``.
        """
        try:
            out = memoryview(buffer)
        except TypeError:
            raise TypeError(f"a writable bytes-like object is required, not "
                            f"{type(buffer).__name__!r}") from None
        if out.readonly:
            raise TypeError("recv_into needs a writable buffer")
        if out.ndim != 1 or out.format != "B":
            out = out.cast("B")
        rxq = self._rx
        if not rxq and not self._receivers and self._reactor.in_place:
            self._rx_in_place()
        if rxq and not self._receivers and not self._failed:
            rx = rxq[0]
            if rx.kind == _RX_DATA and rx.length <= out.nbytes:
                # already here, nobody queued before us: no lock, no await
                # (_consume_data, inlined)
                n = rx.length
                out[:n] = self._rpool.view[rx.offset: rx.offset + n]
                rxq.popleft()
                self.messages_received += 1
                self.bytes_received += n
                if rx.slot >= 0:
                    self._repost(rx.slot)
                return n
        self._receivers += 1
        try:
            return await self._recv_into_locked(out)
        finally:
            self._receivers -= 1
            if not self._receivers and self._deferred:
                self._schedule_prefetch()

    async def _recv_into_locked(self, out: memoryview) -> int:
        async with self._recv_lock:
            rx = await self._next_rx()
            if rx.length > out.nbytes:
                raise MessageTooLarge(f"message of {rx.length} bytes does not fit a buffer of "
                                      f"{out.nbytes}; it is kept for the next receive", rx.length)
            if rx.kind == _RX_DATA:
                out[: rx.length] = self._rpool.view[rx.offset: rx.offset + rx.length]
                n = rx.length
                self._consume_data(rx)
                return n
            span: LocalSpan | None
            try:
                span = self._regions.resolve(out[: rx.length], writable=True)
            except ValueError:
                span = None
            st = await self._rndv_fetch(rx, span)
            if st is not None:
                out[: rx.length] = st.view
            n = rx.length
            self._consume_rndv(rx)
            return n

    async def _next_rx(self) -> _Rx:
        while True:
            if self._failed:
                raise self._closed_error()
            if self._rx:
                rx = self._rx[0]
                if rx.kind == _RX_EOF:
                    raise ConnectionClosed("the peer closed the connection")
                return rx
            if self._closing is not None:
                raise self._closed_error()
            await self._wait_on(self._rx_waiters)

    async def _wait_on(self, waiters: list[asyncio.Future[None]]) -> None:
        """Sleep until ``_wake(waiters)``; a cancelled sleeper leaves the list clean."""
        fut: asyncio.Future[None] = self._loop.create_future()
        waiters.append(fut)
        try:
            if self._reactor.in_place:
                await self._reactor.wait(fut)
            else:
                await fut
        finally:
            if fut in waiters:
                waiters.remove(fut)

    async def _rndv_fetch(self, rx: _Rx, span: LocalSpan | None) -> Staging | None:
        """READ the rendezvous message ``rx`` into ``span`` or into staging (returned).

        Survives cancellation: an interrupted READ into staging is reused by the next
        receiver; one into a (cancelled) caller's buffer is simply read again.
        """
        if rx.read_fut is not None:
            await _uncancelled(rx.read_fut)
            if rx.staging is None:
                rx.read_fut = None  # landed in a cancelled caller's buffer: read again
        if rx.read_fut is None:
            fut = self._start_rndv_read(rx, span)
            # While it lands in the caller's buffer, read the next few messages (up to
            # min(rndv_prefetch, 4 MiB)) into staging, so the READs overlap the
            # application's work instead of one READ per receive call. (Measured, soft
            # with CMA, send_bw 1 MiB, 4 same-run pairs: 2.2-3.0 GB/s without, 3.2-4.4
            # with; the next receive copies from staging at memcpy speed.)
            self._read_ahead(self._busy_ahead)
            await _uncancelled(fut)
        return rx.staging

    def _schedule_prefetch(self) -> None:
        """No receive is in progress: read ahead the rendezvous messages that arrived
        meanwhile -- at the end of this loop iteration, so that an application that
        receives again right away has them READ straight into its buffer instead."""
        if not self._prefetch_scheduled:
            self._prefetch_scheduled = True
            self._loop.call_soon(self._prefetch_deferred)

    def _prefetch_deferred(self) -> None:
        self._prefetch_scheduled = False
        if self._receivers or self._failed or self._peer_gone:
            return
        self._read_ahead(self._opts.rndv_prefetch)

    def _read_ahead(self, limit: int) -> None:
        """READ the deferred rendezvous messages into staging, in order, while the
        staged bytes stay within ``limit``."""
        for rx in self._rx:
            if not self._deferred:
                return
            if rx.deferred and rx.read_fut is None:
                if self._prefetched + rx.length > limit:
                    return
                self._start_rndv_read(rx, None)

    def _start_rndv_read(self, rx: _Rx, span: LocalSpan | None) -> asyncio.Future[None]:
        """Post the READ of rendezvous message ``rx`` into ``span`` or a staging lease."""
        if rx.deferred:
            rx.deferred = False
            self._deferred -= 1
        if span is None:
            self.rndv_staged += 1
            rx.staging = self._staging_in.lease(rx.length)
            self._prefetched += rx.length
            target = LocalSpan(rx.staging.mr.addr, rx.length, rx.staging.mr.lkey, rx.staging)
        else:
            rx.staging = None
            target = span
        fut: asyncio.Future[None] = self._loop.create_future()
        # A failure is re-raised to the receiver that awaits it; when none does (it was
        # cancelled, or the READ was a prefetch), do not log it as never retrieved.
        fut.add_done_callback(_consume_exception)
        rx.read_fut = fut
        wrs = self._wr_chunks(WROpcode.RDMA_READ, target, rx.length, rx.addr, rx.rkey)
        for wr in wrs[:-1]:
            self._oneq.append(_Op(_RNDV_READ, None, wr=wr, keep=target))
        self._oneq.append(_Op(_RNDV_READ, fut, wr=wrs[-1], keep=target))
        self._kick()
        if rx.staging is not None:
            fut.add_done_callback(lambda f: self._rndv_staged(rx, f))
        return fut

    def _rndv_staged(self, rx: _Rx, fut: asyncio.Future[None]) -> None:
        """The message is in our staging buffer: release the sender's source now."""
        if not fut.cancelled() and fut.exception() is None and not rx.done_sent:
            rx.done_sent = True
            self._queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    def _consume_data(self, rx: _Rx) -> None:
        self._rx.popleft()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.slot >= 0:  # -1: a BATCH message whose buffer a later one re-posts
            self._repost(rx.slot)

    def _consume_rndv(self, rx: _Rx) -> None:
        self._rx.popleft()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.staging is not None:
            self._prefetched -= rx.length
            rx.staging.release()
            rx.staging = None
        if not rx.done_sent:
            rx.done_sent = True
            self._queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    # ---------------------------------------------------------------- one-sided
    async def write(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA WRITE all of ``local`` (a MemoryRegion or a buffer inside one registered
        with this endpoint) to the start of ``remote``.

        Raises ValueError (unregistered buffer, longer than ``remote``), TypeError,
        RemoteAccessError (peer refused: bad rkey, range, or right), ConnectionClosed.
        """
        span = self._one_sided_span(local, remote, writable=False)
        wrs = self._wr_chunks(WROpcode.RDMA_WRITE, span, span.length, remote.addr, remote.rkey)
        await self._submit_chunks(self._oneq, _WRITE, wrs, span)

    async def read(self, local: Any, remote: RemoteBuffer) -> None:
        """RDMA READ ``len(local)`` bytes from the start of ``remote`` into ``local``.

        Raises as ``write``; ``local`` must be writable.
        """
        span = self._one_sided_span(local, remote, writable=True)
        wrs = self._wr_chunks(WROpcode.RDMA_READ, span, span.length, remote.addr, remote.rkey)
        await self._submit_chunks(self._oneq, _READ, wrs, span)

    async def write_with_imm(self, local: Any, remote: RemoteBuffer, imm: int) -> None:
        """RDMA WRITE with a 32-bit immediate; the peer gets ``imm`` from ``recv_imm()``
        after the data is in place. Consumes one receive credit of the peer."""
        if not 0 <= imm < 1 << 32:
            raise ValueError("imm must be an unsigned 32-bit integer")
        span = self._one_sided_span(local, remote, writable=False)
        self._check_send()
        wrs = self._wr_chunks(WROpcode.RDMA_WRITE, span, span.length, remote.addr, remote.rkey)
        last = wrs[-1]  # the immediate rides on the last piece, after the data is in place
        last.opcode = WROpcode.RDMA_WRITE_WITH_IMM
        last.imm_data = imm
        # All pieces on the send queue, so no other work can pass between them.
        await self._submit_chunks(self._sendq, _WRITE, wrs, span, last_kind=_IMM)

    async def recv_imm(self) -> int:
        """The immediate of the next ``write_with_imm`` from the peer (in order).

        Raises ConnectionClosed like ``recv``.
        """
        while not self._imm:
            if self._failed or self._closing is not None:
                raise self._closed_error()
            if self._remote_closed:
                raise ConnectionClosed("the peer closed the connection")
            await self._wait_on(self._imm_waiters)
        return self._imm.popleft()

    async def fetch_add(self, remote: RemoteBuffer, value: int) -> int:
        """Atomically add ``value`` (mod 2**64) to the 8-byte word at ``remote``;
        returns the old value. ``remote.addr`` must be 8-byte aligned (ValueError)."""
        self._check_atomic(remote)
        wr = SendWR(0, WROpcode.ATOMIC_FETCH_AND_ADD, [], remote_addr=remote.addr,
                    rkey=remote.rkey, compare_add=value & _MASK64)
        result: int = await self._submit(self._oneq, _Op(_ATOMIC, self._loop.create_future(), wr=wr))
        return result

    async def compare_swap(self, remote: RemoteBuffer, expected: int, new: int) -> int:
        """Atomically replace the 8-byte word at ``remote`` with ``new`` if it equals
        ``expected``; returns the old value (the swap happened iff it == expected)."""
        self._check_atomic(remote)
        wr = SendWR(0, WROpcode.ATOMIC_CMP_AND_SWP, [], remote_addr=remote.addr,
                    rkey=remote.rkey, compare_add=expected & _MASK64, swap=new & _MASK64)
        result: int = await self._submit(self._oneq, _Op(_ATOMIC, self._loop.create_future(), wr=wr))
        return result

    def _check_atomic(self, remote: RemoteBuffer) -> None:
        if not isinstance(remote, RemoteBuffer):
            raise TypeError("remote must be a RemoteBuffer")
        if remote.addr % 8:
            raise ValueError(f"atomic target {remote.addr:#x} is not 8-byte aligned")
        if remote.length < 8:
            raise ValueError("atomic target must span at least 8 bytes")
        self._check_open()

    def _one_sided_span(self, local: Any, remote: RemoteBuffer, *, writable: bool) -> LocalSpan:
        if not isinstance(remote, RemoteBuffer):
            raise TypeError("remote must be a RemoteBuffer (from MemoryRegion.remote())")
        self._check_open()
        span = self._regions.resolve(local, writable=writable)
        if span.length > remote.length:
            raise ValueError(f"local buffer of {span.length} bytes is larger than the remote "
                             f"range of {remote.length}")
        return span

    async def _submit(self, q: collections.deque[_Op], op: _Op) -> Any:
        """Queue ``op`` on ``q``, post what resources allow, wait for its completion.

        Cancelled before it was posted: removed, never sent. Cancelled after: it runs
        to completion on the device and its buffers stay pinned until then.
        """
        q.append(op)
        self._kick()
        assert op.fut is not None
        try:
            if self._reactor.in_place:
                return await self._reactor.wait(op.fut, op.posted)
            return await op.fut
        except asyncio.CancelledError:
            if not op.posted:
                self._unqueue(q, op)
            raise

    def _wr_chunks(self, opcode: WROpcode, span: LocalSpan, length: int, remote_addr: int,
                   rkey: int) -> list[SendWR]:
        """The work requests that move ``length`` bytes between ``span`` and the remote
        address: one, or one per ``max_wr_size`` (the port's max_msg_sz) piece."""
        step = self._max_wr
        if length <= step:
            return [SendWR(0, opcode, [SGE(span.addr, length, span.lkey)],
                           remote_addr=remote_addr, rkey=rkey)]
        return [SendWR(0, opcode, [SGE(span.addr + off, min(step, length - off), span.lkey)],
                       remote_addr=remote_addr + off, rkey=rkey)
                for off in range(0, length, step)]

    async def _submit_chunks(self, q: collections.deque[_Op], kind: int, wrs: list[SendWR],
                             span: LocalSpan, *, last_kind: int | None = None) -> None:
        """``_submit`` for an operation posted as several work requests (``_wr_chunks``),
        in order on ``q``: the last one (of ``last_kind``, default ``kind``) carries the
        future; the completions of one QP arrive in order, so it completes after the
        others. A failed piece fails the endpoint, and the last piece then reports it.
        Cancelled before any piece was posted: none is sent; after: all run."""
        if len(wrs) == 1:
            op = _Op(kind if last_kind is None else last_kind, self._loop.create_future(),
                     wr=wrs[0], keep=span)
            await self._submit(q, op)
            return
        ops = [_Op(kind, None, wr=wr, keep=span) for wr in wrs[:-1]]
        q.extend(ops)
        last = _Op(kind if last_kind is None else last_kind, self._loop.create_future(),
                   wr=wrs[-1], keep=span)
        ops.append(last)
        try:
            await self._submit(q, last)
        except asyncio.CancelledError:
            if not any(op.posted for op in ops):
                for op in ops:
                    self._unqueue(q, op)
            elif not last.posted:  # the rest must go, or the operation would be partial
                q.append(last)
                self._kick()
            raise

    # ---------------------------------------------------------------- posting
    def _kick(self) -> None:
        """Post now (the latency fast path) unless something was already posted that
        way since the last completion arrived; then post at the end of this loop
        iteration, everything queued meanwhile as one chain (batching: a burst of
        sends from tasks that one completion woke shares WRs and BATCH frames).

        ``_in_tick`` marks the fast path as used; a completion (the loop turned) or the
        end-of-iteration pump clears it, so no callback per request is needed.
        """
        if self._pump_scheduled:
            return
        if self._in_tick:
            self._pump_scheduled = True
            self._loop.call_soon(self._pump_soon)
        else:
            self._in_tick = True
            self._pump()

    def _pump_soon(self) -> None:
        self._pump_scheduled = False
        self._in_tick = False
        self._pump()

    def _pump(self) -> None:
        """Post as much queued work as send-queue room, buffers and credits allow."""
        if self._failed or self._peer_gone:
            return
        credits = self._credits
        if credits is None:
            return
        batch: list[_Op] = []
        room = self._sq.room
        spool = self._spool
        while self._ctrlq and room > len(batch) and spool.available:
            op = self._ctrlq[0]
            if op.payload[0] == FrameType.CLOSE:
                credits.consume_close()  # its credit is held for it: never waits
            elif credits.can_send_control():
                credits.consume(control=True)
            else:
                break
            self._ctrlq.popleft()
            self._build_ctrl(op)
            batch.append(op)
        while self._oneq and room > len(batch):
            op = self._oneq[0]
            if op.kind == _ATOMIC:
                if not spool.available:
                    break
                op.slot = spool.acquire()
                assert op.slot is not None and op.wr is not None
                op.wr.sg_list = [SGE(spool.addr(op.slot), 8, spool.lkey)]
            self._oneq.popleft()
            batch.append(op)
        while self._sendq and room > len(batch) and credits.can_send_data():
            op = self._sendq[0]
            kind = op.kind
            if kind == _DATA or kind == _RNDV:
                if not spool.available:
                    break
                self._sendq.popleft()
                credits.consume()
                if kind == _RNDV:
                    self._build_rndv(op)
                elif self._batching and self._sendq and self._sendq[0].kind == _DATA:
                    op = self._build_batch(op)
                else:
                    self._build_data(op)
            else:  # _IMM takes a credit; _WRITE (a leading piece of a long one) none
                self._sendq.popleft()
                if kind == _IMM:
                    credits.consume()
            batch.append(op)
        if (credits.should_send_credit() and room > len(batch) and spool.available
                and not self._close_sent):
            op = _Op(_CTRL, None, payload=(FrameType.CREDIT, 0))
            credits.consume(control=True)
            self._build_ctrl(op)
            batch.append(op)
        if batch:
            self._post_batch(batch)

    def _frame_wr(self, op: _Op, nbytes: int) -> SendWR:
        """The SEND of the frame in ``op``'s slot (that slot's WR; _post_batch sets
        wr_id and the signaled flag)."""
        assert op.slot is not None
        wr = self._send_wrs[op.slot]
        wr.sg_list[0].length = nbytes
        wr.send_flags = _INLINE if nbytes <= self._inline_cap else 0
        return wr

    def _build_data(self, op: _Op) -> None:
        assert self._credits is not None
        op.slot = self._spool.acquire()
        assert op.slot is not None
        mv: memoryview = op.payload
        n = mv.nbytes
        buf = self._spool.slot(op.slot, HEADER_SIZE + n)
        write_data_header(buf, self._credits.take_piggyback(), n)
        buf[HEADER_SIZE:] = mv
        op.payload = None  # copied: the caller's buffer is free
        op.wr = self._frame_wr(op, HEADER_SIZE + n)

    def _build_batch(self, first: _Op) -> _Op:
        """Pack ``first`` and the DATA ops after it on the send queue that fit into one
        BATCH frame; returns the op to post (``first`` itself when only it fits)."""
        sendq = self._sendq
        room = self._eager - HEADER_SIZE - BATCH_RECORD - first.payload.nbytes
        members = [first]
        while sendq:
            op = sendq[0]
            if op.kind != _DATA:
                break
            room -= BATCH_RECORD + op.payload.nbytes
            if room < 0:
                break
            members.append(sendq.popleft())
        if len(members) == 1:
            self._build_data(first)
            return first
        assert self._credits is not None
        self.messages_batched += len(members)
        carrier = _Op(_BATCH, None, payload=members)
        slot = carrier.slot = self._spool.acquire()
        assert slot is not None
        buf = self._spool.slot(slot)
        n = write_batch(buf, self._credits.take_piggyback(), [op.payload for op in members])
        for op in members:
            op.payload = None  # copied: the caller's buffer is free
        carrier.wr = self._frame_wr(carrier, n)
        return carrier

    def _build_rndv(self, op: _Op) -> None:
        assert self._credits is not None
        op.slot = self._spool.acquire()
        assert op.slot is not None
        src = op.payload
        if isinstance(src, Staging):
            addr, rkey, length = src.mr.addr, src.mr.rkey, src.length
        else:
            region = src.keep[1]
            addr, rkey, length = src.addr, region.rkey, src.length
        buf = self._spool.slot(op.slot)
        n = write_rndv(buf, self._credits.take_piggyback(), op.msg_id, length, addr, rkey)
        self._rndv_out[op.msg_id] = op
        op.wr = self._frame_wr(op, n)

    def _build_ctrl(self, op: _Op) -> None:
        assert self._credits is not None
        op.slot = self._spool.acquire()
        assert op.slot is not None
        ftype, arg = op.payload
        buf = self._spool.slot(op.slot)
        credits = self._credits.take_piggyback()
        if ftype == FrameType.RNDV_DONE:
            n = write_rndv_done(buf, credits, arg, True)
        elif ftype == FrameType.CLOSE:
            n = write_close(buf, credits)
        else:
            n = write_credit(buf, credits)
        op.wr = self._frame_wr(op, n)

    def _post_batch(self, batch: list[_Op]) -> None:
        """Post ``batch`` in one call. Signaled: the last op somebody waits for (every
        op before it completes with it), plus what ``SendQueue.push`` asks for. Frames
        nobody waits for (RNDV, whose sender waits for RNDV_DONE; CREDIT; RNDV_DONE) go
        unsignaled after it, until our CLOSE: a later signaled WR (CLOSE at the latest,
        which close() waits for) retires them, and a failed one completes anyway."""
        reactor = self._reactor
        wrs: list[SendWR] = []
        last = len(batch) - 1
        credits = self._credits
        if credits is not None and not credits.close_sent:
            while last >= 0:
                op = batch[last]
                if op.kind == _RNDV or (op.kind == _CTRL and op.payload[0] != FrameType.CLOSE):
                    last -= 1
                else:
                    break
        for i, op in enumerate(batch):
            wr = op.wr
            assert wr is not None
            wr.wr_id = reactor.register(self._on_send_wc, None)
            sg = wr.sg_list
            nbytes = sg[0].length if len(sg) == 1 else sum(s.length for s in sg)
            if self._sq.push(wr.wr_id, op, last_in_batch=i == last, nbytes=nbytes):
                wr.send_flags = int(wr.send_flags) | _SIGNALED
            else:
                wr.send_flags = int(wr.send_flags) & ~_SIGNALED
            op.posted = True
            if op.kind == _BATCH:
                for m in op.payload:
                    m.posted = True
            wrs.append(wr)
        self.work_requests_posted += len(wrs)
        try:
            self._qp.post_send(wrs)
        except RDMAError as exc:
            for wr in wrs:
                reactor.unregister(wr.wr_id)
            for _wr_id, op in self._sq.drain():
                self._finish(op, None, exc)
            self._fail(exc)
            return
        for op in batch:
            if op.slot is not None and op.wr is not None and int(op.wr.send_flags) & _INLINE:
                self._spool.release(op.slot)  # inline: the device copied it at post time
                op.slot = None
        reactor.poke()

    def _queue_ctrl(self, ftype: FrameType, arg: int) -> None:
        if self._failed:
            return
        self._ctrlq.append(_Op(_CTRL, None, payload=(ftype, arg)))
        self._kick()

    @staticmethod
    def _unqueue(q: collections.deque[_Op], op: _Op) -> None:
        try:
            q.remove(op)
        except ValueError:
            pass

    # ---------------------------------------------------------------- completions
    def _on_send_wc(self, wc: WC, _arg: Any) -> None:
        entries = self._sq.complete(wc.wr_id)
        if not entries:
            self._in_tick = False
            return
        last = len(entries) - 1
        # One finished send (a round trip): the next one may go at once. Several (a
        # window of senders wakes up): what they send next is batched at the end of
        # the iteration instead of the first going alone.
        self._in_tick = last > 0 or entries[0][1].kind == _BATCH
        for i, (wr_id, op) in enumerate(entries):
            if i < last:
                self._reactor.unregister(wr_id)
                self._finish(op, None, None)
            else:
                self._finish(op, wc, None)
        if self._failed:
            self._check_drained()
        elif self._sendq or self._oneq or self._ctrlq:
            self._pump()
        if self._closing is not None and not self._ops_pending():
            self._wake_closer()

    def _finish(self, op: _Op, wc: WC | None, exc: BaseException | None) -> None:
        """Complete ``op``: ``wc`` None means an unsignaled success; ``exc`` a local error."""
        if op.slot is not None:
            if op.kind == _ATOMIC and exc is None and (wc is None or wc.status == WCStatus.SUCCESS):
                old = _U64.unpack_from(self._spool.view, op.slot * self._spool.slot_size)[0]
            else:
                old = 0
            self._spool.release(op.slot)
            op.slot = None
        else:
            old = 0
        if exc is None and wc is not None and wc.status != WCStatus.SUCCESS:
            exc = self._op_error(wc)
        fut = op.fut
        if op.kind == _BATCH:
            for m in op.payload:
                if m.fut is not None and not m.fut.done():
                    if exc is None:
                        m.fut.set_result(None)
                    else:
                        m.fut.set_exception(exc)
            return
        if op.kind == _RNDV:
            src = op.payload
            if exc is not None:
                self._rndv_out.pop(op.msg_id, None)
                self._release_source(src)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
            return  # success: the user's future completes on RNDV_DONE
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        elif op.kind == _ATOMIC:
            fut.set_result(old)
        else:
            fut.set_result(None)

    @staticmethod
    def _release_source(src: Any) -> None:
        if isinstance(src, Staging):
            src.release()

    def _op_error(self, wc: WC) -> BaseException:
        """The exception for an op whose completion failed; fails the endpoint."""
        err = completion_error(wc.status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                               opcode=wc.opcode)
        if wc.status == WCStatus.WR_FLUSH_ERR:
            if not self._failed:
                self._fail(err)
            return self._closed_error()
        first = self._first_error is None
        self._fail(err)
        if wc.status in _PEER_GONE or not first:
            return self._closed_error()
        return err

    def _on_recv_wc(self, wc: WC, slot: int) -> None:
        self._in_tick = False
        self._posted_recvs -= 1
        if wc.status != WCStatus.SUCCESS:
            self._rpool.release(slot)
            if wc.status != WCStatus.WR_FLUSH_ERR or not self._failed:
                self._fail(completion_error(wc.status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                                            opcode=wc.opcode))
            self._check_drained()
            return
        if self._failed:
            self._rpool.release(slot)
            self._check_drained()
            return
        if wc.opcode == WCOpcode.RECV_RDMA_WITH_IMM:
            self._imm.append(wc.imm_data)
            self._wake(self._imm_waiters)
            self._repost(slot)
            return
        pool = self._rpool
        base = slot * pool.slot_size
        credits = self._credits
        assert credits is not None
        try:
            frame = parse_frame(pool.view[base: base + pool.slot_size], wc.byte_len,
                                self.max_message_size)
            if frame.credits:
                credits.on_credits(frame.credits)
        except RemoteProtocolError as exc:
            self._rpool.release(slot)
            self._fail(exc)
            return
        ftype = frame.type
        if ftype == FrameType.DATA:
            self._rx.append(_Rx(_RX_DATA, slot=slot, offset=base + frame.payload_offset,
                                length=frame.payload_len))
            self._wake(self._rx_waiters)
        elif ftype == FrameType.BATCH:
            try:
                records = batch_records(pool.view[base: base + pool.slot_size], wc.byte_len,
                                        frame.aux, self.max_message_size)
            except RemoteProtocolError as exc:
                self._rpool.release(slot)
                self._fail(exc)
                return
            # one buffer, many messages: the last one's consumption re-posts it
            rxq = self._rx
            last = len(records) - 1
            for i, (off, n) in enumerate(records):
                rxq.append(_Rx(_RX_DATA, slot if i == last else -1, base + off, n))
            self._wake(self._rx_waiters)
            # a burst: the sender waits for this frame's acknowledgement to send more,
            # and no answer will carry it soon
            self._reactor.expedite()
        elif ftype == FrameType.RNDV:
            rx = _Rx(_RX_RNDV, length=frame.rndv_length, addr=frame.rndv_addr,
                     rkey=frame.rndv_rkey, msg_id=frame.aux)
            self._rx.append(rx)
            self._repost(slot)
            if self._rx_waiters:
                self._wake(self._rx_waiters)  # the waiting receiver picks the destination
            elif self._prefetched + rx.length <= (self._busy_ahead if self._receivers
                                                  else self._opts.rndv_prefetch):
                # buffer it now, like a TCP receive buffer (while a receive is in
                # progress, within the smaller budget that keeps the link busy)
                self._start_rndv_read(rx, None)
            else:
                # the read-ahead budget is spent: a receiver READs it straight into its
                # buffer, or it is read ahead once there is room (_read_ahead)
                rx.deferred = True
                self._deferred += 1
        elif ftype == FrameType.RNDV_DONE:
            self._repost(slot)
            op = self._rndv_out.pop(frame.aux, None)
            if op is None:
                self._fail(RemoteProtocolError(f"RNDV_DONE for unknown message {frame.aux}"))
                return
            self._release_source(op.payload)
            if op.fut is not None and not op.fut.done():
                op.fut.set_result(None)
            if self._closing is not None and not self._ops_pending():
                self._wake_closer()
        elif ftype == FrameType.CLOSE:
            self._remote_closed = True
            self._rx.append(_Rx(_RX_EOF))
            self._repost(slot)
            self._wake(self._rx_waiters)
            self._wake(self._imm_waiters)
        else:  # CREDIT
            self._repost(slot)
        if self._sendq or self._ctrlq:
            self._pump()

    def _post_recv_slot(self, slot: int) -> None:
        self._post_recv_slots([slot])

    def _post_recv_slots(self, slots: list[int]) -> None:
        """Post receive buffers ``slots`` (one post_recv call for all of them)."""
        pool = self._rpool
        register = self._reactor.register
        on_wc = self._on_recv_wc
        wrs = [self._recv_wrs[slot] for slot in slots]
        for wr, slot in zip(wrs, slots, strict=True):
            wr.wr_id = register(on_wc, slot)
        try:
            self._qp.post_recv(wrs)
        except RDMAError:
            for wr, slot in zip(wrs, slots, strict=True):
                self._reactor.unregister(wr.wr_id)
                pool.release(slot)
            raise
        self._posted_recvs += len(wrs)

    def _repost(self, slot: int) -> None:
        """Give a consumed receive buffer back to the peer (one more credit owed).

        Buffers are posted ``repost_batch`` at a time, with one post for all of them;
        fewer wait at any time (credits rule 6: so few that the peer can never be left
        without credit because of them).
        """
        if self._failed or self._done.done():
            self._rpool.release(slot)
            return
        q = self._repost_q
        q.append(slot)
        if len(q) >= self._repost_batch:
            self._flush_reposts()

    def _flush_reposts(self) -> None:
        slots = self._repost_q
        if not slots:
            return
        self._repost_q = []
        if self._failed or self._done.done():
            for slot in slots:
                self._rpool.release(slot)
            return
        try:
            self._post_recv_slots(slots)
        except RDMAError as exc:
            self._fail(exc)
            return
        credits = self._credits
        if credits is not None:
            credits.on_reposted(len(slots))
            if credits.should_send_credit():
                self._kick()

    @staticmethod
    def _wake(waiters: list[asyncio.Future[None]]) -> None:
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        waiters.clear()

    # ---------------------------------------------------------------- state, failure
    def _check_open(self) -> None:
        if self._failed or self._closing is not None:
            raise self._closed_error()

    def _check_send(self) -> None:
        self._check_open()
        if self._eof is not None:
            raise ConnectionClosed("cannot send after send_eof()")
        if self._peer_gone:
            raise ConnectionClosed("the peer closed the connection")
        if self._credits is None:
            raise ConnectionClosed("endpoint is not connected")

    def _closed_error(self) -> ConnectionClosed:
        if self._first_error is not None:
            if isinstance(self._first_error, ConnectionClosed):
                exc = ConnectionClosed(self._first_error.strerror or "connection closed")
                exc.__cause__ = self._first_error.__cause__
                return exc
            first = self._first_error
            why = first.strerror if isinstance(first, OSError) and first.strerror else first
            exc = ConnectionClosed(f"connection failed: {why}")
            exc.__cause__ = self._first_error
            return exc
        return ConnectionClosed("endpoint is closed")

    def _ops_pending(self) -> bool:
        return bool(self._sq.awaited or self._sendq or self._oneq or self._ctrlq or self._rndv_out)

    def _fail_queued(self, error: Callable[[], BaseException]) -> None:
        """Drop every operation not posted yet (control, one-sided and send queues):
        release its rendezvous source and fail its future with ``error()``."""
        for q in (self._ctrlq, self._oneq, self._sendq):
            while q:
                op = q.popleft()
                if op.kind == _RNDV:
                    self._release_source(op.payload)
                if op.fut is not None and not op.fut.done():
                    op.fut.set_exception(error())

    def _fail(self, exc: BaseException) -> None:
        """The single failure path: record the first error, QP to ERR, fail every waiter.

        Posted WRs complete later with WR_FLUSH_ERR; their buffers stay pinned until then.
        """
        if self._failed:
            return
        self._failed = True
        if self._first_error is None:
            self._first_error = exc
        if isinstance(exc, CompletionError | RemoteProtocolError) and not isinstance(
                exc, RetryExceededError | RNRRetryExceededError | FlushedError):
            log.warning("aiordma: %r failed: %s", self, exc)
        try:
            self._qp.modify(QPAttr(QPState.ERR))
        except RDMAError:
            pass
        self._post_flush_marker()
        err = self._closed_error()
        self._fail_queued(lambda: err)
        for op in self._posted_ops():
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(self._closed_error())
        for op in self._rndv_out.values():
            if op.fut is not None and not op.fut.done():
                op.fut.set_exception(self._closed_error())
        for rx in self._rx:
            if rx.read_fut is not None and not rx.read_fut.done():
                rx.read_fut.set_exception(self._closed_error())
        self._wake(self._rx_waiters)
        self._wake(self._imm_waiters)
        self._wake_closer()
        if self._control is not None:
            self._control.close()
        self._start_teardown()
        self._check_drained()

    def _post_flush_marker(self) -> None:
        """The QP is in ERR. Unsignaled WRs after the last signaled one (frames nobody
        waits for) may have finished without a completion: a signaled zero-length SEND
        posted now is flushed after every one of them, so its completion retires them
        and the drain waits for exactly that (RELIABILITY.md: the marker WR)."""
        sq = self._sq
        if not sq.used or sq.awaited or not sq.room:
            return
        reactor = self._reactor
        wr = SendWR(reactor.register(self._on_send_wc, None), _SEND, [], _SIGNALED)
        try:
            self._qp.post_send([wr])
        except RDMAError:  # the QP is gone: the teardown destroys it without waiting
            reactor.unregister(wr.wr_id)
            return
        self.work_requests_posted += 1
        sq.push(wr.wr_id, _Op(_CTRL, None, payload=(FrameType.CREDIT, 0)), last_in_batch=True)

    def _posted_ops(self) -> list[_Op]:
        """The ops on the send queue, the messages of BATCH frames listed one by one."""
        out: list[_Op] = []
        for _wr_id, op in self._sq._q:
            if op.kind == _BATCH:
                out.extend(op.payload)
            else:
                out.append(op)
        return out

    def _check_drained(self) -> None:
        # (unsignaled WRs after the last signaled one may never complete: the QP is
        # destroyed before their buffers are freed, see _destroy_now)
        if (self._failed and not self._sq.awaited and not self._posted_recvs
                and not self._drained.done()):
            self._drained.set_result(None)

    def _wake_closer(self) -> None:
        if self._closing is not None and not self._closing.done():
            self._closing.set_result(None)

    def _start_teardown(self) -> None:
        if self._teardown_task is None:
            self._teardown_task = self._loop.create_task(self._teardown())

    async def _teardown(self) -> None:
        """Destroy in the order that cannot hang: QP to ERR, wait for every flush, then
        destroy QP, MRs, CQ reservation, PD; release the device. Cancelled (the loop is
        shutting down), it destroys at once without waiting for the flush."""
        try:
            if not self._failed:
                self._fail(ConnectionClosed("endpoint is closed"))
            try:
                await _uncancelled(self._drained, self._opts.close_timeout)
            except TimeoutError:
                log.warning("aiordma: %r: flush did not complete in %.1fs; destroying anyway",
                            self, self._opts.close_timeout)
        finally:
            self._destroy_now()

    def _destroy_now(self) -> None:
        """Destroy every resource now (idempotent; sync, so it also runs from a cancelled
        task or close()). Safe without the flush: once the QP is destroyed the device no
        longer touches our buffers, and the reactor drops completions of unknown wr_ids."""
        if self._done.done():
            return
        task = self._teardown_task
        if task is not None and not task.done() and task is not asyncio.current_task():
            task.cancel()  # it only waits for the flush; its finally finds us done
        try:
            if self._watch_task is not None and not self._watch_task.done():
                self._watch_task.cancel()
            for _wr_id, op in self._sq.drain():
                self._reactor.unregister(_wr_id)
                if op.kind == _RNDV:
                    self._release_source(op.payload)
            for op in self._rndv_out.values():
                self._release_source(op.payload)
            self._rndv_out.clear()
            for rx in self._rx:
                if rx.staging is not None:
                    rx.staging.release()
            self._rx.clear()
            if self._posted_recvs:  # not flushed: their completions must find no handler
                self._reactor.unregister_owner(self)
                self._posted_recvs = 0
            self._destroy_resources()
        finally:
            self._done.set_result(None)

    def _on_async_event(self, ev: AsyncEvent) -> None:
        """A fatal async event for our QP (or the whole port/device) kills the connection."""
        if ev.event_type in (EventType.COMM_EST, EventType.SQ_DRAINED,
                             EventType.QP_LAST_WQE_REACHED):
            return
        self._fail(ConnectionClosed(f"device reported {ev.event_type} for this connection"))

    def _destroy_resources(self) -> None:
        if hasattr(self, "_qp"):
            self._device.unwatch_qp(self._qp.qp_num)
        for region in self._regions.regions() if hasattr(self, "_regions") else []:
            region.close()
        for name in ("_qp", "_staging_out", "_staging_in", "_spool", "_rpool"):
            obj = getattr(self, name, None)
            if obj is None:
                continue
            delattr(self, name)
            if isinstance(obj, StagingCache):
                self._staging_registered += obj.registrations  # (statistics)
            try:
                obj.close()
            except RDMAError as exc:
                log.warning("aiordma: closing %s failed: %s", name, exc)
        if hasattr(self, "_cq"):
            self._reactor.release_cq(self._cq, self._cq_entries)
        pd = getattr(self, "_pd", None)
        if pd is not None:
            delattr(self, "_pd")
            try:
                pd.close()
            except RDMAError as exc:
                log.warning("aiordma: dealloc PD failed: %s", exc)
        self._device.release()

    # ---------------------------------------------------------------- close / abort
    async def close(self) -> None:
        """Graceful close: queued and posted sends complete, then the peer gets EOF
        (its ``recv`` raises ConnectionClosed after everything sent before), then the
        resources are destroyed (after ``send_eof()`` the peer already has its EOF).
        Idempotent; waits at most ``close_timeout`` for the pending sends, then aborts."""
        if self._closing is None and not self._failed:
            self._closing = self._loop.create_future()
            if not self._ops_pending():
                self._closing.set_result(None)
            try:
                await _uncancelled(self._closing, self._opts.close_timeout)
                if not self._failed and self._credits is not None and not self._peer_gone:
                    await self._send_close_frame()
            except (TimeoutError, RDMAError):
                pass
            except asyncio.CancelledError:
                # Nobody waits any more (e.g. asyncio.run() cancelling what is left at
                # exit): abort and destroy now, so nothing is left for the GC to destroy
                # (with unacknowledged events, ibv_destroy_cq would block the exit).
                self.abort()
                self._destroy_now()
                raise
            self._wake(self._rx_waiters)
            self._wake(self._imm_waiters)
            if not self._failed:
                self._fail(ConnectionClosed("endpoint is closed"))
        self._start_teardown()
        try:
            await _uncancelled(self._done)
        except asyncio.CancelledError:
            self._destroy_now()  # as above: do not leave it to a task that may never run
            raise

    async def _send_close_frame(self) -> None:
        self._close_sent = True
        self._post_eof()  # no-op when send_eof() already queued it
        assert self._eof is not None
        await _uncancelled(self._eof, self._opts.close_timeout)

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
        if self._credits is None:
            raise ConnectionClosed("endpoint is not connected")
        if self._eof is None:
            pending = [op.fut for op in (*self._sendq, *self._posted_ops(),
                                         *self._rndv_out.values())
                       if op.kind in (_DATA, _RNDV, _IMM) and op.fut is not None
                       and not op.fut.done()]
            self._new_eof()
            left = len(pending)

            def sent(_f: asyncio.Future[Any]) -> None:
                nonlocal left
                left -= 1
                if not left:
                    self._post_eof()

            for f in pending:
                f.add_done_callback(sent)
            if not pending:
                self._post_eof()
        assert self._eof is not None
        await _uncancelled(self._eof)

    def _new_eof(self) -> asyncio.Future[None]:
        if self._eof is None:
            self._eof = self._loop.create_future()
            # Nobody may wait for it (a cancelled send_eof): never warn "never retrieved".
            self._eof.add_done_callback(lambda f: f.cancelled() or f.exception())
        return self._eof

    def _post_eof(self) -> None:
        """Queue our CLOSE frame once (it completes ``self._eof``); after a failure,
        fail ``self._eof`` instead."""
        eof = self._new_eof()
        if self._eof_queued or eof.done():
            return
        if self._failed or self._peer_gone:
            eof.set_exception(self._closed_error() if self._failed
                              else ConnectionClosed("the peer closed the connection"))
            return
        self._eof_queued = True
        self._ctrlq.append(_Op(_CTRL, eof, payload=(FrameType.CLOSE, 0)))
        self._kick()

    def abort(self) -> None:
        """Immediate close: every pending operation fails with ConnectionClosed now;
        the peer sees the connection drop. Idempotent."""
        if self._closing is None:
            self._closing = self._loop.create_future()
            self._closing.set_result(None)
        self._fail(ConnectionClosed("endpoint was aborted"))

    async def wait_closed(self) -> None:
        """Wait until every resource of the endpoint is destroyed."""
        await _uncancelled(self._done)

    async def __aenter__(self) -> Endpoint:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
