"""Event reading and CQ polling through libibverbs itself (ctypes), where pyverbs falls
short (``CQPoller``: see the package docstring, "Polling completions").

* pyverbs' ``Context.get_async_event`` loses the event's element (which QP, CQ or port
  it is about) and reports a failed non-blocking read with error code -1, not EAGAIN.
* pyverbs' ``CompChannel.get_cq_event(expected_cq)`` must be told the CQ in advance and
  loses an event that is for another CQ of the same channel.

The C API involved is tiny and ABI-stable, so this module calls ``ibv_get_async_event``/
``ibv_ack_async_event`` and ``ibv_get_cq_event``/``ibv_ack_cq_events`` of the libibverbs
that pyverbs already loaded (same process, same structs), with ``use_errno`` so that EAGAIN
is seen. ctypes releases the GIL around each of these calls (not around ``poll_cq``);
the fds are non-blocking anyway. CQ events read here are acknowledged here too, so
pyverbs' own per-CQ event counter stays 0 and its ``CQ.close()`` acknowledges nothing
twice.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from . import compat

log = logging.getLogger("aiordma.verbs")

T = TypeVar("T")


class IbvAsyncEvent(ctypes.Structure):
    """``struct ibv_async_event {union {cq*, qp*, srq*, wq*, int port_num} element;
    enum ibv_event_type event_type;}``; the union is read as one pointer-sized word."""

    _fields_ = [("element", ctypes.c_void_p), ("event_type", ctypes.c_int)]


_lib: Any = None
_lib_error: str | None = None


def libibverbs() -> Any:
    """The process's libibverbs (``libibverbs.so.1``), or None if it cannot be loaded."""
    global _lib, _lib_error
    if _lib is None and _lib_error is None:
        names = ["libibverbs.so.1"]
        found = ctypes.util.find_library("ibverbs")
        if found and found not in names:
            names.append(found)
        for name in names:
            try:
                lib = ctypes.CDLL(name, use_errno=True)
                lib.ibv_get_async_event.argtypes = [ctypes.c_void_p,
                                                    ctypes.POINTER(IbvAsyncEvent)]
                lib.ibv_get_async_event.restype = ctypes.c_int
                lib.ibv_ack_async_event.argtypes = [ctypes.POINTER(IbvAsyncEvent)]
                lib.ibv_ack_async_event.restype = None
                lib.ibv_get_cq_event.argtypes = [ctypes.c_void_p,
                                                 ctypes.POINTER(ctypes.c_void_p),
                                                 ctypes.POINTER(ctypes.c_void_p)]
                lib.ibv_get_cq_event.restype = ctypes.c_int
                lib.ibv_ack_cq_events.argtypes = [ctypes.c_void_p, ctypes.c_uint]
                lib.ibv_ack_cq_events.restype = None
            except (OSError, AttributeError) as exc:
                _lib_error = f"{name}: {exc}"
                continue
            _lib = lib
            _lib_error = None
            break
    return _lib


def function_address(lib: Any, name: str) -> int:
    """The address of ``lib``'s C function ``name`` (0 when ``lib`` is None, lacks it, or
    it is not a C function), for the compiled path's calls through function pointers."""
    if lib is None:
        return 0
    try:
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value or 0
    except (AttributeError, TypeError, ctypes.ArgumentError):
        return 0


def modify_qp_address() -> int:
    """The address of the process's ``ibv_modify_qp`` (0 when libibverbs is not loaded),
    for the compiled RTR transition (``fastpath.QPPoster.modify_rtr``), which calls it
    with the GIL released."""
    return function_address(libibverbs(), "ibv_modify_qp")


def element_port(element: int | None) -> int:
    """The ``port_num`` member of the element union (the low 32 bits, little-endian)."""
    return ctypes.c_int.from_buffer_copy(ctypes.c_void_p(element or 0)).value


def qp_num_of(qp_ptr: int) -> int:
    """``((struct ibv_qp *)qp_ptr)->qp_num`` (valid while the event is unacknowledged)."""
    return ctypes.c_uint32.from_address(qp_ptr + compat.QP_QP_NUM_OFFSET).value


def cq_context_of(cq_ptr: int) -> int:
    """``((struct ibv_cq *)cq_ptr)->cq_context`` (valid while the event is unacknowledged)."""
    return ctypes.c_void_p.from_address(cq_ptr + compat.CQ_CQ_CONTEXT_OFFSET).value or 0


