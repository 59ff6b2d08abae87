"""Open devices shared by endpoints: one context per (provider, name), one reactor per loop.

``Device.acquire(name, provider)`` returns the process-wide shared, refcounted device;
``release()`` drops a reference and closes the context with the last one. Users may
also open a device explicitly with ``aiordma.open_device()`` and pass it as
``device=`` to ``connect``/``listen``.

Several event loops (threads) may use one device: each has its own reactor; the
device's async-event fd is read by one of them, and each event is handed to the
endpoint it concerns on that endpoint's own loop (``call_soon_threadsafe``).
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

from .cq_reactor import CQReactor, poll_settings
from .verbs import AsyncEvent, Context, EventType, open_context, select_provider

log = logging.getLogger("aiordma")

#: events that break every connection of the device (or of the port)
_DEVICE_WIDE = (EventType.DEVICE_FATAL, EventType.PORT_ERR)


class Device:
    """An open RDMA device: its verbs ``Context`` and its CQ reactors (one per loop)."""

    _shared: dict[tuple[str, str | None], Device] = {}
    _lock = threading.Lock()  # reference counts and the shared table, from any thread

    def __init__(self, ctx: Context, *, shared_key: tuple[str, str | None] | None = None) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.provider = ctx.provider
        self._reactors: dict[int, CQReactor] = {}
        self._refs = 1
        self._shared_key = shared_key
        self.closed = False
        self._qp_watchers: dict[int, tuple[asyncio.AbstractEventLoop,
                                           Callable[[AsyncEvent], None]]] = {}
        self._async_loop: asyncio.AbstractEventLoop | None = None
        self.async_events = 0
        #: what endpoints hold of this device (``resources.Resources``, with a
        #: ``destroy()`` that removes it): destroyed at exit if still alive
        #: (``_quiesce_at_exit``). Held strongly: an endpoint's posted receives keep it
        #: alive anyway until its QP is destroyed (the reactor holds their handlers).
        self.holders: set[Any] = set()
        _open_devices.add(self)

    @classmethod
    def acquire(cls, name: str | None = None, provider: str | None = None) -> Device:
        """The shared device for (provider, name), opened on first use (refcounted)."""
        prov = select_provider(provider).name
        key = (prov, name)
        with cls._lock:
            dev = cls._shared.get(key)
            if dev is not None and not dev.closed:
                dev._refs += 1
                return dev
            dev = cls(open_context(name, provider=prov), shared_key=key)
            cls._shared[key] = dev
            return dev

    def ref(self) -> Device:
        with Device._lock:
            self._refs += 1
        return self

    def reactor(self, loop: asyncio.AbstractEventLoop | None = None, *, mode: str | None = None,
                spin_us: int | None = None) -> CQReactor:
        """The CQ reactor of this device on ``loop`` (the running loop by default).

        The first call for a loop creates it with ``mode``/``spin_us`` (None: the
        environment, then the defaults); the poll policy belongs to the reactor, so a
        later call that asks explicitly for another one raises ValueError instead of
        silently getting the existing policy.
        """
        loop = loop or asyncio.get_running_loop()
        self._close_orphans()
        r = self._reactors.get(id(loop))
        if r is None or r.loop is not loop or r.closed:
            r = CQReactor(self.ctx, loop, mode=mode, spin_us=spin_us)
            self._reactors[id(loop)] = r
        elif mode is not None or spin_us is not None:
            want = poll_settings(mode or r.mode, r.spin_us if spin_us is None else spin_us)
            if want != (r.mode, r.spin_us):
                raise ValueError(
                    f"poll_mode={want[0]!r} spin_us={want[1]}: the {self.name} device already "
                    f"polls in mode {r.mode!r} spin_us={r.spin_us} on this event loop (the "
                    "policy is per device and loop, set by its first connection)")
        if self._async_loop is None or self._async_loop.is_closed():
            # The device's async-event fd is watched by the first loop that uses it.
            loop.add_reader(self.ctx.async_fd, self._on_async_events)
            self._async_loop = loop
        return r

    def _close_orphans(self) -> None:
        """Close the reactors of loops that are closed (a thread's ``asyncio.run`` is
        over): their CQs would stay allocated until the device closes. One that still
        has a QP on its CQs (an endpoint never closed) is kept for the device's close."""
        with Device._lock:  # each orphan is taken (and closed) by one thread
            orphans = [self._reactors.pop(key) for key, r in list(self._reactors.items())
                       if r.loop.is_closed() and not r.in_use]
        for r in orphans:
            r.close()

    def watch_qp(self, qp_num: int, on_event: Callable[[AsyncEvent], None],
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Call ``on_event(ev)`` on ``loop`` (the running loop by default) for async
        events of QP ``qp_num`` (QP fatal, access or request errors) and for
        device-wide failures (port down, device fatal)."""
        self._qp_watchers[qp_num] = (loop or asyncio.get_running_loop(), on_event)

    def unwatch_qp(self, qp_num: int) -> None:
        self._qp_watchers.pop(qp_num, None)

    def _on_async_events(self) -> None:
        """Drain the async fd (the provider acknowledges each event) and act on them."""
        here = asyncio.get_running_loop()
        for ev in self.ctx.get_async_events():
            self.async_events += 1
            watchers = self._qp_watchers
            if ev.event_type in _DEVICE_WIDE:
                log.error("aiordma: %s on %s port %s: failing its connections",
                          ev.event_type, self.name, ev.port_num)
                targets = list(watchers.values())
            elif ev.qp_num is not None and (w := watchers.get(ev.qp_num)) is not None:
                targets = [w]
            else:
                if ev.event_type == EventType.CQ_ERR:
                    log.error("aiordma: CQ overrun on %s (a bug: CQs are sized 2x)", self.name)
                continue
            for loop, cb in targets:
                if loop is here:
                    _deliver(cb, ev)
                elif not loop.is_closed():  # another thread's loop: hand it over
                    try:
                        loop.call_soon_threadsafe(_deliver, cb, ev)
                    except RuntimeError:  # closed meanwhile: nothing left to fail
                        pass

    def release(self) -> None:
        """Drop one reference; the last one closes reactors and the context."""
        with Device._lock:
            self._refs -= 1
            last = self._refs <= 0
        if last:
            self.close()

    def close(self) -> None:
        """Close every reactor and the context. Idempotent. A reactor whose loop runs in
        another thread is closed on that loop (its readers are that loop's); this
        waits for it, at most ``_FOREIGN_CLOSE_S`` per loop."""
        if self.closed:
            return
        self.closed = True
        async_loop, self._async_loop = self._async_loop, None
        if async_loop is not None and not async_loop.is_closed():
            fd = self.ctx.async_fd
            _on_its_loop(async_loop, lambda: async_loop.remove_reader(fd))
        reactors = list(self._reactors.values())
        self._reactors.clear()
        for r in reactors:
            _on_its_loop(r.loop, r.close)
        if self._shared_key is not None and Device._shared.get(self._shared_key) is self:
            del Device._shared[self._shared_key]
        self.ctx.close()

    def __repr__(self) -> str:
        return f"<Device {self.name} provider={self.provider} refs={self._refs}>"


_FOREIGN_CLOSE_S = 5.0


def _on_its_loop(loop: asyncio.AbstractEventLoop, fn: Callable[[], object]) -> None:
    """Run ``fn`` now if ``loop`` is this thread's or not running; else on ``loop``
    (another thread's), waiting until it ran (bounded: a loop whose thread is stuck
    leaves ``fn`` undone, logged)."""
    try:
        here: asyncio.AbstractEventLoop | None = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    if loop is here or loop.is_closed() or not loop.is_running():
        fn()
        return
    done = threading.Event()

    def run() -> None:
        try:
            fn()
        finally:
            done.set()

    try:
        loop.call_soon_threadsafe(run)
    except RuntimeError:  # closed meanwhile: nobody else uses it now
        fn()
        return
    if not done.wait(_FOREIGN_CLOSE_S):
        log.warning("aiordma: the loop of another thread did not run the device's close "
                    "within %.0f s", _FOREIGN_CLOSE_S)


def _deliver(cb: Callable[[AsyncEvent], None], ev: AsyncEvent) -> None:
    try:
        cb(ev)
    except Exception:
        log.exception("aiordma: async event handler raised")


_open_devices: weakref.WeakSet[Device] = weakref.WeakSet()


@atexit.register
def _quiesce_at_exit() -> None:
    """A program may exit with endpoints never closed (a loop stopped mid-way): ack the
    events of every open device's CQs, so that destroying them at exit cannot block,
    then destroy what those endpoints hold (QP, MRs, PD) while the device context is
    still open. Left to the garbage collector, which breaks the reference cycles at
    exit in any order, a PD or MR freed after its context fails (EBADF)."""
    for dev in list(_open_devices):
        if not dev.closed:
            for r in list(dev._reactors.values()):
                try:
                    r.ack_pending()
                except Exception:  # exiting anyway: nothing better to do than go on
                    log.debug("aiordma: ack at exit failed", exc_info=True)
            for holder in list(dev.holders):
                try:
                    holder.destroy()
                except Exception:  # exiting anyway
                    log.debug("aiordma: destroy at exit failed", exc_info=True)


def open_device(name: str | None = None, *, provider: str | None = None) -> Device:
    """Open a device for explicit use (``device=`` option); close it with ``close()``."""
    return Device(open_context(name, provider=provider))
