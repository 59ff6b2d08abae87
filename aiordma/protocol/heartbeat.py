"""Liveness of the peer over the setup connection: PING/PONG frames and when the peer
counts as unresponsive. Sans-IO: the caller feeds received bytes and the clock, sends
what the methods return, and calls ``poll`` at the time ``schedule`` returns (again
after each ``received``/``poll``).

After the handshake the setup TCP connection stays open for the endpoint's life. When
both sides announced ``HANDSHAKE_FLAG_LIVENESS`` it carries 9-byte frames in both
directions, integers in network byte order::

    kind u8 (1 PING, 2 PONG) | token u64

Rules (``Heartbeat``):

1. Each side answers every PING at once with a PONG of the same token -- from its
   event loop, so a process that is frozen (stopped, or its loop blocked) does not
   answer, although its kernel still acknowledges TCP and its keepalives.
2. The accepting side sends a PING as soon as its endpoint starts. The connecting side
   sends nothing before it has received a frame: until then the listener may still be
   reading the end of the handshake, where a heartbeat frame would be garbage.
3. With a ``timeout`` (seconds), a side sends a PING every ``timeout / 4`` and counts
   the peer unresponsive when it has received nothing for ``timeout``: the peer froze
   or its host is unreachable ``timeout - timeout / 4`` to ``timeout`` seconds before
   that (an answer is at most one interval old when it stops coming). ``None``: it
   never pings and never judges, but still answers (rule 1).
4. Time while our own side did not run does not count against the peer: when a
   wake-up comes more than one interval late, the peer gets one more interval from
   then (a PING goes out at once) before it can count as unresponsive.
5. Anything else on the connection is a protocol violation (``RemoteProtocolError``).
"""

from __future__ import annotations

import struct
from typing import Final

from .errors import RemoteProtocolError

__all__ = ["FRAME", "PING", "PONG", "INTERVALS", "HANDSHAKE_FLAG_LIVENESS", "Heartbeat"]

FRAME: Final = struct.Struct("!BQ")
PING: Final = 1
PONG: Final = 2
#: PINGs per ``timeout`` (rule 3)
INTERVALS: Final = 4
HANDSHAKE_FLAG_LIVENESS: Final = 2
"""Handshake ``flags`` bit: this endpoint answers heartbeat PINGs on the setup connection."""

_U64: Final = (1 << 64) - 1


class Heartbeat:
    """One side's heartbeat state (module docstring, rules 1-5).

    ``timeout``: seconds without any frame from the peer before it counts as
    unresponsive (None: never). ``accepting``: this side accepted the connection
    (it speaks first, rule 2). ``now``: the clock at start (any monotonic seconds).
    """

    def __init__(self, timeout: float | None, *, accepting: bool, now: float) -> None:
        if timeout is not None and timeout <= 0:
            raise ValueError("timeout must be positive or None")
        self.timeout = timeout
        self.interval = timeout / INTERVALS if timeout is not None else None
        self.accepting = accepting
        self.last_heard = now
        self.unresponsive = False
        self.pings_sent = 0
        self.pongs_received = 0
        self._may_send = accepting
        self._next_ping = now
        self._wakeup: float | None = None
        self._token = 0
        self._buf = b""

    # --- input ----------------------------------------------------------------------
    def received(self, data: bytes, now: float) -> bytes:
        """Bytes from the peer: the PONGs to send back (rule 1), possibly ``b""``.
        Raises RemoteProtocolError for anything but whole PING/PONG frames (a
        trailing partial frame waits for the rest)."""
        buf = self._buf + data if self._buf else data
        n = len(buf) - len(buf) % FRAME.size
        out = bytearray()
        for off in range(0, n, FRAME.size):
            kind, token = FRAME.unpack_from(buf, off)
            if kind == PING:
                out += FRAME.pack(PONG, token)
            elif kind == PONG:
                self.pongs_received += 1
            else:
                raise RemoteProtocolError(f"unexpected byte {kind:#x} on the setup connection")
        self._buf = bytes(buf[n:])
        if n:
            self.last_heard = max(self.last_heard, now)
            if not self._may_send:
                self._may_send = True
                self._next_ping = now  # our first PING may go now
        return bytes(out)

    # --- clock ----------------------------------------------------------------------
    def poll(self, now: float) -> bytes:
        """The clock advanced to ``now``: the PING to send (or ``b""``); sets
        ``unresponsive`` when the peer has been silent for ``timeout`` (rule 3)."""
        timeout, interval = self.timeout, self.interval
        if timeout is None or interval is None or self.unresponsive:
            return b""
        late = self._wakeup is not None and now > self._wakeup + interval
        if late:  # rule 4: we did not run; give the peer one more interval from now
            self.last_heard = max(self.last_heard, now - timeout + interval)
            self._next_ping = now
        if now >= self.last_heard + timeout:
            self.unresponsive = True
            return b""
        out = b""
        if self._may_send and now >= self._next_ping:
            out = self._ping()
            self._next_ping = now + interval
        return out

    def _ping(self) -> bytes:
        self._token = (self._token + 1) & _U64
        self.pings_sent += 1
        return FRAME.pack(PING, self._token)

    def start(self, now: float) -> bytes:
        """What to send when the endpoint starts: the accepting side's first PING (rule
        2, even without a timeout of its own), else ``b""``."""
        if not self.accepting:
            return b""
        # (without a timeout of our own: one PING all the same, to unblock the peer)
        return self.poll(now) or self._ping()

    def schedule(self) -> float | None:
        """When ``poll`` must run next (None: never). Remembered: a ``poll`` that comes
        more than an interval after it finds our side was not running (rule 4)."""
        if self.timeout is None or self.interval is None or self.unresponsive:
            self._wakeup = None
        else:
            deadline = self.last_heard + self.timeout
            self._wakeup = min(self._next_ping, deadline) if self._may_send else deadline
        return self._wakeup
