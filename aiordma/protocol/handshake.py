"""Out-of-band (TCP) connection-setup codec: versioned, length-checked, sans-IO.

The client's first bytes are the text line ``PREAMBLE`` (``b"AIORDMA/2\r\n\r\n"``), so
that a line-based server it reached by mistake (HTTP, Redis, ...) answers at once and
the client can name it; the listener's first bytes are a GREETING. After that every
message is a 12-byte header then a body, all integers in network byte order::

    magic b"AIOR" | version u16 | kind u8 | reserved u8 (0) | body length u32 | body

Kinds, in the order they travel::

    server -> client  GREETING  nonce 16s | flags u32 (FLAG_SECRET: the listener
                                requires the shared secret)
    client -> server  HELLO     the client's QP parameters, its nonce and MAC
    server -> client  ACCEPT    the server's parameters (same body), its MAC
                      | REJECT  code u8 | errno u16 | utf-8 reason (<= 256 bytes)
    client -> server  READY     empty: the client's QP is ready to receive

HELLO/ACCEPT body (``_PARAMS``, 94 bytes, then the provider name)::

    qp_num u32 | psn u32 | gid 16s | lid u16 | mtu u8 | recv_credits u16 | eager_size u32
    | max_message_size u64 | flags u32 | nonce 16s | mac 32s | provider length u8
    | provider (ascii)

``nonce`` and ``mac`` are what ``auth.py`` computes: random nonces from both sides, and
MACs that are all zeros unless the shared secret is in use. An ACCEPT decodes to
``Accept(params=Hello(...))``, a separate class so that ``isinstance(msg, Hello)`` (or
``case Hello()``) never matches a server's reply.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum

from aiordma.errors import HandshakeError

from .engine import MIN_SLOTS

__all__ = [
    "MAGIC",
    "VERSION",
    "PREAMBLE",
    "FLAG_SECRET",
    "NONCE_SIZE",
    "MAC_SIZE",
    "Greeting",
    "RejectCode",
    "encode_greeting",
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
VERSION = 2
PREAMBLE = b"AIORDMA/2\r\n\r\n"
FLAG_SECRET = 1  # GREETING: the listener requires the shared secret
NONCE_SIZE = 16
MAC_SIZE = 32
_ZERO_NONCE = bytes(NONCE_SIZE)
_ZERO_MAC = bytes(MAC_SIZE)
MAX_BODY = 1024
MAX_REASON = 256
MAX_PROVIDER = 16
PROVIDERS = frozenset({"soft", "verbs"})
MIN_EAGER = 64
MAX_EAGER = 16 << 20
MAX_MESSAGE = 1 << 40

_HEADER = struct.Struct("!4sHBBI")
_PARAMS = struct.Struct("!II16sHBHIQI16s32sB")
_GREETING = struct.Struct("!16sI")
_REJECT = struct.Struct("!BH")
HEADER_SIZE = _HEADER.size  # 12


class Kind(IntEnum):
    """The ``kind`` byte of a handshake message."""

    HELLO = 1
    ACCEPT = 2
    REJECT = 3
    READY = 4
    GREETING = 5


class RejectCode(IntEnum):
    """Why a listener refused a connection (REJECT's ``code``)."""

    REFUSED = 0  # anything else: bad parameters, provider mismatch, a failure
    AUTH = 1  # the shared-secret authentication failed
    LIMIT = 2  # out of a resource (``errno``: EMFILE, ENFILE, ENOMEM)
    BUSY = 3  # too many handshakes in progress


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
    nonce: bytes = _ZERO_NONCE
    mac: bytes = _ZERO_MAC

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
    """The server refused the connection; ``reason`` is for humans, ``code`` for code
    (``RejectCode``), ``errno`` the OS error of a ``LIMIT`` (else 0)."""

    reason: str
    code: int = RejectCode.REFUSED
    errno: int = 0


@dataclass(frozen=True)
class Greeting:
    """The listener's first message: its nonce and ``flags`` (``FLAG_SECRET``)."""

    nonce: bytes
    flags: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.nonce, bytes) or len(self.nonce) != NONCE_SIZE:
            raise ValueError(f"nonce must be {NONCE_SIZE} bytes")
        if not 0 <= self.flags <= 0xFFFFFFFF:
            raise ValueError(f"flags {self.flags} out of range")


@dataclass(frozen=True)
class Ready:
    """The client's QP is ready (RTR/RTS): the server may send."""


Message = Hello | Accept | Reject | Ready | Greeting


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
    if not isinstance(h.nonce, bytes) or len(h.nonce) != NONCE_SIZE:
        return f"nonce must be {NONCE_SIZE} bytes"
    if not isinstance(h.mac, bytes) or len(h.mac) != MAC_SIZE:
        return f"mac must be {MAC_SIZE} bytes"
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
    return _frame(kind, hello_body(h))


def hello_body(h: Hello) -> bytes:
    """The HELLO/ACCEPT body of ``h`` (what ``auth`` MACs, with a zero ``mac``)."""
    p = h.provider.encode("ascii")
    return _PARAMS.pack(
        h.qp_num, h.psn, h.gid, h.lid, h.mtu, h.recv_credits, h.eager_size,
        h.max_message_size, h.flags, h.nonce, h.mac, len(p),
    ) + p  # fmt: skip


def encode_accept(params: Hello) -> bytes:
    """Encode the server's parameters as an ACCEPT message."""
    return encode_hello(params, Kind.ACCEPT)


