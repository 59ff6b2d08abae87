"""Out-of-band (TCP) connection-setup codec: versioned, length-checked, sans-IO.

Every message is a 12-byte header then a body, all integers in network byte order::

    magic b"AIOR" | version u16 | kind u8 | reserved u8 (0) | body length u32 | body

Kinds: HELLO (client -> server: its QP parameters), ACCEPT (server -> client: its own
parameters, same body as HELLO), REJECT (server -> client: utf-8 reason, <= 256 bytes),
READY (client -> server, empty: the client's QP is ready to receive).

HELLO/ACCEPT body (``_PARAMS``, 46 bytes, then the provider name)::

    qp_num u32 | psn u32 | gid 16s | lid u16 | mtu u8 | recv_credits u16 | eager_size u32
    | max_message_size u64 | flags u32 | provider length u8 | provider (ascii)

An ACCEPT decodes to ``Accept(params=Hello(...))``, a separate class so that
``isinstance(msg, Hello)`` (or ``case Hello()``) never matches a server's reply.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from aiordma.errors import HandshakeError

from .credits import MIN_SLOTS

__all__ = [
    "MAGIC",
    "VERSION",
    "MAX_BODY",
    "MAX_REASON",
    "PROVIDERS",
    "Kind",
    "Hello",
    "Accept",
    "Reject",
    "Ready",
    "Message",
    "encode",
    "encode_hello",
    "encode_accept",
    "encode_reject",
    "encode_ready",
    "HandshakeDecoder",
]

MAGIC = b"AIOR"
VERSION = 1
MAX_BODY = 1024
MAX_REASON = 256
MAX_PROVIDER = 16
PROVIDERS = frozenset({"soft", "verbs"})
MIN_EAGER = 64
MAX_EAGER = 16 << 20
MAX_MESSAGE = 1 << 40

_HEADER = struct.Struct("!4sHBBI")
_PARAMS = struct.Struct("!II16sHBHIQIB")
HEADER_SIZE = _HEADER.size  # 12


class Kind(IntEnum):
    """The ``kind`` byte of a handshake message."""

    HELLO = 1
    ACCEPT = 2
    REJECT = 3
    READY = 4


@dataclass(frozen=True)
class Hello:
    """One side's connection parameters. Construction validates every field and raises
    ``ValueError`` naming the first one out of range."""

    qp_num: int
    psn: int
    gid: bytes
    lid: int
    mtu: int
    recv_credits: int
    eager_size: int
    max_message_size: int
    provider: str
    flags: int = 0

    def __post_init__(self) -> None:
        problem = _check_params(self)
        if problem:
            raise ValueError(problem)


@dataclass(frozen=True)
class Accept:
    """The server's reply to HELLO: its own parameters."""

    params: Hello


@dataclass(frozen=True)
class Reject:
    """The server refused the connection; ``reason`` is for humans."""

    reason: str


@dataclass(frozen=True)
class Ready:
    """The client's QP is ready (RTR/RTS): the server may send."""


Message = Hello | Accept | Reject | Ready


def _check_params(h: Hello) -> str | None:
    """The first out-of-range field of ``h`` as a message, or None."""
    ints = (
        ("qp_num", h.qp_num, 0, (1 << 24) - 1),
        ("psn", h.psn, 0, (1 << 24) - 1),
        ("lid", h.lid, 0, 0xFFFF),
        ("mtu", h.mtu, 1, 5),
        ("recv_credits", h.recv_credits, MIN_SLOTS, 0xFFFF),
        ("eager_size", h.eager_size, MIN_EAGER, MAX_EAGER),
        ("max_message_size", h.max_message_size, max(MIN_EAGER, h.eager_size), MAX_MESSAGE),
        ("flags", h.flags, 0, 0xFFFFFFFF),
    )
    for name, value, lo, hi in ints:
        if not isinstance(value, int) or isinstance(value, bool):
            return f"{name} must be an int, got {type(value).__name__}"
        if not lo <= value <= hi:
            return f"{name} {value} out of range ({lo}..{hi})"
    if not isinstance(h.gid, bytes) or len(h.gid) != 16:
        return f"gid must be 16 bytes, got {h.gid!r}"
    if h.provider not in PROVIDERS:
        return f"unknown provider {h.provider!r} (expected one of {sorted(PROVIDERS)})"
    return None


# -- encoding ------------------------------------------------------------------------------


def _frame(kind: Kind, body: bytes) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, kind, 0, len(body)) + body


def encode_hello(h: Hello, kind: Kind = Kind.HELLO) -> bytes:
    """Encode ``h`` as a HELLO (default) or ACCEPT message. ``ValueError`` for any other
    kind. ``h`` was validated when constructed."""
    if kind not in (Kind.HELLO, Kind.ACCEPT):
        raise ValueError(f"encode_hello needs kind HELLO or ACCEPT, got {kind!r}")
    p = h.provider.encode("ascii")
    body = _PARAMS.pack(
        h.qp_num, h.psn, h.gid, h.lid, h.mtu, h.recv_credits, h.eager_size,
        h.max_message_size, h.flags, len(p),
    ) + p  # fmt: skip
    return _frame(kind, body)


def encode_accept(params: Hello) -> bytes:
    """Encode the server's parameters as an ACCEPT message."""
    return encode_hello(params, Kind.ACCEPT)


