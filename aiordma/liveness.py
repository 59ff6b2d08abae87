"""The endpoint's watch over its setup connection, for the endpoint's life: the peer's
EOF (its process ended, or it closed), and the heartbeat (``protocol.heartbeat``) that
finds a peer whose process is frozen or whose host is gone or cut off, which no EOF
ever tells (a frozen process's kernel still acknowledges TCP and its keepalives).

``watch`` is the whole contract: it returns at EOF or when the connection breaks,
raises ``PeerUnresponsive`` when the heartbeat gives up on the peer, and
``RemoteProtocolError`` for garbage on the connection. The endpoint fails itself with
either error; every pending operation then fails with ``ConnectionClosed`` whose
``__cause__`` it is.
"""

from __future__ import annotations

import asyncio
import contextlib

from .errors import PeerUnresponsive
from .options import EndpointOptions
from .protocol.heartbeat import Heartbeat

__all__ = ["Heartbeat", "heartbeat_for", "statistics", "watch"]

_READ: int = 4096


def heartbeat_for(opts: EndpointOptions, *, peer_answers: bool, accepting: bool,
                  now: float) -> Heartbeat | None:
    """The heartbeat of a new endpoint: None when the peer does not answer PINGs (it did
    not announce ``HANDSHAKE_FLAG_LIVENESS``), else one with ``liveness_timeout``
    (None: this side never judges the peer, but answers it)."""
    if not peer_answers:
        return None
    return Heartbeat(opts.liveness_timeout, accepting=accepting, now=now)


def statistics(hb: Heartbeat | None) -> dict[str, object]:
    """``Endpoint.statistics()["heartbeat"]``: whether it runs, its timeout, PINGs sent
    and PONGs received."""
    if hb is None:
        return {"active": False}
    return {"active": True, "timeout": hb.timeout, "pings_sent": hb.pings_sent,
            "pongs_received": hb.pongs_received}


async def watch(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                hb: Heartbeat | None) -> None:
    """Read the setup connection until EOF (return) or until ``hb`` counts the peer
    unresponsive (raise ``PeerUnresponsive``); answer and send heartbeat frames
    meanwhile. Without ``hb`` anything the peer sends is ignored (a peer without the
    heartbeat sends nothing). Cancellable."""
    if hb is None:
        with contextlib.suppress(ConnectionError, OSError):
            while await reader.read(_READ):
                pass
        return
    loop = asyncio.get_running_loop()
    dead: asyncio.Future[None] = loop.create_future()
    handle: asyncio.TimerHandle | None = None

    def send(data: bytes) -> None:
        if data and not writer.is_closing():
            with contextlib.suppress(ConnectionError, OSError, RuntimeError):
                writer.write(data)

    def arm() -> None:
        nonlocal handle
        if handle is not None:
            handle.cancel()
        when = hb.schedule()
        handle = loop.call_at(when, tick) if when is not None else None

    def tick() -> None:
        nonlocal handle
        handle = None
        send(hb.poll(loop.time()))
        if hb.unresponsive:
            if not dead.done():
                dead.set_result(None)
            return
        arm()

    read: asyncio.Future[bytes] | None = None
    try:
        send(hb.start(loop.time()))
        arm()
        while True:
            read = asyncio.ensure_future(reader.read(_READ))
            await asyncio.wait((read, dead), return_when=asyncio.FIRST_COMPLETED)
            if dead.done():
                raise PeerUnresponsive(
                    f"the peer answered no heartbeat for {hb.timeout:g}s (liveness_timeout): "
                    "its process is frozen, or its host is down or unreachable")
            try:
                data = read.result()
            except (ConnectionError, OSError):
                return
            read = None
            if not data:
                return
            send(hb.received(data, loop.time()))
            arm()
    finally:
        if handle is not None:
            handle.cancel()
        if read is not None:
            if not read.done():
                read.cancel()
            elif not read.cancelled():
                read.exception()  # (a reset the watch was cancelled before it saw)
