"""``IbvCQ``: a completion queue, polled through the device's own ``poll_cq`` where
its C struct is found (package docstring, "Polling completions"), else through pyverbs."""

from __future__ import annotations

import errno
import logging
import os
import weakref
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from ...errors import CQOverrunError, RDMAError
from ..api import CQ
from ..contract import check_cq_close
from ..enums import QPState, WCOpcode
from ..wr import WC
from . import clib, compat, loader, probe

if TYPE_CHECKING:
    from .channel import IbvCompChannel
    from .context import IbvContext
    from .fastpath import CQEvents, CQPoller
    from .qp import IbvQP

log = logging.getLogger("aiordma.verbs")

_WC_RECV_BIT = 0x80  # IBV_WC_RECV: every receive opcode has it, no send opcode does
_POLL_ENTRIES = 64  # struct ibv_wc per poller: the most one poll returns


class _Token:
    """The ``cq_context`` of a CQ: maps a CQ_ERR async event back to its CQ."""

    __slots__ = ("__weakref__",)


class _CQEvents:
    """``fastpath.CQEvents`` where the compiled data path is not built: the
    channel-event counts of one CQ -- events read (``got``), acknowledged (``acked``),
    its ``struct ibv_cq *`` (``cq_ptr``: 0 until probed or told by an event) -- and the
    CQ (``cq``)."""

    __slots__ = ("cq", "cq_ptr", "got", "acked")

    def __init__(self, cq: IbvCQ, cq_ptr: int = 0) -> None:
        self.cq = cq
        self.cq_ptr = cq_ptr
        self.got = 0
        self.acked = 0