def encode_reject(reason: str) -> bytes:
    """Encode a REJECT; the utf-8 reason is cut to 256 bytes (at a character boundary)."""
    raw = reason.encode("utf-8")[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    return _frame(Kind.REJECT, raw)


def encode_ready() -> bytes:
    """Encode a READY message (empty body)."""
    return _frame(Kind.READY, b"")


def encode(msg: Message) -> bytes:
    """Encode any handshake message."""
    if isinstance(msg, Hello):
        return encode_hello(msg)
    if isinstance(msg, Accept):
        return encode_accept(msg.params)
    if isinstance(msg, Reject):
        return encode_reject(msg.reason)
    if isinstance(msg, Ready):
        return encode_ready()
    raise TypeError(f"not a handshake message: {msg!r}")


# -- decoding ------------------------------------------------------------------------------

_MIN_PARAMS = _PARAMS.size
_BODY_RANGE = {
    Kind.HELLO: (_MIN_PARAMS, _MIN_PARAMS + MAX_PROVIDER),
    Kind.ACCEPT: (_MIN_PARAMS, _MIN_PARAMS + MAX_PROVIDER),
    Kind.REJECT: (0, MAX_REASON),
    Kind.READY: (0, 0),
}


class HandshakeDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, get whole messages back.

    Any violation raises ``HandshakeError`` and poisons the decoder: every later ``feed``
    or ``eof`` raises the same error again. Header checks (magic, version, kind, reserved,
    body length) run as soon as the 12 header bytes are in, so an oversize body is refused
    before it is buffered; a wrong magic is refused as soon as its first byte differs.

    If ``feed`` decodes messages and then meets an error in the same data, it returns
    those messages and raises the error on the next ``feed``/``eof`` (``error`` shows it at
    once). So the messages obtained and the error raised do not depend on how the input
    was split.
    """

    __slots__ = ("_buf", "_error")

    def __init__(self) -> None:
        self._buf = bytearray()
        self._error: str | None = None

    @property
    def error(self) -> HandshakeError | None:
        """The error that poisoned the decoder, if any."""
        return None if self._error is None else HandshakeError(self._error)

    def __repr__(self) -> str:
        state = f"failed: {self._error}" if self._error else f"buffered={len(self._buf)}"
        return f"<HandshakeDecoder {state}>"

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete message held back."""
        return len(self._buf)

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        """Add ``data``; return the messages it completes, in order (possibly none)."""
        if self._error is not None:
            raise HandshakeError(self._error)
        self._buf += data
        out: list[Message] = []
        try:
            while True:
                msg = self._next()
                if msg is None:
                    return out
                out.append(msg)
        except HandshakeError as exc:
            self._error = str(exc.strerror)
            self._buf.clear()
            if out:
                return out
            raise

    def eof(self) -> None:
        """The peer closed its side. Raises ``HandshakeError`` if poisoned, or
        ``"truncated ..."`` (and poisons) if an incomplete message is buffered."""
        if self._error is not None:
            raise HandshakeError(self._error)
        if self._buf:
            need = self._need()
            self._error = (
                f"truncated handshake message: connection closed after {len(self._buf)} "
                f"of {need} bytes" if need else
                f"truncated handshake header: connection closed after {len(self._buf)} "
                f"of {HEADER_SIZE} bytes"
            )  # fmt: skip
            self._buf.clear()
            raise HandshakeError(self._error)

    def _need(self) -> int:
        """Total size of the buffered message once its header is known, else 0."""
        if len(self._buf) < HEADER_SIZE:
            return 0
        return HEADER_SIZE + int(_HEADER.unpack_from(self._buf)[4])

    def _next(self) -> Message | None:
        buf = self._buf
        n = len(buf)
        for i in range(min(n, len(MAGIC))):  # refuse a stranger from its first byte
            if buf[i] != MAGIC[i]:
                raise HandshakeError(
                    f"not an aiordma peer: magic byte {i} is {buf[i]:#04x}, expected {MAGIC!r}"
                )
        if n < HEADER_SIZE:
            return None
        _, version, kind, reserved, length = _HEADER.unpack_from(buf)
        if version != VERSION:
            raise HandshakeError(f"version mismatch: peer speaks {version}, we speak {VERSION}")
        if kind not in _BODY_RANGE:
            raise HandshakeError(f"unknown handshake message kind {kind}")
        k = Kind(kind)
        if reserved:
            raise HandshakeError(f"reserved byte must be 0, got {reserved} ({k.name})")
        if length > MAX_BODY:
            raise HandshakeError(f"{k.name} body of {length} bytes exceeds {MAX_BODY}")
        lo, hi = _BODY_RANGE[k]
        if not lo <= length <= hi:
            raise HandshakeError(f"{k.name} body must be {lo}..{hi} bytes, got {length}")
        end = HEADER_SIZE + length
        if n < end:
            return None
        body = bytes(buf[HEADER_SIZE:end])
        del buf[:end]
        return _decode_body(k, body)


def _decode_body(kind: Kind, body: bytes) -> Message:
    if kind is Kind.READY:
        return Ready()
    if kind is Kind.REJECT:
        try:
            return Reject(body.decode("utf-8"))
        except UnicodeDecodeError:
            raise HandshakeError("REJECT reason is not valid utf-8") from None
    qp_num, psn, gid, lid, mtu, credits, eager, max_msg, flags, plen = _PARAMS.unpack_from(body)
    rest = len(body) - _MIN_PARAMS
    if plen > rest:
        raise HandshakeError(
            f"{kind.name} provider name of {plen} bytes overruns the body ({rest} left)"
        )
    if plen < rest:
        raise HandshakeError(f"{kind.name} has {rest - plen} bytes of trailing garbage")
    try:
        provider = body[_MIN_PARAMS:].decode("ascii")
        hello = Hello(qp_num, psn, gid, lid, mtu, credits, eager, max_msg, provider, flags)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"bad {kind.name}: {exc}") from None
    return hello if kind is Kind.HELLO else Accept(hello)
