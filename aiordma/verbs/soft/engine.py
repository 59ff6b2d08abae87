"""The soft device engine: listener, GID table, key and QP tables, and the NIC thread.

One engine per process, shared by every open context (refcounted, started lazily by
the first ``open`` and stopped when the last context closes). The NIC thread runs a
selector over the listener, every connection and a wake-up pipe; it executes requests
that arrive for local QPs (so a target makes progress while its application sleeps),
delivers responses and completions, runs timers (RNR back-off, ACK timeouts) and
callbacks queued with ``call_soon``. It never calls user code.

Locking: ``Engine.lock`` (one plain lock per device) protects every QP, CQ, MR and
connection state. The NIC thread holds it while handling a message, never while
copying a large payload from a socket. Callbacks given to ``call_soon``/``call_at``
run on the NIC thread with the lock held.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import secrets
import selectors
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from ...errors import DeviceError, fd_limit_error
from ..enums import QPState
from . import addr
from ._core import OPEN, Conn, DeviceLock, KeyTable
from .admission import Admission, Listener
from .dial import tune
from .keys import random_qpn

if TYPE_CHECKING:
    from ._core import SoftCompChannel, SoftQP

log = logging.getLogger("aiordma.soft")

#: how often the NIC thread checks the channels in manual progress (cq.py): a channel
#: whose sockets stay ready for two ticks without being polled is taken over
WATCHDOG_S = 0.01


class _Wake:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def on_event(self, mask: int) -> None:
        e = self.engine
        try:
            while os.read(e._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        e._wake_pending = False


class _Takeover:
    """Selector entry of a manual-progress channel the NIC thread drives for now."""

    def __init__(self, channel: SoftCompChannel) -> None:
        self.channel = channel

    def on_event(self, mask: int) -> None:
        self.channel.progress()


class Engine:
    """The per-process soft device (``soft0``)."""

    def __init__(self, host: str, port: int) -> None:
        self.lock = DeviceLock()
        self.keys = KeyTable()
        self.qps: dict[int, SoftQP] = {}
        self.conns: set[Conn] = set()
        self._held: dict[int, list[Conn]] = {}
        #: the key of QPs given none (QPAttr.auth_key): never leaves the process
        self.secret = secrets.token_bytes(32)
        self.limit_logged = False  # out of descriptors, logged (dial.py: once per burst)
        self.admission = Admission(self)  # (reads its settings: DeviceError first)
        opened: list[socket.socket | selectors.BaseSelector | int] = []
        try:
            self._open_sockets(host, port, opened)
        except BaseException:  # close what was made: a failed start leaks nothing
            for obj in reversed(opened):
                if isinstance(obj, int):
                    os.close(obj)
                else:
                    obj.close()
            raise
        self._wake_pending = False
        self._calls: deque[Callable[[], None]] = deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._planned_wake = 0.0
        self._stopping = False
        self._progress_channels: set[SoftCompChannel] = set()
        self._next_watch = 0.0
        self.sel.register(self._wake_r, selectors.EVENT_READ, _Wake(self))
        self.sel.register(self.listener, selectors.EVENT_READ,
                          Listener(self.admission, self.listener))
        if self.unix_listener is not None:
            self.sel.register(self.unix_listener, selectors.EVENT_READ,
                              Listener(self.admission, self.unix_listener))
        self.refs = 0
        self._thread = threading.Thread(target=self._run, name="aiordma-soft0-nic", daemon=True)
        self._tid: int | None = None
        self._thread.start()

    def _open_sockets(self, host: str, port: int,
                      opened: list[socket.socket | selectors.BaseSelector | int]) -> None:
        """The listeners, the selector and the wake-up pipe; each goes into ``opened``
        as it is made. Raises DeviceError, or ResourceLimitError when out of
        descriptors."""
        try:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            ls = socket.socket(family, socket.SOCK_STREAM)
            opened.append(ls)
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind((host, port))
            ls.listen(512)
            ls.setblocking(False)
            self.listener = ls
            self.host = host
            self.port: int = ls.getsockname()[1]
            self.unix_listener: socket.socket | None = None
            if addr.unix_enabled():
                us = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                opened.append(us)
                try:
                    us.bind(addr.unix_name(host, self.port))
                    us.listen(512)
                    us.setblocking(False)
                    self.unix_listener = us
                except OSError as exc:  # e.g. a stale name: TCP only, which always works
                    log.debug("soft device: no same-host Unix socket: %s", exc)
                    us.close()
            self.gids = addr.gid_table(host)
            self.sel = selectors.DefaultSelector()
            opened.append(self.sel)
            self._wake_r, self._wake_w = os.pipe()
            opened += [self._wake_r, self._wake_w]
        except OSError as exc:
            lim = fd_limit_error(exc, "the soft device cannot start")
            if lim is not None:
                raise lim from None
            raise DeviceError(f"soft device cannot listen on {host}:{port}: {exc}") from exc
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)

    # --- scheduling ---------------------------------------------------------------------
    def in_nic_thread(self) -> bool:
        return threading.get_ident() == self._tid

    def _wake(self) -> None:
        if not self._wake_pending:
            self._wake_pending = True
            try:
                os.write(self._wake_w, b"\0")
            except (BlockingIOError, OSError):
                pass

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the NIC thread (lock held) soon. Thread-safe."""
        self._calls.append(fn)
        if threading.get_ident() != self._tid:
            self._wake()

    def call_at(self, when: float, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the NIC thread (lock held) at monotonic time ``when``. Lock held."""
        heapq.heappush(self._timers, (when, next(self._seq), fn))
        if when < self._planned_wake and threading.get_ident() != self._tid:
            self._wake()

    # --- manual progress (cq.SoftCompChannel) -------------------------------------------------
    def add_progress_channel(self, ch: SoftCompChannel) -> None:
        """Lock held: watch ``ch`` (the watchdog runs while any channel is registered)."""
        self._progress_channels.add(ch)
        if threading.get_ident() != self._tid:
            self._wake()  # recompute the select timeout

    def remove_progress_channel(self, ch: SoftCompChannel) -> None:
        """Lock held."""
        self._progress_channels.discard(ch)
        if ch.takeover:
            ch.takeover = False
            fd = ch.progress_fd
            self.call_soon(lambda: self._sel_drop(fd))

    def _sel_drop(self, fd: int) -> None:
        try:
            self.sel.unregister(fd)
        except (KeyError, ValueError, OSError):
            pass

    def _watch(self) -> None:
        """NIC thread, lock held: take over the channels whose consumer stalled."""
        for ch in self._progress_channels:
            if ch._watchdog():
                ch.takeover = True
                log.debug("soft device: %r not polled; the NIC thread drives it", ch)
                try:
                    self.sel.register(ch.progress_fd, selectors.EVENT_READ, _Takeover(ch))
                except (KeyError, ValueError, OSError):  # pragma: no cover
                    ch.takeover = False

    def end_takeover(self, ch: SoftCompChannel) -> None:
        """NIC thread, lock held: the channel's consumer polls again."""
        self._sel_drop(ch.progress_fd)

    def alloc_qpn(self) -> int:
        """A random QP number not in use (lock held; keys.random_qpn)."""
        return random_qpn(self.qps)

    # --- selector (NIC thread) ---------------------------------------------------------
    def selector_set(self, conn: Conn, old: int, new: int) -> None:
        assert conn.sock is not None
        try:
            if old == 0:
                self.sel.register(conn.sock, new, conn)
            elif new == 0:
                self.sel.unregister(conn.sock)
            else:
                self.sel.modify(conn.sock, new, conn)
        except (KeyError, ValueError, OSError):  # pragma: no cover - defensive
            log.exception("selector update failed for %r", conn)

    def selector_unregister(self, conn: Conn) -> None:
        assert conn.sock is not None
        try:
            self.sel.unregister(conn.sock)
        except (KeyError, ValueError, OSError):
            pass

    # --- connections (NIC thread, lock held) ---------------------------------------------
    def conn_hello(self, sock: socket.socket, peer: tuple[str, int], qp: SoftQP, src_qpn: int,
                   dst_qpn: int) -> None:
        """A connection whose HELLO passed (admission.py) becomes a ``Conn`` of ``qp``:
        bound as its responder connection, or held until it reaches RTR. Lock held."""
        tune(sock)
        conn = Conn(self, sock, None, state=OPEN)
        conn.peer = peer
        conn.hello = (src_qpn, dst_qpn)
        conn._update_sel()
        st = qp._state
        if st == QPState.INIT:
            # requests from a peer that is ahead of us wait until we are RTR
            self._held.setdefault(dst_qpn, []).append(conn)
            conn.pause_reading()
        elif st in (QPState.RTR, QPState.RTS):
            qp._bind_resp(conn, src_qpn)
        else:
            conn.shutdown(graceful=False)

    def release_held(self, qpn: int) -> None:
        """QP ``qpn`` reached RTR: bind the connections that waited for it."""
        qp = self.qps.get(qpn)
        for conn in self._held.pop(qpn, []):
            if conn.state != OPEN:
                continue
            if qp is None or qp._state not in (QPState.RTR, QPState.RTS):
                conn.shutdown(graceful=False)
                continue
            assert conn.hello is not None
            if qp._bind_resp(conn, conn.hello[0]):
                conn.resume_reading()

    def drop_held(self, qpn: int) -> None:
        for conn in self._held.pop(qpn, []):
            conn.shutdown(graceful=False)

    # --- the NIC thread ---------------------------------------------------------------------
    def _run(self) -> None:
        self._tid = threading.get_ident()
        sel = self.sel
        lock = self.lock
        while True:
            with lock:
                if self._stopping:
                    break
                if self._calls:
                    timeout: float | None = 0.0
                    self._planned_wake = 0.0
                else:
                    when = self._timers[0][0] if self._timers else float("inf")
                    if self._progress_channels:
                        when = min(when, self._next_watch)
                    self._planned_wake = when
                    timeout = None if when == float("inf") else max(0.0, when - time.monotonic())
            try:
                events = sel.select(timeout)
            except OSError:  # pragma: no cover
                log.exception("soft device selector failed")
                time.sleep(0.01)
                continue
            for key, mask in events:
                try:
                    key.data.on_event(mask)
                except Exception:  # pragma: no cover - a bug; keep the device alive
                    log.exception("soft device: error handling %r", key.data)
            with lock:
                self._planned_wake = 0.0
                n = len(self._calls)
                while n and self._calls:
                    n -= 1
                    fn = self._calls.popleft()
                    try:
                        fn()
                    except Exception:  # pragma: no cover
                        log.exception("soft device: callback %r failed", fn)
                now = time.monotonic()
                if self._progress_channels and now >= self._next_watch:
                    self._next_watch = now + WATCHDOG_S
                    self._watch()
                timers = self._timers
                while timers and timers[0][0] <= now:
                    _, _, fn = heapq.heappop(timers)
                    try:
                        fn()
                    except Exception:  # pragma: no cover
                        log.exception("soft device: timer %r failed", fn)

    def stop(self) -> None:
        with self.lock:
            self._stopping = True
        self._wake()
        if self._thread.is_alive() and not self.in_nic_thread():
            self._thread.join(5.0)
        with self.lock:
            for conn in list(self.conns):
                conn.owner = None
                conn._close_now()
            self.conns.clear()
            self._held.clear()
            self.admission.close_all()
            self._calls.clear()
            self._timers.clear()
        try:
            self.sel.close()
        except OSError:  # pragma: no cover
            pass
        self.listener.close()
        if self.unix_listener is not None:
            self.unix_listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:  # pragma: no cover
                pass


_engine_lock = threading.Lock()
_engine: Engine | None = None


def acquire() -> Engine:
    """The process's engine, started if needed; one reference more."""
    global _engine
    with _engine_lock:
        if _engine is None:
            host, port = addr.configured()
            _engine = Engine(host, port)
        _engine.refs += 1
        return _engine


def release(engine: Engine) -> None:
    global _engine
    with _engine_lock:
        engine.refs -= 1
        if engine.refs > 0:
            return
        if _engine is engine:
            _engine = None
    engine.stop()


def current() -> Engine | None:
    return _engine


def _after_fork_in_child() -> None:
    """A forked child gets no NIC thread: forget the parent's device and close its fds
    (so the parent's peers still see EOF when the parent dies). Contexts inherited from
    the parent are unusable in the child, as with verbs without ibv_fork_init."""
    global _engine, _engine_lock
    _engine_lock = threading.Lock()
    e, _engine = _engine, None
    if e is None:
        return
    e.lock = DeviceLock()
    e._stopping = True
    e.admission.close_all()
    socks = [c.sock for c in e.conns if c.sock is not None] + [e.listener]
    if e.unix_listener is not None:
        socks.append(e.unix_listener)
    for s in socks:
        try:
            s.close()
        except OSError:  # pragma: no cover
            pass
    e.conns.clear()
    for fd in (e._wake_r, e._wake_w):
        try:
            os.close(fd)
        except OSError:  # pragma: no cover
            pass
    try:
        e.sel.close()
    except OSError:  # pragma: no cover
        pass


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