class IbvCQ(CQ):
    def __init__(self, ctx: IbvContext, cqe: int, channel: IbvCompChannel | None) -> None:
        self.context = ctx
        self._pv = ctx._pv
        if cqe < 1:
            raise RDMAError(errno.EINVAL, f"cqe={cqe} must be at least 1")
        if channel is not None:
            if channel._ctx is not ctx:
                raise RDMAError(errno.EINVAL, "completion channel of another device context")
            if channel._closed:
                raise RDMAError(errno.EINVAL, "completion channel is closed")
            if channel._reader is None and channel._events:
                raise RDMAError(errno.EBUSY, "this completion channel can serve one CQ only "
                                f"(its C struct was not found; {self._pv.describe()})")
        self._token = _Token()
        try:
            self._cq: Any = self._pv.cq.CQ(ctx._ctx, cqe, self._token,
                                           channel._cc if channel is not None else None, 0)
        except self._pv.Error as exc:
            raise ctx._error(exc, f"ibv_create_cq({cqe})") from None
        self.cqe = int(getattr(self._cq, "cqe", cqe))  # the device may round up
        self.channel: IbvCompChannel | None = channel
        # its channel events, counted where the channel's reader counts them
        # (``IbvCompChannel.get_event``), the compiled record where built; its
        # ``cq_ptr`` is ``_cq_ptr``
        fp = loader.fastpath()
        self._events: CQEvents | _CQEvents = _CQEvents(self) if fp is None else fp.CQEvents(self)
        self._poller: clib.CQPoller | CQPoller | None = None
        # the compiled ibv_req_notify_cq (fastpath.CQPoller.req_notify), where polled so
        self._arm: Callable[[int], int] | None = None
        self._locate(ctx)
        self._qps: dict[IbvQP, int] = {}
        self._overrun = False
        self._closed = False
        ctx._cqs_by_token[id(self._token)] = self
        ctx._children.add(self)
        if channel is not None:
            channel._events[id(self._token)] = self._events

    def _locate(self, ctx: IbvContext) -> None:
        """Find this CQ's C struct and poll it from now on through the compiled
        ``fastpath.CQPoller`` where built, else ``clib.CQPoller`` (ctypes);
        ``AIORDMA_VERBS_POLL`` = ``ctypes`` or ``pyverbs`` chooses one. pyverbs'
        ``CQ.poll`` stays the fallback (no context pointer, or the probe found
        nothing)."""
        mode = os.environ.get("AIORDMA_VERBS_POLL", "")
        if not ctx._ctx_ptr or mode == "pyverbs":
            return
        try:
            words = probe.object_words(self._cq)
        except Exception:  # pragma: no cover - non-CPython
            return
        ptr = probe.find_cq_pointer(words, ctx._ctx_ptr, id(self._token), ctx._mem.read)
        if not ptr:
            log.debug("aiordma: struct ibv_cq of %r not found; polling through pyverbs", self)
            return
        self._events.cq_ptr = ptr
        fp = loader.fastpath() if mode != "ctypes" else None
        if fp is not None:
            poller = self._poller = fp.CQPoller(ptr, _POLL_ENTRIES)
            poller.attach(weakref.ref(self))
            self._arm = poller.req_notify
            return
        try:
            self._poller = clib.CQPoller(ctx._ctx_ptr, ptr, _POLL_ENTRIES)
        except ValueError as exc:  # pragma: no cover - a provider without poll_cq
            log.debug("aiordma: %s; polling through pyverbs", exc)

    @property
    def _cq_ptr(self) -> int:
        """``struct ibv_cq *``: probed at creation (for polling), else learnt from the
        first channel event (``_events``); 0 until then."""
        return self._events.cq_ptr

    @property
    def data_path(self) -> str:
        """How this CQ is polled: ``"compiled"`` (fastpath), ``"ctypes"`` (clib) or
        ``"pyverbs"``."""
        p = self._poller
        if p is None:
            return "pyverbs"
        return "ctypes" if isinstance(p, clib.CQPoller) else "compiled"

    def c_ops(self) -> Any:
        """The C-level poll (``api.CQ.c_ops``) where this CQ is polled through the
        compiled data path: ``fastpath.cq_ops()`` on its ``CQPoller``."""
        p = self._poller
        if p is None or isinstance(p, clib.CQPoller):
            return None
        fp = loader.fastpath()
        assert fp is not None
        return fp.cq_ops(), p

    def _track(self, qp: IbvQP) -> None:
        """``qp`` completes here: the compiled poll accounts for it (``IbvQP``)."""
        p = self._poller
        if p is not None and not isinstance(p, clib.CQPoller):
            p.track(qp.qp_num, qp._queues, qp.send_cq is self, qp.recv_cq is self,
                    weakref.ref(qp))

    def _untrack(self, qp: IbvQP) -> None:
        p = self._poller
        if p is not None and not isinstance(p, clib.CQPoller):
            p.untrack(qp.qp_num)

    def _overrun_detected(self) -> None:
        """Completions were lost: the CQ is in error for good, and so is every QP using it
        (rxe leaves them in RTS; hardware moves them to ERR)."""
        self._overrun = True
        for qp in list(self._qps):
            qp._to_error()

    def poll(self, n: int = 16) -> list[WC]:
        if self._overrun:
            raise CQOverrunError()
        if self._closed:
            return []
        raws: Iterable[compat.RawWC]
        poller = self._poller
        if poller is not None:
            rc, raws = poller.poll(n)
            if rc <= 0:
                if rc == 0:
                    return []
                self._overrun_detected()
                raise CQOverrunError(f"completion queue overrun (ibv_poll_cq returned {rc})")
        else:
            try:
                _, pwcs = self._cq.poll(n)
            except self._pv.Error as exc:
                self._overrun_detected()
                raise CQOverrunError(f"completion queue overrun (ibv_poll_cq: {exc})") from None
            if not pwcs:
                return []
            raws = [compat.pwc_fields(p) for p in pwcs]
        qps = self.context._qps
        out: list[WC] = []
        for raw in raws:
            qp = qps.get(raw[6])
            hint = None
            if qp is not None:
                if raw[1] == 0 and raw[2] & _WC_RECV_BIT and qp.recv_cq is self:
                    # a successful receive (WorkQueues.completed, inlined for the most
                    # frequent completion): its receive slot comes free
                    qp._queues.recv_completed()
                    hint = WCOpcode.RECV
                else:
                    ok = raw[1] == 0
                    hint = qp._queues.completed(raw[0], ok, raw[2], qp.send_cq is self,
                                                qp.recv_cq is self)
                    if not ok:  # an error completion means the QP is in ERR now
                        qp._state = QPState.ERR
            out.append(compat.wc_from_fields(raw, hint))
        return out

    def req_notify(self, solicited_only: bool = False) -> None:
        arm = self._arm
        if arm is not None:  # (closed: EBADF)
            rc = arm(1 if solicited_only else 0)
            if rc:
                raise RDMAError(rc, f"ibv_req_notify_cq: {os.strerror(rc)}")
            return
        try:
            self._cq.req_notify(1 if solicited_only else 0)
        except self._pv.Error as exc:
            raise RDMAError(compat.errno_of(exc), f"ibv_req_notify_cq: {exc}") from None

    def notifier(self) -> Callable[[], None]:
        """``req_notify()`` compiled (``fastpath.CQPoller.notify``) where this CQ is
        polled through the compiled data path; else the method."""
        p = self._poller
        if p is None or isinstance(p, clib.CQPoller):
            return self.req_notify
        return p.notify

    def ack_events(self, n: int) -> None:
        ev = self._events
        n = min(n, ev.got - ev.acked)
        if n <= 0 or self._closed:
            return
        ch = self.channel
        if ch is not None and ch._reader is not None:
            ch._reader.ack(ev.cq_ptr, n)
        else:
            self._cq.ack_events(n)
        ev.acked += n

    def unacked_events(self) -> int:
        """The channel events read for this CQ and not acknowledged yet."""
        return self._events.got - self._events.acked

    def close(self) -> None:
        if self._closed:
            return
        check_cq_close(len(self._qps), self._events.got, self._events.acked)
        # Events queued on the channel but not read yet do not block ibv_destroy_cq (the
        # kernel counts an event as reported when it is read, and drops unread ones).
        ch = self.channel
        try:
            self._cq.close()
        except self._pv.Error as exc:
            raise self.context._error(exc, "ibv_destroy_cq") from None
        self._closed = True
        if self._poller is not None:
            self._poller.close()  # its struct ibv_cq is gone
        if ch is not None:
            ch._events.pop(id(self._token), None)
        self.context._cqs_by_token.pop(id(self._token), None)
        self.context._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvCQ cqe={self.cqe} polled={self.data_path}>"
