"""Sans-IO protocol logic of aiordma: no asyncio, no provider, no sockets.

* ``engine``: the message engine, compiled (``engine.pyx``): its parts are the frame
  header of every SEND (DATA, RNDV, RNDV_DONE, CREDIT, CLOSE, BATCH), receive-credit
  flow control (no RNR, no deadlock, no CREDIT storms), send-queue accounting, buffer
  slots, and the sender and receiver.
* ``handshake``: the versioned out-of-band connection-setup codec.
* ``state``: the connection state machine's states, events and rules (OPEN .. CLOSED /
  FAILED); ``ConnectionState`` (the engine's) applies them.
* ``errors``: ``LocalProtocolError`` (we broke the rules), ``RemoteProtocolError`` (peer did).
"""

try:
    from . import engine as _engine  # noqa: F401  (compiled: say why when it is missing)
except ImportError as _exc:
    from aiordma.native import extension_status

    raise ImportError(f"aiordma's message engine is not built "
                      f"({extension_status('aiordma.protocol.engine') or _exc}); build it "
                      "with a C compiler: pip install . or make core") from _exc

from .engine import (
    HEADER,
    HEADER_SIZE,
    MAX_CREDITS,
    MIN_SLOTS,
    RNDV_BODY,
    RNDV_FAILED,
    RNDV_OK,
    RNDV_SIZE,
    ConnectionState,
    CreditState,
    Frame,
    FrameType,
    parse_frame,
    write_close,
    write_credit,
    write_data_header,
    write_rndv,
    write_rndv_done,
)
from .errors import LocalProtocolError, RemoteProtocolError
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
from .state import Event, State

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
