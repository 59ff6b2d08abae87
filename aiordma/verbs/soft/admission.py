"""Admission to the soft device: who may open a connection to it, and what that costs.

* **Same host** (the abstract Unix socket, which has no file permissions): the peer's
  credentials (``SO_PEERCRED``, set by the kernel at connect) are checked at accept,
  before a byte is read. Only the device owner's uid gets further, or one listed in
  ``AIORDMA_SOFT_ALLOW_UIDS`` (comma-separated uids).
* **Pending**: every accepted socket waits for its HELLO (wire.py) in a
  :class:`Pending` entry that costs the socket and a HELLO-sized buffer, nothing else.
  At most ``AIORDMA_SOFT_MAX_PENDING`` (default 128) are pending at once -- a new one
  drops the oldest (a legitimate HELLO travels with its connection and waits for
  microseconds, so a flood of silent connections evicts only its own kind) -- each for
  at most ``AIORDMA_SOFT_HELLO_TIMEOUT`` seconds (default 10: on a lossy link a HELLO
  can need TCP's retransmission back-off -- a first segment lost three times in a row
  arrives after 0.2 + 0.4 + 0.8 + 1.6 s -- and 2 s dropped one connection in ~20 at
  10% loss).
* **The HELLO** must carry a MAC made with the key of the QP it names (``QPAttr.auth_key``)
  over a nonce that QP has not seen. A failure -- bad magic or version, an unknown QP,
  a wrong MAC, a replayed nonce -- closes the socket without an answer; the MAC is
  computed even when the QP is unknown, so the failures look alike from outside.
  A HELLO for a QP that exists but has no key yet (RESET: its owner has not reached
  INIT) waits, still pending, until the QP is keyed and is judged then: hardware
  drops requests to a QP that is not ready and the requester's retries find it ready,
  so a peer that dials first must not lose its connection to that race.
* **Accepting** stops for a back-off (0.1 s, doubling to 2 s) when the process is out
  of file descriptors (EMFILE/ENFILE), logged once per burst, instead of spinning on
  a listening socket that stays readable.

Everything here runs on the NIC thread; the device lock is taken to look at QPs.
"""

from __future__ import annotations

import errno
import functools
import hmac
import logging
import os
import secrets
import selectors
import socket
import struct
import time
from typing import TYPE_CHECKING, Any, Final

from ...errors import DeviceError, fd_limit_error
from . import wire

if TYPE_CHECKING:
    from .engine import Engine
    from .qp import SoftQP

log = logging.getLogger("aiordma.soft")

DEFAULT_MAX_PENDING: Final = 128
DEFAULT_HELLO_TIMEOUT_S: Final = 10.0
ACCEPT_BACKOFF_S: Final = (0.1, 2.0)  # first and longest pause after EMFILE/ENFILE
_CRED: Final = struct.Struct("3i")


