"""The cap of TCP's retransmission back-off on aiordma's own TCP connections (a leaf
module: every layer may import it).

TCP resends a segment that is lost again after twice the previous wait (from 200 ms,
up to 120 s). Two of aiordma's deadlines count time without an answer over TCP: a
soft QP's retry budget (``(retry_cnt + 1)`` tries of the local ACK timer, 8.6 s by
default; the soft requester never resends, TCP underneath does) and the heartbeat's
``liveness_timeout`` (8 s). Under sustained loss the doubling alone outgrows them: a
segment lost five times in a row is resent 0.2 + 0.4 + 0.8 + 1.6 + 3.2 s later, a sixth
loss adds 6.4 s, and a live connection fails with ``RetryExceededError`` or
``PeerUnresponsive``. With the back-off capped at 1 s, TCP resends a lost segment at
least once a second while the deadline runs, as an RDMA NIC resends once per ACK
timeout. (10 % loss each way between two network namespaces, three connections with
eight 64 KiB messages in flight for 60 s, an 8-byte answer per message: the longest
wait for an answer was 3.4-6.9 s uncapped, 3.5-3.6 s capped.)

Linux has the per-socket option ``TCP_RTO_MAX_MS`` from 6.15 (1000 ms is the least it
takes); older kernels refuse it, and their connections keep the system's back-off.
"""

from __future__ import annotations

import socket
from typing import Final

#: ``TCP_RTO_MAX_MS`` of linux/tcp.h (Python's socket module names it from 3.14)
TCP_RTO_MAX_MS: Final = getattr(socket, "TCP_RTO_MAX_MS", 44)
#: the cap, in ms: the least the kernel takes
RTO_MAX_MS: Final = 1000


def cap_backoff(sock: socket.socket) -> bool:
    """Cap the retransmission back-off of the TCP socket ``sock`` at ``RTO_MAX_MS``.
    Returns True when the kernel took it, False when it refused the option (Linux
    before 6.15, another system) or ``sock`` is not a TCP socket. Never raises for a
    refusal: the connection works as before without the cap."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return False
    try:
        sock.setsockopt(socket.IPPROTO_TCP, TCP_RTO_MAX_MS, RTO_MAX_MS)
    except OSError:
        return False
    return True


def available() -> bool:
    """True when this kernel caps a TCP socket's back-off (``cap_backoff`` would)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            return cap_backoff(s)
    except OSError:  # no socket at all: nothing to cap
        return False
