"""``IbvCompChannel``: a completion channel, whose fd tells when a CQ has events."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import DeviceError, RDMAError
from ..api import CompChannel
from . import clib, compat, loader, probe

if TYPE_CHECKING:
    from .context import IbvContext
    from .cq import IbvCQ, _CQEvents
    from .fastpath import ChannelEvents, CQEvents


def _reader(channel_ptr: int) -> ChannelEvents | clib.ChannelReader | None:
    """What reads and acknowledges the events of the ``struct ibv_comp_channel`` at
    ``channel_ptr`` (see ``IbvCompChannel``); None without libibverbs."""
    lib = clib.libibverbs()
    if lib is None:
        return None
    fp = loader.fastpath() if os.environ.get("AIORDMA_VERBS_POLL", "") != "ctypes" else None
    if fp is not None:
        get_fn = clib.function_address(lib, "ibv_get_cq_event")
        ack_fn = clib.function_address(lib, "ibv_ack_cq_events")
        if get_fn and ack_fn:
            return fp.ChannelEvents(channel_ptr, get_fn, ack_fn)
    return clib.ChannelReader(lib, channel_ptr)


class IbvCompChannel(CompChannel):
    """A completion channel.

    Events are read with ``ibv_get_cq_event`` on the channel's C struct, so any number of
    CQs may share the channel: through the compiled ``fastpath.ChannelEvents`` where it
    is built, else through ctypes (``clib.ChannelReader``; ``AIORDMA_VERBS_POLL=ctypes``
    chooses it). Only if that struct cannot be located is pyverbs'
    ``get_cq_event(expected_cq)`` used, which needs the CQ in advance: the channel then
    serves one CQ.
    """

    def __init__(self, ctx: IbvContext) -> None:
        pv = ctx._pv
        self._ctx = ctx
        self._pv = pv
        before = None if pv.channel_has_fd else probe.event_fds()
        try:
            self._cc: Any = pv.cq.CompChannel(ctx._ctx)
        except pv.Error as exc:
            raise ctx._error(exc, "ibv_create_comp_channel") from None
        try:
            fd, ptr = self._locate(before)
            probe.set_nonblocking(fd)
        except BaseException:
            self._cc.close()
            raise
        self._reader = _reader(ptr) if ptr else None
        self.fd = fd
        # id(cq token) -> the event counts of each CQ on this channel (IbvCQ._events:
        # get_event counts there, and their ``cq`` is the CQ)
        self._events: dict[int, CQEvents | _CQEvents] = {}
        # the reader when it is the compiled one (next_cq reads the table above)
        self._compiled: ChannelEvents | None = (
            None if self._reader is None or isinstance(self._reader, clib.ChannelReader)
            else self._reader)
        if self._compiled is not None:
            self._compiled.attach(self._events)
        self._closed = False
        ctx._children.add(self)

    def _locate(self, before: dict[int, str] | None) -> tuple[int, int | None]:
        """``(fd, struct ibv_comp_channel * or None)`` (see the package docstring)."""
        known = int(self._cc.fd) if before is None else None
        new: list[int] | None = None
        if before is not None:
            after = probe.event_fds()
            new = [fd for fd, t in after.items() if before.get(fd) != t]
        ctx = self._ctx
        if ctx._ctx_ptr:
            try:
                words = probe.object_words(self._cc)
            except Exception:  # pragma: no cover - non-CPython
                words = []
            found = probe.find_channel(words, ctx._ctx_ptr, ctx._mem.read, probe.is_event_fd,
                                        fd=known, candidates=new or None)
            if found is not None:
                return found[1], found[0]
        if known is not None:
            return known, None
        if new is not None and len(new) == 1:
            return new[0], None
        raise DeviceError(errno.EIO, "cannot determine the fd of the completion channel "
                          f"({self._pv.describe()}; new event fds: {new})")

    def get_event(self) -> IbvCQ | None:
        if self._closed:
            return None
        if self._compiled is not None:
            return self._compiled.next_cq()
        reader = self._reader
        if reader is not None:  # clib.ChannelReader: the same steps through ctypes
            while True:
                try:
                    got = reader.get()
                except OSError as exc:
                    raise RDMAError(exc.errno or errno.EIO, str(exc)) from None
                if got is None:
                    return None
                cq_ptr, token = got
                ev = self._events.get(token)
                if ev is None:  # not ours (cannot happen): keep libibverbs' count right
                    reader.ack(cq_ptr, 1)
                    continue
                ev.cq_ptr = cq_ptr
                ev.got += 1
                return ev.cq
        if not self._events:
            return None
        (ev,) = self._events.values()
        cq: IbvCQ = ev.cq
        try:
            self._cc.get_cq_event(cq._cq)
        except self._pv.Error as exc:
            code = compat.errno_of(exc, 0)
            if code in (errno.EAGAIN, errno.EWOULDBLOCK) or not probe.readable(self.fd):
                return None
            raise RDMAError(code or errno.EIO, f"ibv_get_cq_event: {exc}") from None
        ev.got += 1
        return cq

    def event_reader(self) -> Callable[[], IbvCQ | None]:
        """``get_event`` compiled (``fastpath.ChannelEvents.next_cq``) where the channel's
        events are read through the compiled reader; else the method."""
        return self.get_event if self._compiled is None else self._compiled.next_cq

    def close(self) -> None:
        if self._closed:
            return
        if self._events:
            raise RDMAError(errno.EBUSY,
                            f"completion channel still used by {len(self._events)} CQ(s)")
        try:
            self._cc.close()
        except self._pv.Error as exc:
            raise self._ctx._error(exc, "ibv_destroy_comp_channel") from None
        self._closed = True
        if self._compiled is not None:
            self._compiled.close()  # (its struct is gone: next_cq and get read nothing)
        self._ctx._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvCompChannel fd={self.fd}>"