def peer_credentials(sock: socket.socket) -> tuple[int, int, int] | None:
    """``(pid, uid, gid)`` of a Unix socket's peer (``SO_PEERCRED``), or None."""
    if sock.family != socket.AF_UNIX:
        return None
    try:
        pid, uid, gid = _CRED.unpack(
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    except OSError:  # pragma: no cover
        return None
    return pid, uid, gid


def _env_number(name: str, default: float, low: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise DeviceError(f"{name}={raw!r} is not a number") from None
    if value < low:
        raise DeviceError(f"{name}={raw!r} must be >= {low:g}")
    return value


def allowed_uids() -> frozenset[int]:
    """The uids admitted on the same-host socket: ours and ``AIORDMA_SOFT_ALLOW_UIDS``."""
    uids = {os.geteuid()}
    raw = os.environ.get("AIORDMA_SOFT_ALLOW_UIDS", "")
    for part in filter(None, (p.strip() for p in raw.split(","))):
        if not part.isdigit():
            raise DeviceError(f"AIORDMA_SOFT_ALLOW_UIDS: {part!r} is not a uid")
        uids.add(int(part))
    return frozenset(uids)


class Pending:
    """An accepted socket whose HELLO has not arrived yet (selector entry)."""

    __slots__ = ("admission", "sock", "peer", "buf", "got", "hello")

    def __init__(self, admission: Admission, sock: socket.socket,
                 peer: tuple[str, int]) -> None:
        self.admission = admission
        self.sock = sock
        self.peer = peer
        self.buf = bytearray(wire.HELLO.size)
        self.got = 0
        #: the unpacked HELLO while it waits for its QP's key (out of the selector)
        self.hello: tuple[Any, ...] | None = None

    def on_event(self, mask: int) -> None:
        self.admission.read(self)


class Listener:
    """Selector entry of one of the device's listening sockets (TCP or Unix)."""

    def __init__(self, admission: Admission, sock: socket.socket) -> None:
        self.admission = admission
        self.sock = sock
        self.unix = sock.family == socket.AF_UNIX

    def on_event(self, mask: int) -> None:
        self.admission.accept_from(self)


class Admission:
    """The device's gate: accepted sockets until their HELLO has passed (NIC thread)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.max_pending = int(_env_number("AIORDMA_SOFT_MAX_PENDING", DEFAULT_MAX_PENDING, 1))
        self.hello_timeout = _env_number("AIORDMA_SOFT_HELLO_TIMEOUT", DEFAULT_HELLO_TIMEOUT_S,
                                         0.01)
        self.uids = allowed_uids()
        self.pending: dict[Pending, None] = {}  # insertion order: oldest first
        #: QP number -> complete HELLOs that wait for that QP's key (still in ``pending``)
        self.unkeyed: dict[int, list[Pending]] = {}
        self._decoy = secrets.token_bytes(32)  # the key a HELLO for no QP is checked with
        self._backoff = 0.0  # the current pause after EMFILE/ENFILE (0: accepting works)
        #: counters (``Engine.statistics``)
        self.refused_credentials = 0
        self.refused_hellos = 0
        self.evicted = 0
        self.timed_out = 0
        self.accept_pauses = 0

    # --- accepting ------------------------------------------------------------------------
    def accept_from(self, listener: Listener) -> None:
        e = self.engine
        for _ in range(64):
            try:
                sock, peer = listener.sock.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._pause(listener, exc)
                return
            self._backoff = 0.0  # accepting works: the next burst of failures is logged anew
            if listener.unix and not self._credentials_ok(sock):
                self.refused_credentials += 1
                sock.close()
                continue
            sock.setblocking(False)
            while len(self.pending) >= self.max_pending:
                self.evicted += 1
                self.drop(next(iter(self.pending)))
            p = Pending(self, sock, peer[:2] if isinstance(peer, tuple) else ("unix", 0))
            self.pending[p] = None
            try:
                e.sel.register(sock, selectors.EVENT_READ, p)
            except (KeyError, ValueError, OSError):  # pragma: no cover - defensive
                self.drop(p)
                continue
            with e.lock:
                e.call_at(time.monotonic() + self.hello_timeout, functools.partial(self._expire, p))
            self.read(p)  # the HELLO usually came with the connection

    def _credentials_ok(self, sock: socket.socket) -> bool:
        cred = peer_credentials(sock)
        return cred is not None and cred[1] in self.uids

    def _pause(self, listener: Listener, exc: OSError) -> None:
        """Out of descriptors: stop polling ``listener`` for a while (NIC thread)."""
        e = self.engine
        self.accept_pauses += 1
        first, longest = ACCEPT_BACKOFF_S
        if not self._backoff:
            err = fd_limit_error(exc, "soft device: cannot accept connections")
            log.warning("%s; accepts pause, retried with back-off up to %gs",
                        err if err is not None else f"soft device: accept: {exc}", longest)
        self._backoff = min(longest, self._backoff * 2) if self._backoff else first
        try:
            e.sel.unregister(listener.sock)
        except (KeyError, ValueError, OSError):  # pragma: no cover
            return

        def resume() -> None:
            if e._stopping:
                return
            try:
                e.sel.register(listener.sock, selectors.EVENT_READ, listener)
            except (KeyError, ValueError, OSError):  # pragma: no cover
                pass

        with e.lock:
            e.call_at(time.monotonic() + self._backoff, resume)

    # --- pending connections --------------------------------------------------------------
    def read(self, p: Pending) -> None:
        """Read what there is of ``p``'s HELLO; judge it once complete (NIC thread)."""
        if p.hello is not None:
            return  # complete, waiting for its QP's key
        try:
            n = p.sock.recv_into(memoryview(p.buf)[p.got:])
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self.drop(p)
            return
        if n == 0:
            self.drop(p)
            return
        p.got += n
        if p.got < len(p.buf):
            return
        h = wire.HELLO.unpack(p.buf)
        e = self.engine
        with e.lock:
            waiting = e.qps.get(h[4])
            if waiting is not None and waiting._auth_key is None:
                p.hello = h  # judged when the QP is keyed (``keyed``), or expires
                self.unkeyed.setdefault(h[4], []).append(p)
                self._unwatch(p)
                return
            self._forget(p)
            self._judge(p, h)

    def keyed(self, qpn: int) -> None:
        """QP ``qpn`` got its key: judge the HELLOs that waited for it (NIC thread, device
        lock held)."""
        for p in self.unkeyed.pop(qpn, []):
            self._forget(p)
            assert p.hello is not None
            self._judge(p, p.hello)

    def _judge(self, p: Pending, h: tuple[Any, ...]) -> None:
        """``p``'s complete HELLO ``h`` (out of ``pending``): bind its socket as a
        connection of the QP it names, or close it without an answer (device lock held)."""
        qp = self.verify(h)
        if qp is None:
            self.refused_hellos += 1
            p.sock.close()
        else:
            self.engine.conn_hello(p.sock, p.peer, qp, h[3], h[4])

    def verify(self, h: tuple[Any, ...]) -> SoftQP | None:
        """The QP a HELLO (unpacked) may bind to, or None (device lock held)."""
        magic, version, src_port, src_qpn, dst_qpn, src_gid, nonce, mac = h
        qp = self.engine.qps.get(dst_qpn)
        key = qp._auth_key if qp is not None and qp._auth_key is not None else self._decoy
        expected = wire.hello_mac(key, magic, version, src_port, src_qpn, dst_qpn, src_gid,
                                  nonce)
        if not hmac.compare_digest(expected, mac) or qp is None or qp._auth_key is None \
                or magic != wire.MAGIC or version != wire.VERSION:
            return None
        return qp if qp._admit_nonce(nonce) else None

    def _expire(self, p: Pending) -> None:
        if p in self.pending:
            # What arrived is read first: this process may have been paused (SIGSTOP, a
            # loaded machine) while the HELLO came, and its timers run late, maybe
            # before the selector reports the socket readable. (Timers run with the
            # device lock held; ``read`` takes it.)
            lock = self.engine.lock
            lock.release()
            try:
                self.read(p)
            finally:
                lock.acquire()
        if p in self.pending:
            self.timed_out += 1
            self.drop(p)

    def _forget(self, p: Pending) -> None:
        self.pending.pop(p, None)
        if p.hello is not None:
            waiting = self.unkeyed.get(p.hello[4])
            if waiting is not None and p in waiting:
                waiting.remove(p)  # (a few entries: at most ``max_pending``)
                if not waiting:
                    del self.unkeyed[p.hello[4]]
        self._unwatch(p)

    def _unwatch(self, p: Pending) -> None:
        try:
            self.engine.sel.unregister(p.sock)
        except (KeyError, ValueError, OSError):
            pass

    def drop(self, p: Pending) -> None:
        """Close a pending connection (no answer)."""
        self._forget(p)
        try:
            p.sock.close()
        except OSError:  # pragma: no cover
            pass

    def close_all(self) -> None:
        """Close every pending socket (device stopping, or a forked child's copy)."""
        for p in list(self.pending):
            try:
                p.sock.close()
            except OSError:  # pragma: no cover
                pass
        self.pending.clear()
        self.unkeyed.clear()

    def statistics(self) -> dict[str, int]:
        return {"pending": len(self.pending), "refused_credentials": self.refused_credentials,
                "refused_hellos": self.refused_hellos, "evicted": self.evicted,
                "timed_out": self.timed_out, "accept_pauses": self.accept_pauses}
