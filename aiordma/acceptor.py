"""A listener's sockets and its accept loop, on the event loop (``loop.add_reader``).

asyncio's and uvloop's servers handle running out of descriptors differently (asyncio
logs and pauses a second; libuv accepts and drops the waiting connections, one error
each), and neither lets the server tell the client why. Here, the same on both loops:

* Out of descriptors (EMFILE/ENFILE) is logged once per burst (until an accept works
  again), naming the limit. The acceptor keeps one **reserve descriptor**: it closes
  it, accepts the waiting connection, hands it to ``refuse`` (the listener answers
  REJECT with the reason, so the client gets a typed error at once instead of a
  timeout), and opens the reserve again. When even that fails, accepting pauses
  with a back-off (0.1 s doubling to 2 s) instead of spinning on a socket that stays
  readable.
* Every other accepted socket goes to ``accept`` (non-blocking), at most ``backlog`` per
  readiness event.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
from collections.abc import Callable
from typing import Any, Final

from .errors import fd_limit_error

log = logging.getLogger("aiordma")

BACKLOG: Final = 512
_EXHAUSTED: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
_BACKOFF_S: Final = (0.1, 2.0)


def bind(host: str | None, port: int) -> list[socket.socket]:
    """Bound, non-blocking sockets for ``host`` (None or "": every interface) and
    ``port`` (0: one free port, the same for every address where it can be); they
    listen once an ``Acceptor`` starts (like asyncio's ``start_serving=False``).
    Raises OSError (address in use, no such host)."""
    infos = socket.getaddrinfo(host or None, port, socket.AF_UNSPEC, socket.SOCK_STREAM, 0,
                               socket.AI_PASSIVE)
    socks: list[socket.socket] = []
    seen: set[tuple[int, Any]] = set()
    try:
        for family, kind, proto, _name, sa in infos:
            if (family, sa[0]) in seen:
                continue
            seen.add((family, sa[0]))
            s = socket.socket(family, kind, proto)
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                    s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                where = (sa[0], socks[0].getsockname()[1] if socks and not port else sa[1],
                         *sa[2:])
                s.bind(where)
                s.setblocking(False)
            except OSError as exc:
                s.close()
                if socks and not port and exc.errno == errno.EADDRINUSE:
                    continue  # the free port of the first address is taken here: skip
                raise
            socks.append(s)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def _open_reserve() -> int | None:
    try:
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None


class Acceptor:
    """Accepts on ``socks`` while serving; ``accept(sock)`` gets each new connection,
    ``refuse(sock, exc)`` one accepted on the reserve while out of descriptors (it must
    close it soon). Not thread-safe: the event loop's thread only."""

    def __init__(self, loop: asyncio.AbstractEventLoop, socks: list[socket.socket],
                 accept: Callable[[socket.socket], None],
                 refuse: Callable[[socket.socket, OSError], None]) -> None:
        self._loop = loop
        self.sockets = socks
        self._accept = accept
        self._refuse = refuse
        self._serving = False  # readers installed
        self._wanted = False  # start() was called (serving, even while paused)
        self._closed = False
        self._reserve = _open_reserve()
        self._backoff = 0.0  # > 0: accepting is failing (a burst); the pause to use
        self._paused: asyncio.TimerHandle | None = None
        #: counters
        self.exhausted = 0
        self.refused = 0

    def start(self) -> None:
        """Start accepting (idempotent)."""
        if self._closed:
            return
        if not self._wanted:
            for s in self.sockets:
                s.listen(BACKLOG)
        self._wanted = True
        if self._serving or self._paused is not None:
            return
        self._serving = True
        for s in self.sockets:
            self._loop.add_reader(s.fileno(), self._ready, s)

    def is_serving(self) -> bool:
        return self._wanted and not self._closed

    def close(self) -> None:
        """Stop accepting and close the sockets (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self._stop_readers()
        if self._paused is not None:
            self._paused.cancel()
        for s in self.sockets:
            s.close()
        self.sockets = []
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None

    def _stop_readers(self) -> None:
        if self._serving:
            self._serving = False
            for s in self.sockets:
                self._loop.remove_reader(s.fileno())

    def _ready(self, lsock: socket.socket) -> None:
        for _ in range(BACKLOG):
            try:
                sock, _addr = lsock.accept()
            except (BlockingIOError, InterruptedError, ConnectionAbortedError):
                return
            except OSError as exc:
                if exc.errno in _EXHAUSTED:
                    self._exhausted(lsock, exc)
                else:  # pragma: no cover - e.g. EPROTO: that one connection failed
                    log.debug("aiordma: accept failed: %s", exc)
                return
            self._backoff = 0.0
            sock.setblocking(False)
            self._accept(sock)

    def _exhausted(self, lsock: socket.socket, exc: OSError) -> None:
        self.exhausted += 1
        first, longest = _BACKOFF_S
        if not self._backoff:
            err = fd_limit_error(exc, "aiordma listener: cannot accept connections")
            log.warning("%s; clients are refused until descriptors are free",
                        err if err is not None else f"aiordma listener: accept: {exc}")
            self._backoff = first
        if self._reserve is not None:
            os.close(self._reserve)
            self._reserve = None
            try:
                sock, _addr = lsock.accept()
            except OSError:
                sock = None
            if sock is not None:
                self.refused += 1
                sock.setblocking(False)
                self._refuse(sock, exc)
            self._reserve = _open_reserve()
            if sock is not None and self._reserve is not None:
                return  # the next one is refused the same way, when it is readable
        # no reserve to use: stop polling for a while rather than spin
        self._stop_readers()
        self._paused = self._loop.call_later(self._backoff, self._resume)
        self._backoff = min(longest, self._backoff * 2)

    def _resume(self) -> None:
        self._paused = None
        if self._reserve is None:
            self._reserve = _open_reserve()
        self.start()