def encode_reject(reason: str, code: int = RejectCode.REFUSED, errno: int = 0) -> bytes:
    """Encode a REJECT; the utf-8 reason is cut to 256 bytes (at a character boundary)."""
    raw = reason.encode("utf-8")[:MAX_REASON].decode("utf-8", "ignore").encode("utf-8")
    return _frame(Kind.REJECT, _REJECT.pack(code, errno & 0xFFFF) + raw)


def encode_greeting(g: Greeting) -> bytes:
    """Encode the listener's GREETING."""
    return _frame(Kind.GREETING, _GREETING.pack(g.nonce, g.flags))


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
        return encode_reject(msg.reason, msg.code, msg.errno)
    if isinstance(msg, Ready):
        return encode_ready()
    if isinstance(msg, Greeting):
        return encode_greeting(msg)
    raise TypeError(f"not a handshake message: {msg!r}")


# -- decoding ------------------------------------------------------------------------------

_MIN_PARAMS = _PARAMS.size
_BODY_RANGE = {
    Kind.HELLO: (_MIN_PARAMS, _MIN_PARAMS + MAX_PROVIDER),
    Kind.ACCEPT: (_MIN_PARAMS, _MIN_PARAMS + MAX_PROVIDER),
    Kind.REJECT: (_REJECT.size, _REJECT.size + MAX_REASON),
    Kind.READY: (0, 0),
    Kind.GREETING: (_GREETING.size, _GREETING.size),
}


class HandshakeDecoder:
    """Incremental decoder: ``feed`` bytes as they arrive, get whole messages back.

    ``preamble=True`` (the listener's decoder) first expects the client's ``PREAMBLE``;
    anything else there is refused as soon as a byte differs (an older aiordma client,
    which sent a binary header at once, is told apart by its version). ``first_bytes``
    keeps the first bytes received (up to 64), to quote a stranger in an error.

    Any violation raises ``HandshakeError`` and poisons the decoder: every later ``feed``
    or ``eof`` raises the same error again. Header checks (magic, version, kind, reserved,
    body length) run as soon as the 12 header bytes are in, so an oversize body is refused
    before it is buffered; a wrong magic is refused as soon as its first byte differs.

    If ``feed`` decodes messages and then meets an error in the same data, it returns
    those messages and raises the error on the next ``feed``/``eof`` (``error`` shows it at
    once). So the messages obtained and the error raised do not depend on how the input
    was split.
    """

    __slots__ = ("_buf", "_error", "_preamble", "first_bytes")

    def __init__(self, *, preamble: bool = False) -> None:
        self._buf = bytearray()
        self._error: str | None = None
        self._preamble = preamble
        self.first_bytes = b""

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
        if len(self.first_bytes) < 64:
            self.first_bytes += bytes(data[: 64 - len(self.first_bytes)])
        self._buf += data
        out: list[Message] = []
        try:
            if self._preamble and not self._take_preamble():
                return out
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
            n = len(self._buf)
            need = 0 if self._preamble else self._need()
            if self._preamble:
                self._error = (f"truncated preamble: connection closed after {n} of "
                               f"{len(PREAMBLE)} bytes")
            elif need:
                self._error = (f"truncated handshake message: connection closed after {n} "
                               f"of {need} bytes")
            else:
                self._error = (f"truncated handshake header: connection closed after {n} "
                               f"of {HEADER_SIZE} bytes")
            self._buf.clear()
            raise HandshakeError(self._error)

    def _take_preamble(self) -> bool:
        """Consume the PREAMBLE once it is all in (True); raise at the first wrong byte."""
        buf = self._buf
        n = min(len(buf), len(PREAMBLE))
        if buf[:n] != PREAMBLE[:n]:
            if buf[:4] == MAGIC and len(buf) >= 6 and buf[4] == 0:  # a binary header
                version = int.from_bytes(buf[4:6], "big")
                raise HandshakeError(f"version mismatch: peer speaks {version}, we speak "
                                     f"{VERSION}")
            raise HandshakeError(f"not an aiordma client: it sent {bytes(buf[:40])!r}")
        if n < len(PREAMBLE):
            return False
        del buf[: len(PREAMBLE)]
        self._preamble = False
        return True

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
    if kind is Kind.GREETING:
        nonce, flags = _GREETING.unpack(body)
        return Greeting(nonce, flags)
    if kind is Kind.REJECT:
        code, err = _REJECT.unpack_from(body)
        try:
            reason = body[_REJECT.size:].decode("utf-8")
        except UnicodeDecodeError:
            raise HandshakeError("REJECT reason is not valid utf-8") from None
        return Reject(reason, code, err)
    (qp_num, psn, gid, lid, mtu, credits, eager, max_msg, flags, nonce, mac,
     plen) = _PARAMS.unpack_from(body)
    rest = len(body) - _MIN_PARAMS
    if plen > rest:
        raise HandshakeError(
            f"{kind.name} provider name of {plen} bytes overruns the body ({rest} left)"
        )
    if plen < rest:
        raise HandshakeError(f"{kind.name} has {rest - plen} bytes of trailing garbage")
    try:
        provider = body[_MIN_PARAMS:].decode("ascii")
        hello = Hello(qp_num, psn, gid, lid, mtu, credits, eager, max_msg, provider, flags,
                      nonce, mac)
    except (UnicodeDecodeError, ValueError) as exc:
        raise HandshakeError(f"bad {kind.name}: {exc}") from None
    return hello if kind is Kind.HELLO else Accept(hello)