#: ``int (*poll_cq)(struct ibv_cq *, int, struct ibv_wc *)``, called with the GIL held
#: (PYFUNCTYPE): it never blocks, and releasing and re-taking the GIL costs more than
#: the call.
_POLL_CQ = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p)


class CQPoller:
    """``ibv_poll_cq`` of one CQ through its context's ``ops.poll_cq`` (ctypes).

    What the inline ``ibv_poll_cq`` of verbs.h does, with the completions written into a
    buffer owned by this object and unpacked with ``struct``: no pyverbs ``WC`` object
    (each costs a logger look-up and a dozen property calls) per completion. One thread
    polls a CQ at a time (the verbs API's threading rule).
    """

    def __init__(self, ctx_ptr: int, cq_ptr: int, entries: int = 64) -> None:
        """Raises ValueError when ``ops.poll_cq`` of ``ctx_ptr`` is NULL."""
        fn = ctypes.c_void_p.from_address(ctx_ptr + compat.CTX_OPS_POLL_CQ_OFFSET).value
        if not fn:
            raise ValueError("struct ibv_context has no ops.poll_cq")
        self._fn = _POLL_CQ(fn)
        self._cq = ctypes.c_void_p(cq_ptr)
        self._entries = entries
        self._buf = ctypes.create_string_buffer(compat.IBV_WC.size * entries)
        self._view = memoryview(self._buf).cast("B")
        self._size = compat.IBV_WC.size
        self._unpack = compat.IBV_WC.iter_unpack

    def close(self) -> None:
        """Poll nothing from now on (before the CQ is destroyed)."""
        self._entries = 0

    def poll(self, n: int) -> tuple[int, Iterator[compat.RawWC]]:
        """Up to ``n`` completions: ``(count, their RawWC tuples)``; a negative count is
        ibv_poll_cq's error (then nothing is returned). Read the tuples before the next
        ``poll``: they are unpacked lazily from this object's buffer."""
        if n > self._entries:
            n = self._entries
        if n <= 0:
            return 0, iter(())
        rc: int = self._fn(self._cq, n, self._buf)
        if rc <= 0:
            return rc, iter(())
        return rc, self._unpack(self._view[: rc * self._size])


class AsyncReader:
    """Reads and acknowledges the async events of one ``struct ibv_context``."""

    def __init__(self, lib: Any, ctx_ptr: int) -> None:
        self._lib = lib
        self._ctx = ctypes.c_void_p(ctx_ptr)

    def drain(self, convert: Callable[[int, int], T | None]) -> list[T]:
        """Read every queued event, ``convert(event_type, element)`` it, ack it.

        Stops at EAGAIN (the fd is non-blocking). ``convert`` runs before the ack, while
        the QP/CQ the element points to is guaranteed to exist.
        """
        out: list[T] = []
        ev = IbvAsyncEvent()
        while True:
            rc = self._lib.ibv_get_async_event(self._ctx, ctypes.byref(ev))
            if rc != 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                if err not in (errno.EAGAIN, errno.EWOULDBLOCK):
                    log.warning("aiordma: ibv_get_async_event failed: %s", errno.errorcode.get(
                        err, err))
                return out
            try:
                item = convert(int(ev.event_type), int(ev.element or 0))
            finally:
                self._lib.ibv_ack_async_event(ctypes.byref(ev))
            if item is not None:
                out.append(item)


class ChannelReader:
    """Reads the events of one ``struct ibv_comp_channel`` and acknowledges CQ events."""

    def __init__(self, lib: Any, channel_ptr: int) -> None:
        self._lib = lib
        self._ch = ctypes.c_void_p(channel_ptr)
        self._cq = ctypes.c_void_p()
        self._ctx = ctypes.c_void_p()

    def get(self) -> tuple[int, int] | None:
        """``(struct ibv_cq *, cq_context)`` of the next event; None when none is queued.

        Raises OSError for a failure other than EAGAIN.
        """
        while True:
            rc = self._lib.ibv_get_cq_event(self._ch, ctypes.byref(self._cq),
                                            ctypes.byref(self._ctx))
            if rc == 0:
                return int(self._cq.value or 0), int(self._ctx.value or 0)
            err = ctypes.get_errno()
            if err == errno.EINTR:
                continue
            if err in (errno.EAGAIN, errno.EWOULDBLOCK):
                return None
            raise OSError(err, f"ibv_get_cq_event: {errno.errorcode.get(err, err)}")

    def ack(self, cq_ptr: int, n: int) -> None:
        """``ibv_ack_cq_events(cq, n)``."""
        self._lib.ibv_ack_cq_events(ctypes.c_void_p(cq_ptr), n)
