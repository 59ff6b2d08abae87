"""The send side of the message engine (sans-IO): queued operations, what to post when,
the frames, and what each send completion finishes.

Three queues feed the send queue of the QP, in this order at every pump: control
frames (CLOSE, RNDV_DONE, CREDIT), one-sided work (READ, WRITE, atomics, the READs of
rendezvous receives), then two-sided messages (DATA, RNDV, WRITE_WITH_IMM and the
WRITE pieces before it). Each takes send-queue room; frames take an eager send buffer
and a receive credit of the peer (``credits.py``: CLOSE has its own, control frames
may use the reserve). A pump posts everything it can as one chain.

Posting policy (``kick``): post at once (the latency fast path) unless something was
posted that way since the last completion came in; then post at the end of this loop
iteration, everything queued meanwhile together (batching: a burst of sends woken by
one completion shares work requests and BATCH frames).

Signaling (``_post``): the last operation somebody waits for is signaled (every one
before it completes with it), plus what ``SendQueue.push`` asks for. Frames nobody
waits for (RNDV, whose sender waits for RNDV_DONE; CREDIT; RNDV_DONE) go unsignaled
after it, until our CLOSE: a later signaled WR retires them, and a failed one
completes anyway.
"""

from __future__ import annotations

import itertools
import struct
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final

from aiordma.errors import RDMAError, completion_error
from aiordma.verbs.wr import WC, SendWR

from .framing import (
    BATCH_RECORD,
    HEADER_SIZE,
    FrameType,
    write_batch,
    write_close,
    write_credit,
    write_data_header,
    write_rndv,
    write_rndv_done,
)
from .ops import ATOMIC, BATCH, CTRL, DATA, IMM, RNDV, Op
from .sendq import SendQueue
from .slots import Slots
from .state import Local, Remote

if TYPE_CHECKING:
    from .engine import MessageEngine

_U64: Final = struct.Struct("<Q")
# ibv_send_flags / ibv_wc_status values (verbs enums; protocol/ imports no provider)
SIGNALED: Final = 2
INLINE: Final = 8
_SUCCESS: Final = 0
_FLUSHED: Final = 5
_PEER_GONE_STATUSES: Final = frozenset({12, 13})  # RETRY_EXC_ERR, RNR_RETRY_EXC_ERR


