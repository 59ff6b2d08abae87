"""The soft device's outgoing connections: a socket to a peer device, made in the
caller's thread (so that a QP that cannot connect fails its ``modify`` to RTR rather
than its first request), then adopted by the NIC thread (``_core.start_connect``).

Same-host peers are reached over the abstract Unix socket when they have one (no
TCP/IP stack), others over TCP with a non-blocking connect. Running out of
descriptors is a ``ResourceLimitError`` naming the limit, logged once per burst
(until a socket can be made again).
"""

from __future__ import annotations

import errno
import logging
import os
import socket
from typing import TYPE_CHECKING

from ...errors import RDMAError, fd_limit_error
from ...tcp_backoff import cap_backoff
from . import addr

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger("aiordma.soft")

#: socket buffers of same-host (Unix) connections: a 1 MiB message in a few writes
UNIX_SOCKBUF = 4 << 20


def tune(sock: socket.socket) -> None:
    """Socket options of a device connection (TCP: TCP_NODELAY and the retransmission
    back-off capped at 1 s, so that TCP resends within the QP's retry budget; Unix:
    large buffers)."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        cap_backoff(sock)
    elif sock.family == socket.AF_UNIX:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            try:
                sock.setsockopt(socket.SOL_SOCKET, opt, UNIX_SOCKBUF)
            except OSError:  # pragma: no cover
                pass


def _connect_unix(engine: Engine, ip: str, port: int) -> socket.socket | None:
    """A connected Unix socket to the same-host device at ``ip:port``, or None.
    Raises OSError when no socket can be made."""
    if engine.unix_listener is None:
        return None
    for name in addr.unix_names_for(ip, port):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            if sock.connect_ex(name) == 0:
                return sock
        except OSError:
            pass
        sock.close()
    return None


def open_socket(engine: Engine, gid: bytes, port: int) -> tuple[socket.socket, tuple[str, int], int]:
    """A socket to the device with GID ``gid`` on ``port`` (any thread, lock held):
    ``(sock, sockaddr, err)``, ``err`` being -1 for a connected Unix socket, else the
    TCP ``connect_ex`` result. Raises ResourceLimitError when out of descriptors,
    RDMAError for any other failure to make the socket."""
    try:
        family, sa = addr.sockaddr_of(gid, port)
        usock = _connect_unix(engine, sa[0], sa[1])
        if usock is not None:
            return usock, sa, -1
        sock = socket.socket(family, socket.SOCK_STREAM)
    except (OSError, ValueError) as exc:
        raise _socket_error(engine, exc) from exc
    sock.setblocking(False)
    cap_backoff(sock)  # before the SYN: its retransmissions back off the same way
    try:
        return sock, sa, sock.connect_ex(sa)
    except OSError as exc:  # pragma: no cover - connect_ex reports errors as values
        sock.close()
        raise _socket_error(engine, exc) from exc


def _socket_error(engine: Engine, exc: OSError | ValueError) -> RDMAError:
    what = "soft device: cannot open a connection to the peer"
    err = fd_limit_error(exc, what) if isinstance(exc, OSError) else None
    if err is not None:
        if not engine.limit_logged:
            engine.limit_logged = True
            log.warning("%s", err)
        return err
    return RDMAError(getattr(exc, "errno", None) or errno.EINVAL, f"{what}: {exc}")


def probe_descriptor(engine: Engine) -> None:
    """Raise ResourceLimitError when the process cannot open one more descriptor (the
    connection a peer is about to open to us will need one)."""
    try:
        os.close(os.dup(engine.listener.fileno()))
    except OSError as exc:
        raise _socket_error(engine, exc) from exc
