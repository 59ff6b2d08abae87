"""Protocol errors that say who broke the rules (h11 style).

``LocalProtocolError``: this side tried something the protocol forbids (a bug in the
caller: sending without credit, sending after CLOSE, an out-of-range header field).
``RemoteProtocolError``: the peer sent something the protocol forbids (a malformed frame,
returned credits it never had, data after its CLOSE). Both are ``RDMAError``s with
``errno.EPROTO``; ``exc.strerror`` is the precise reason.
"""

from __future__ import annotations

import errno

from aiordma.errors import RDMAError

__all__ = ["LocalProtocolError", "RemoteProtocolError"]


class _ProtocolError(RDMAError):
    def __init__(self, msg: str) -> None:
        super().__init__(errno.EPROTO, msg)

    def __reduce__(self) -> tuple[type, tuple[str]]:  # OSError's reduce would pass 2 args
        return (type(self), (str(self.strerror),))


class LocalProtocolError(_ProtocolError):
    """We broke the protocol (a local misuse); nothing was sent."""


class RemoteProtocolError(_ProtocolError):
    """The peer broke the protocol; the connection cannot continue."""
