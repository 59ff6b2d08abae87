"""Sans-IO protocol logic of aiordma: no asyncio, no provider, no sockets.

* ``framing``: the 8-byte header of every SEND (DATA, RNDV, RNDV_DONE, CREDIT, CLOSE).
* ``credits``: receive-credit flow control (no RNR, no deadlock, no CREDIT storms).
* ``handshake``: the versioned out-of-band connection-setup codec.
* ``state``: the connection state machine (OPEN .. CLOSED / FAILED).
* ``errors``: ``LocalProtocolError`` (we broke the rules), ``RemoteProtocolError`` (peer did).
"""

from .credits import MIN_SLOTS, CreditState
from .errors import LocalProtocolError, RemoteProtocolError
from .framing import (
    HEADER,
    HEADER_SIZE,
    MAX_CREDITS,
    RNDV_BODY,
    RNDV_FAILED,
    RNDV_OK,
    RNDV_SIZE,
    Frame,
    FrameType,
    parse_frame,
    write_close,
    write_credit,
    write_data_header,
    write_rndv,
    write_rndv_done,
)
from .handshake import (
    Accept,
    HandshakeDecoder,
    Hello,
    Kind,
    Message,
    Ready,
    Reject,
    encode,
    encode_accept,
    encode_hello,
    encode_ready,
    encode_reject,
)
from .state import ConnectionState, Event, State

__all__ = [
    "LocalProtocolError",
    "RemoteProtocolError",
    "HEADER",
    "HEADER_SIZE",
    "MAX_CREDITS",
    "RNDV_BODY",
    "RNDV_FAILED",
    "RNDV_OK",
    "RNDV_SIZE",
    "Frame",
    "FrameType",
    "parse_frame",
    "write_close",
    "write_credit",
    "write_data_header",
    "write_rndv",
    "write_rndv_done",
    "MIN_SLOTS",
    "CreditState",
    "Accept",
    "HandshakeDecoder",
    "Hello",
    "Kind",
    "Message",
    "Ready",
    "Reject",
    "encode",
    "encode_accept",
    "encode_hello",
    "encode_ready",
    "encode_reject",
    "ConnectionState",
    "Event",
    "State",
]
