"""The receive side of the message engine (sans-IO): posted receive buffers, the frames
they bring, the queue of messages for the application, and rendezvous READs.

Every receive completion carries one frame (``framing.py``). DATA and BATCH messages
are queued where they landed (their buffer is re-posted once the application consumed
the last message in it); a RNDV announcement is queued and its READ started at once
when the read-ahead budget allows (``rndv_prefetch`` bytes while nobody receives,
``busy_ahead`` while a receive is in progress, like a TCP receive buffer), else when a
receiver asks for it (straight into a registered buffer of its own) or the budget
frees up. RNDV_DONE finishes one of our rendezvous sends, CLOSE queues the peer's EOF,
CREDIT only returns credits (every frame may carry some).

Consumed buffers are re-posted ``repost_batch`` at a time with one post for all of
them (``credits.py`` rule 6: so few wait that the peer is never left without credit).
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any, Final

from aiordma.errors import RDMAError, completion_error
from aiordma.verbs.wr import WC

from .errors import RemoteProtocolError
from .framing import FrameType, batch_records, parse_frame
from .ops import RNDV_READ, RX_DATA, RX_EOF, RX_RNDV, Op, Rx, Waiter, wake
from .slots import Slots
from .state import Event, Remote

if TYPE_CHECKING:
    from .engine import MessageEngine

_SUCCESS: Final = 0
_FLUSHED: Final = 5
_RECV_RDMA_WITH_IMM: Final = 129  # ibv_wc_opcode IBV_WC_RECV_RDMA_WITH_IMM


class Receiver:
    """The receive buffers and received messages of one connection.

    ``rpool``: the receive buffers (``view``, ``slot_size``, ``release``; the first two
    are read once, here: they do not change for the pool's life); the engine's
    port posts them (``post_recv``). ``rx``: messages for the application, oldest first;
    ``rx_waiters``/``imm_waiters``: waiters woken when something arrives.
    """

    def __init__(self, engine: MessageEngine, rpool: Slots, repost_batch: int,
                 rndv_prefetch: int, busy_ahead: int) -> None:
        self.e = engine
        self.rpool = rpool
        self._rview: memoryview = rpool.view
        self._rslot: int = rpool.slot_size
        self.repost_batch = repost_batch
        self.rndv_prefetch = rndv_prefetch
        self.busy_ahead = busy_ahead
        self.posted = 0  # receive WRs posted and not completed
        self._repost_q: list[int] = []
        self.rx: deque[Rx] = deque()
        self.rx_waiters: list[Waiter] = []
        self.imm: deque[int] = deque()
        self.imm_waiters: list[Waiter] = []
        self.receivers = 0  # recv/recv_into calls in progress (maintained by the caller)
        self.prefetched = 0  # bytes of rendezvous messages read ahead into staging
        self.deferred = 0  # rendezvous messages queued without a READ (rx.deferred)
        self._prefetch_scheduled = False
        self.messages_received = 0
        self.bytes_received = 0
        self.rndv_staged = 0

    # ---------------------------------------------------------------- buffers
    def post(self, slots: list[int]) -> None:
        """Post receive buffers ``slots`` (one post for all). Raises RDMAError."""
        self.e.port.post_recv(slots)
        self.posted += len(slots)

    def repost(self, slot: int) -> None:
        """Give a consumed receive buffer back to the peer (one more credit owed)."""
        e = self.e
        if e.state.failed or e.port.destroyed:
            self.rpool.release(slot)
            return
        q = self._repost_q
        q.append(slot)
        if len(q) >= self.repost_batch:
            self.flush_reposts()

    def flush_reposts(self) -> None:
        slots = self._repost_q
        if not slots:
            return
        self._repost_q = []
        e = self.e
        if e.state.failed or e.port.destroyed:
            for slot in slots:
                self.rpool.release(slot)
            return
        try:
            self.post(slots)
        except RDMAError as exc:
            e.fail(exc)
            return
        credits = e.credits
        if credits is not None:
            credits.on_reposted(len(slots))
            if credits.should_send_credit():
                e.tx.kick()

    # ---------------------------------------------------------------- completions
    def on_wc(self, wc: WC, slot: int) -> None:
        """The receive completion ``wc`` of buffer ``slot``: the reactor's handler of
        every receive work request."""
        e = self.e
        e.tx.in_tick = False
        self.posted -= 1
        if wc.status != _SUCCESS:
            self.rpool.release(slot)
            if wc.status != _FLUSHED or not e.state.failed:
                e.fail(completion_error(wc.status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                                        opcode=wc.opcode))
            e.port.check_drained()
            return
        if e.state.failed:
            self.rpool.release(slot)
            e.port.check_drained()
            return
        if wc.opcode == _RECV_RDMA_WITH_IMM:
            self.imm.append(wc.imm_data)
            wake(self.imm_waiters)
            self.repost(slot)
            return
        size = self._rslot
        base = slot * size
        credits = e.credits
        assert credits is not None
        try:
            frame = parse_frame(self._rview[base: base + size], wc.byte_len,
                                e.max_message_size)
            if frame.credits:
                credits.on_credits(frame.credits)
            ftype = frame.type
            if ftype == FrameType.CLOSE:
                e.state.handle(Event.RECV_CLOSE)
            elif ftype in (FrameType.DATA, FrameType.BATCH, FrameType.RNDV):
                e.state.handle(Event.RECV_DATA)
        except RemoteProtocolError as exc:
            self.rpool.release(slot)
            e.fail(exc)
            return
        if ftype == FrameType.DATA:
            self.rx.append(Rx(RX_DATA, slot=slot, offset=base + frame.payload_offset,
                              length=frame.payload_len))
            wake(self.rx_waiters)
        elif ftype == FrameType.BATCH:
            try:
                records = batch_records(self._rview[base: base + size], wc.byte_len,
                                        frame.aux, e.max_message_size)
            except RemoteProtocolError as exc:
                self.rpool.release(slot)
                e.fail(exc)
                return
            # one buffer, many messages: the last one's consumption re-posts it
            rxq = self.rx
            last = len(records) - 1
            for i, (off, n) in enumerate(records):
                rxq.append(Rx(RX_DATA, slot if i == last else -1, base + off, n))
            wake(self.rx_waiters)
            # a burst: the sender waits for this frame's acknowledgement to send more,
            # and no answer will carry it soon
            e.port.expedite()
        elif ftype == FrameType.RNDV:
            self._on_rndv(Rx(RX_RNDV, length=frame.rndv_length, addr=frame.rndv_addr,
                             rkey=frame.rndv_rkey, msg_id=frame.aux), slot)
        elif ftype == FrameType.RNDV_DONE:
            self.repost(slot)
            op = e.tx.rndv_out.pop(frame.aux, None)
            if op is None:
                e.fail(RemoteProtocolError(f"RNDV_DONE for unknown message {frame.aux}"))
                return
            e.port.release_source(op.payload)
            if op.fut is not None and not op.fut.done():
                op.fut.set_result(None)
            e.port.maybe_closed()
        elif ftype == FrameType.CLOSE:
            self.rx.append(Rx(RX_EOF))
            self.repost(slot)
            wake(self.rx_waiters)
            wake(self.imm_waiters)
        else:  # CREDIT
            self.repost(slot)
        tx = e.tx
        if tx.sendq or tx.ctrlq:
            tx.pump()

    def _on_rndv(self, rx: Rx, slot: int) -> None:
        self.rx.append(rx)
        self.repost(slot)
        if self.rx_waiters:
            wake(self.rx_waiters)  # the waiting receiver picks the destination
        elif self.prefetched + rx.length <= (self.busy_ahead if self.receivers
                                             else self.rndv_prefetch):
            # buffer it now, like a TCP receive buffer (while a receive is in progress,
            # within the smaller budget that keeps the link busy)
            self.start_read(rx, None)
        else:
            # the read-ahead budget is spent: a receiver READs it straight into its
            # buffer, or it is read ahead once there is room (read_ahead)
            rx.deferred = True
            self.deferred += 1

    # ---------------------------------------------------------------- consuming
    def consume_data(self, rx: Rx) -> None:
        """The application took DATA message ``rx`` (the receive queue's head)."""
        self.rx.popleft()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.slot >= 0:  # -1: a BATCH message whose buffer a later one re-posts
            self.repost(rx.slot)

    def consume_rndv(self, rx: Rx) -> None:
        """The application took rendezvous message ``rx``: release its staging, tell the
        sender (RNDV_DONE) unless that went already."""
        self.rx.popleft()
        self.messages_received += 1
        self.bytes_received += rx.length
        if rx.staging is not None:
            self.prefetched -= rx.length
            rx.staging.release()
            rx.staging = None
        if not rx.done_sent:
            rx.done_sent = True
            self.e.tx.queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    # ---------------------------------------------------------------- rendezvous reads
    def start_read(self, rx: Rx, span: Any) -> Waiter:
        """Queue the READ of rendezvous message ``rx`` into ``span`` (a LocalSpan: addr,
        length, lkey) or a staging lease; returns the waiter of its completion."""
        e = self.e
        port = e.port
        if rx.deferred:
            rx.deferred = False
            self.deferred -= 1
        if span is None:
            self.rndv_staged += 1
            rx.staging = port.lease_staging(rx.length)
            self.prefetched += rx.length
            target = port.staging_span(rx.staging, rx.length)
        else:
            rx.staging = None
            target = span
        fut = port.new_waiter(quiet=True)
        rx.read = fut
        wrs = port.read_wrs(target, rx.length, rx.addr, rx.rkey)
        tx = e.tx
        for wr in wrs[:-1]:
            tx.oneq.append(Op(RNDV_READ, None, wr=wr, keep=target))
        tx.oneq.append(Op(RNDV_READ, fut, wr=wrs[-1], keep=target))
        tx.kick()
        if rx.staging is not None:
            port.when_done(fut, lambda ok: self._staged(rx, ok))
        return fut

    def _staged(self, rx: Rx, ok: bool) -> None:
        """The message is in our staging buffer: release the sender's source now."""
        if ok and not rx.done_sent:
            rx.done_sent = True
            self.e.tx.queue_ctrl(FrameType.RNDV_DONE, rx.msg_id)

    def read_ahead(self, limit: int) -> None:
        """READ the deferred rendezvous messages into staging, in order, while the staged
        bytes stay within ``limit``."""
        for rx in self.rx:
            if not self.deferred:
                return
            if rx.deferred and rx.read is None:
                if self.prefetched + rx.length > limit:
                    return
                self.start_read(rx, None)

    def receive_done(self) -> None:
        """A recv/recv_into call ended (``receivers`` already lowered): with nobody
        receiving, read ahead what was deferred, at the end of this loop iteration (an
        application that receives again at once gets it READ into its buffer instead)."""
        if not self.receivers and self.deferred and not self._prefetch_scheduled:
            self._prefetch_scheduled = True
            self.e.port.later(self._prefetch_deferred)

    def _prefetch_deferred(self) -> None:
        self._prefetch_scheduled = False
        st = self.e.state
        if self.receivers or st.failed or st.remote is Remote.GONE:
            return
        self.read_ahead(self.rndv_prefetch)