class Sender:
    """The send queues of one connection and their posting (see the module doc).

    ``spool``: the eager send buffers (``acquire``/``release``/``slot``/``addr``/``view``,
    ``available``, ``lkey``, ``slot_size``); ``frame_wrs``: one reusable SEND work
    request per buffer (a provider ``SendWR`` with one SGE: the engine sets its length,
    flags and wr_id).
    """

    def __init__(self, engine: MessageEngine, spool: Slots, frame_wrs: list[SendWR],
                 sq: SendQueue) -> None:
        self.e = engine
        self.spool = spool
        self.frame_wrs = frame_wrs
        self.sq = sq
        self.ctrlq: deque[Op] = deque()
        self.oneq: deque[Op] = deque()
        self.sendq: deque[Op] = deque()
        self.rndv_out: dict[int, Op] = {}  # msg_id -> its RNDV op, until RNDV_DONE
        self._msg_ids = itertools.count(1)
        self.in_tick = False  # the post fast path was used since the last completion
        self._pump_scheduled = False
        self.messages_batched = 0
        self.work_requests_posted = 0

    def next_msg_id(self) -> int:
        return next(self._msg_ids)

    @property
    def queued(self) -> int:
        return len(self.sendq) + len(self.oneq) + len(self.ctrlq)

    # ---------------------------------------------------------------- posting
    def kick(self) -> None:
        """Post now, or at the end of this loop iteration (module doc: posting policy).
        ``in_tick`` marks the fast path as used; a completion (the loop turned) or the
        end-of-iteration pump clears it, so no callback per request is needed."""
        if self._pump_scheduled:
            return
        if self.in_tick:
            self._pump_scheduled = True
            self.e.port.later(self._pump_soon)
        else:
            self.in_tick = True
            self.pump()

    def _pump_soon(self) -> None:
        self._pump_scheduled = False
        self.in_tick = False
        self.pump()

    def pump(self) -> None:
        """Post as much queued work as send-queue room, buffers and credits allow."""
        e = self.e
        st = e.state
        if st.failed or st.remote is Remote.GONE:
            return
        credits = e.credits
        if credits is None:
            return
        batch: list[Op] = []
        room = self.sq.room
        spool = self.spool
        while self.ctrlq and room > len(batch) and spool.available:
            op = self.ctrlq[0]
            if op.payload[0] == FrameType.CLOSE:
                credits.consume_close()  # its credit is held for it: never waits
            elif credits.can_send_control():
                credits.consume(control=True)
            else:
                break
            self.ctrlq.popleft()
            self._build_ctrl(op)
            batch.append(op)
        while self.oneq and room > len(batch):
            op = self.oneq[0]
            if op.kind == ATOMIC:
                if not spool.available:
                    break
                op.slot = spool.acquire()
                assert op.slot is not None and op.wr is not None
                e.port.set_atomic_target(op.wr, spool.addr(op.slot), spool.lkey)
            self.oneq.popleft()
            batch.append(op)
        while self.sendq and room > len(batch) and credits.can_send_data():
            op = self.sendq[0]
            kind = op.kind
            if kind == DATA or kind == RNDV:
                if not spool.available:
                    break
                self.sendq.popleft()
                credits.consume()
                if kind == RNDV:
                    self._build_rndv(op)
                elif e.batching and self.sendq and self.sendq[0].kind == DATA:
                    op = self._build_batch(op)
                else:
                    self._build_data(op)
            else:  # IMM takes a credit; WRITE (a leading piece of a long one) none
                self.sendq.popleft()
                if kind == IMM:
                    credits.consume()
            batch.append(op)
        final_close = st.final and st.local is Local.CLOSE_SENT
        if (credits.should_send_credit() and room > len(batch) and spool.available
                and not final_close):
            op = Op(CTRL, None, payload=(FrameType.CREDIT, 0))
            credits.consume(control=True)
            self._build_ctrl(op)
            batch.append(op)
        if batch:
            self._post(batch)

    def _frame_wr(self, op: Op, nbytes: int) -> SendWR:
        """The SEND of the frame in ``op``'s slot (that slot's WR; ``_post`` sets wr_id
        and the signaled flag)."""
        assert op.slot is not None
        wr = self.frame_wrs[op.slot]
        wr.sg_list[0].length = nbytes
        wr.send_flags = INLINE if nbytes <= self.e.inline_cap else 0
        return wr

    def _build_data(self, op: Op) -> None:
        credits = self.e.credits
        assert credits is not None
        op.slot = self.spool.acquire()
        assert op.slot is not None
        mv: memoryview = op.payload
        n = mv.nbytes
        buf = self.spool.slot(op.slot, HEADER_SIZE + n)
        write_data_header(buf, credits.take_piggyback(), n)
        buf[HEADER_SIZE:] = mv
        op.payload = None  # copied: the caller's buffer is free
        op.wr = self._frame_wr(op, HEADER_SIZE + n)

    def _build_batch(self, first: Op) -> Op:
        """Pack ``first`` and the DATA ops after it on the send queue that fit into one
        BATCH frame; returns the op to post (``first`` itself when only it fits)."""
        sendq = self.sendq
        room = self.e.eager - HEADER_SIZE - BATCH_RECORD - first.payload.nbytes
        members = [first]
        while sendq:
            op = sendq[0]
            if op.kind != DATA:
                break
            room -= BATCH_RECORD + op.payload.nbytes
            if room < 0:
                break
            members.append(sendq.popleft())
        if len(members) == 1:
            self._build_data(first)
            return first
        credits = self.e.credits
        assert credits is not None
        self.messages_batched += len(members)
        carrier = Op(BATCH, None, payload=members)
        slot = carrier.slot = self.spool.acquire()
        assert slot is not None
        buf = self.spool.slot(slot)
        n = write_batch(buf, credits.take_piggyback(), [op.payload for op in members])
        for op in members:
            op.payload = None  # copied: the caller's buffer is free
        carrier.wr = self._frame_wr(carrier, n)
        return carrier

    def _build_rndv(self, op: Op) -> None:
        credits = self.e.credits
        assert credits is not None
        op.slot = self.spool.acquire()
        assert op.slot is not None
        addr, rkey, length = self.e.port.rndv_source(op.payload)
        buf = self.spool.slot(op.slot)
        n = write_rndv(buf, credits.take_piggyback(), op.msg_id, length, addr, rkey)
        self.rndv_out[op.msg_id] = op
        op.wr = self._frame_wr(op, n)

    def _build_ctrl(self, op: Op) -> None:
        credits = self.e.credits
        assert credits is not None
        op.slot = self.spool.acquire()
        assert op.slot is not None
        ftype, arg = op.payload
        buf = self.spool.slot(op.slot)
        piggyback = credits.take_piggyback()
        if ftype == FrameType.RNDV_DONE:
            n = write_rndv_done(buf, piggyback, arg, True)
        elif ftype == FrameType.CLOSE:
            n = write_close(buf, piggyback)
        else:
            n = write_credit(buf, piggyback)
        op.wr = self._frame_wr(op, n)

    def _post(self, batch: list[Op]) -> None:
        """Post ``batch`` in one call, signaled as the module doc says."""
        e = self.e
        port = e.port
        last = len(batch) - 1
        credits = e.credits
        if credits is not None and not credits.close_sent:
            while last >= 0:
                op = batch[last]
                if op.kind == RNDV or (op.kind == CTRL and op.payload[0] != FrameType.CLOSE):
                    last -= 1
                else:
                    break
        wrs: list[SendWR] = []
        for i, op in enumerate(batch):
            wr = op.wr
            assert wr is not None
            wr.wr_id = port.new_send_id()
            sg = wr.sg_list
            nbytes = sg[0].length if len(sg) == 1 else sum(s.length for s in sg)
            if self.sq.push(wr.wr_id, op, last_in_batch=i == last, nbytes=nbytes):
                wr.send_flags = int(wr.send_flags) | SIGNALED
            else:
                wr.send_flags = int(wr.send_flags) & ~SIGNALED
            op.posted = True
            if op.kind == BATCH:
                for m in op.payload:
                    m.posted = True
            wrs.append(wr)
        self.work_requests_posted += len(wrs)
        try:
            port.post_send(wrs)
        except RDMAError as exc:
            for wr in wrs:
                port.drop_send_id(wr.wr_id)
            for _wr_id, op in self.sq.drain():
                self.finish(op, None, exc)
            e.fail(exc)
            return
        for op in batch:
            if op.slot is not None and op.wr is not None and int(op.wr.send_flags) & INLINE:
                self.spool.release(op.slot)  # inline: the device copied it at post time
                op.slot = None
        port.posted()

    def queue_ctrl(self, ftype: FrameType, arg: int, fut: Any = None) -> None:
        """Queue a control frame (CLOSE completes ``fut``) and post what can go."""
        if self.e.state.failed:
            return
        self.ctrlq.append(Op(CTRL, fut, payload=(ftype, arg)))
        self.kick()

    @staticmethod
    def unqueue(q: deque[Op], op: Op) -> None:
        try:
            q.remove(op)
        except ValueError:
            pass

    # ---------------------------------------------------------------- completions
    def on_wc(self, wc: WC, _arg: Any = None) -> None:
        """A send completion (the provider's ``WC``): the reactor's handler of every
        send work request."""
        entries = self.sq.complete(wc.wr_id)
        if not entries:
            self.in_tick = False
            return
        last = len(entries) - 1
        # One finished send (a round trip): the next one may go at once. Several (a
        # window of senders wakes up): what they send next is batched at the end of
        # the iteration instead of the first going alone.
        self.in_tick = last > 0 or entries[0][1].kind == BATCH
        port = self.e.port
        for i, (entry_id, op) in enumerate(entries):
            if i < last:
                port.drop_send_id(entry_id)
                self.finish(op, None, None)
            else:
                self.finish(op, wc, None)
        e = self.e
        if e.state.failed:
            e.port.check_drained()
        elif self.sendq or self.oneq or self.ctrlq:
            self.pump()
        e.port.maybe_closed()

    def finish(self, op: Op, wc: WC | None, exc: BaseException | None) -> None:
        """Complete ``op``: ``wc`` None means an unsignaled success; ``exc`` a local error."""
        spool = self.spool
        if op.slot is not None:
            if op.kind == ATOMIC and exc is None and (wc is None or wc.status == _SUCCESS):
                old = _U64.unpack_from(spool.view, op.slot * spool.slot_size)[0]
            else:
                old = 0
            spool.release(op.slot)
            op.slot = None
        else:
            old = 0
        if exc is None and wc is not None and wc.status != _SUCCESS:
            exc = self._op_error(wc)
        fut = op.fut
        if op.kind == BATCH:
            for m in op.payload:
                if m.fut is not None and not m.fut.done():
                    if exc is None:
                        m.fut.set_result(None)
                    else:
                        m.fut.set_exception(exc)
            return
        if op.kind == RNDV:
            if exc is not None:
                self.rndv_out.pop(op.msg_id, None)
                self.e.port.release_source(op.payload)
                if fut is not None and not fut.done():
                    fut.set_exception(exc)
            return  # success: the user's waiter completes on RNDV_DONE
        if fut is None or fut.done():
            return
        if exc is not None:
            fut.set_exception(exc)
        elif op.kind == ATOMIC:
            fut.set_result(old)
        else:
            fut.set_result(None)

    def _op_error(self, wc: WC) -> BaseException:
        """The exception for an op whose completion failed; fails the connection."""
        e = self.e
        err = completion_error(wc.status, vendor_err=wc.vendor_err, wr_id=wc.wr_id,
                               opcode=wc.opcode)
        if wc.status == _FLUSHED:
            if not e.state.failed:
                e.fail(err)
            return e.closed_error()
        first = e.first_error is None
        e.fail(err)
        if int(wc.status) in _PEER_GONE_STATUSES or not first:
            return e.closed_error()
        return err

    # ---------------------------------------------------------------- failure
    def posted_ops(self) -> list[Op]:
        """The ops on the send queue, the messages of BATCH frames listed one by one."""
        out: list[Op] = []
        for _wr_id, op in self.sq.entries():
            if op.kind == BATCH:
                out.extend(op.payload)
            else:
                out.append(op)
        return out

    def fail_queued(self, error: Callable[[], BaseException]) -> None:
        """Drop every operation not posted yet (control, one-sided and send queues):
        release its rendezvous source and fail its waiter with ``error()``."""
        for q in (self.ctrlq, self.oneq, self.sendq):
            while q:
                op = q.popleft()
                if op.kind == RNDV:
                    self.e.port.release_source(op.payload)
                if op.fut is not None and not op.fut.done():
                    op.fut.set_exception(error())

    def post_flush_marker(self) -> None:
        """The QP is in ERR. Unsignaled WRs after the last signaled one (frames nobody
        waits for) may have finished without a completion: a signaled zero-length SEND
        posted now is flushed after every one of them, so its completion retires them
        and the drain waits for exactly that (the marker WR of the teardown order)."""
        sq = self.sq
        if not sq.used or sq.awaited or not sq.room:
            return
        port = self.e.port
        wr_id = port.new_send_id()
        try:
            port.post_marker(wr_id)
        except RDMAError:  # the QP is gone: the teardown destroys it without waiting
            port.drop_send_id(wr_id)
            return
        self.work_requests_posted += 1
        sq.push(wr_id, Op(CTRL, None, payload=(FrameType.CREDIT, 0)), last_in_batch=True)

