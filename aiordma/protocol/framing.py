"""The frame header of every SEND between two endpoints (sans-IO, hot path).

Every two-sided message starts with an 8-byte little-endian header, ``HEADER``::

    type u8 | flags u8 | credits u16 | aux u32

``credits`` is piggy-backed flow control: the number of receive buffers the sender of
this frame re-posted since it last said so (see ``credits.py``). Per type:

==========  =====================================  ==========================================
type        aux                                    rest of the frame
==========  =====================================  ==========================================
DATA        payload length                         the payload (``byte_len == 8 + aux``)
RNDV        msg_id                                 ``RNDV_BODY``: total length u64, addr u64,
                                                   rkey u32 (frame is exactly 28 bytes); the
                                                   receiver RDMA-READs the advertised buffer
RNDV_DONE   msg_id the receiver has read           nothing; flags 0 = ok, 1 = failed
CREDIT      0                                      nothing; credits > 0
CLOSE       0                                      nothing (graceful EOF, after all data)
BATCH       number of messages (>= 1)              that many records ``len u32 | payload``,
                                                   filling the frame exactly; each record is
                                                   one whole DATA message, in order
==========  =====================================  ==========================================

BATCH aggregates small messages that were sent in the same loop iteration into one
SEND (one receive buffer, one credit, one completion); the receiver hands them to the
application one by one, as if each had come in its own DATA frame. A sender uses it
only towards a peer that announced ``HANDSHAKE_FLAG_BATCH`` in its handshake.

Flags are 0 except on RNDV_DONE. An empty DATA frame (aux 0) is a valid empty message.
Writers raise ``LocalProtocolError`` for out-of-range arguments or a buffer too short for
the header, ``TypeError`` for an argument of the wrong type (a non-int, a read-only
buffer); ``parse_frame`` raises ``RemoteProtocolError`` for anything malformed.
"""

from __future__ import annotations

import struct
from enum import IntEnum
from typing import Final

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = [
    "HEADER",
    "HEADER_SIZE",
    "RNDV_BODY",
    "RNDV_SIZE",
    "MAX_CREDITS",
    "RNDV_OK",
    "RNDV_FAILED",
    "FrameType",
    "Frame",
    "parse_frame",
    "write_data_header",
    "write_rndv",
    "write_rndv_done",
    "write_credit",
    "write_close",
    "BATCH_RECORD",
    "HANDSHAKE_FLAG_BATCH",
    "batch_records",
    "write_batch",
    "write_batch_header",
    "write_batch_record",
]

HEADER = struct.Struct("<BBHI")
RNDV_BODY = struct.Struct("<QQI")
HEADER_SIZE = 8
RNDV_SIZE = 28
assert HEADER.size == HEADER_SIZE and HEADER_SIZE + RNDV_BODY.size == RNDV_SIZE

MAX_CREDITS = 0xFFFF
"""Largest credit count one frame can carry."""
RNDV_OK = 0
RNDV_FAILED = 1
BATCH_RECORD = 4
"""Bytes a BATCH frame spends per message besides its payload (the length field)."""
HANDSHAKE_FLAG_BATCH = 1
"""Handshake ``flags`` bit: this endpoint understands BATCH frames."""
_REC = struct.Struct("<I")
_unpack_header: Final = HEADER.unpack_from  # (bound once: a call, not a method lookup, per frame)

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF

WritableBuffer = bytearray | memoryview
ReadableBuffer = bytes | bytearray | memoryview


class FrameType(IntEnum):
    """The ``type`` byte of the header."""

    DATA = 1
    RNDV = 2
    RNDV_DONE = 3
    CREDIT = 4
    CLOSE = 5
    BATCH = 6


# Plain ints for the hot path (IntEnum attribute access is slower).
_DATA, _RNDV, _RNDV_DONE, _CREDIT, _CLOSE, _BATCH = 1, 2, 3, 4, 5, 6
_TYPES: dict[int, FrameType] = {int(t): t for t in FrameType}
_FT_DATA, _FT_RNDV, _FT_BATCH = FrameType.DATA, FrameType.RNDV, FrameType.BATCH


class Frame:
    """A parsed frame header (the payload stays in the receive buffer).

    ``payload_offset``/``payload_len`` locate a DATA payload (for BATCH: the records,
    see ``batch_records``) inside the buffer that was parsed (offset 8; length 0 for
    every other type). The ``rndv_*`` fields are set for RNDV
    only. For RNDV and RNDV_DONE, ``aux`` is the msg_id. Frames compare by value; the
    parser builds a new one per frame and nothing changes it afterwards. (A plain class,
    not a dataclass: compiled, its constructor is a C function, where a dataclass keeps
    its generated ``__init__`` interpreted.)
    """

    __slots__ = ("type", "credits", "aux", "flags", "payload_offset", "payload_len",
                 "rndv_length", "rndv_addr", "rndv_rkey")

    def __init__(self, type: FrameType, credits: int, aux: int, flags: int,
                 payload_offset: int, payload_len: int, rndv_length: int = 0,
                 rndv_addr: int = 0, rndv_rkey: int = 0) -> None:
        self.type = type
        self.credits = credits
        self.aux = aux
        self.flags = flags
        self.payload_offset = payload_offset
        self.payload_len = payload_len
        self.rndv_length = rndv_length
        self.rndv_addr = rndv_addr
        self.rndv_rkey = rndv_rkey

    def _fields(self) -> tuple[int, ...]:
        return (self.type, self.credits, self.aux, self.flags, self.payload_offset,
                self.payload_len, self.rndv_length, self.rndv_addr, self.rndv_rkey)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Frame):
            return NotImplemented
        return self._fields() == other._fields()

    def __repr__(self) -> str:
        return ("Frame(type={!r}, credits={}, aux={}, flags={}, payload_offset={}, "
                "payload_len={}, rndv_length={}, rndv_addr={}, rndv_rkey={})".format(
                    self.type, *self._fields()[1:]))

    @property
    def msg_id(self) -> int:
        """The rendezvous message id (RNDV, RNDV_DONE); same as ``aux``."""
        return self.aux

    @property
    def ok(self) -> bool:
        """For RNDV_DONE: True if the receiver read the message successfully."""
        return self.flags == RNDV_OK


def parse_frame(buf: ReadableBuffer, byte_len: int, max_message_size: int) -> Frame:
    """Parse the frame in ``buf[:byte_len]`` (``byte_len`` from the receive completion).

    Returns a ``Frame``; raises ``RemoteProtocolError`` naming the violated rule: frame
    shorter than the header, longer than the buffer, unknown type, nonzero flags (except
    RNDV_DONE's 0/1), DATA length mismatch, RNDV not exactly 28 bytes or advertising
    length 0 or more than ``max_message_size``, control frames with trailing bytes or a
    nonzero aux, CREDIT carrying no credits, BATCH with nonzero flags or a count of
    0 or more records than its bytes can hold (``batch_records`` checks the records).
    """
    if byte_len < HEADER_SIZE:
        raise RemoteProtocolError(f"frame too short: {byte_len} bytes, the header is {HEADER_SIZE}")
    if byte_len > len(buf):
        raise RemoteProtocolError(
            f"frame length {byte_len} exceeds the receive buffer ({len(buf)} bytes)"
        )
    t, flags, credits, aux = _unpack_header(buf)
    if t == _DATA:
        if aux != byte_len - HEADER_SIZE:
            raise RemoteProtocolError(
                f"DATA length mismatch: header says {aux} payload bytes, "
                f"frame carries {byte_len - HEADER_SIZE}"
            )
        if aux > max_message_size:
            raise RemoteProtocolError(
                f"DATA payload of {aux} bytes exceeds max_message_size {max_message_size}"
            )
        if flags:
            raise _bad_flags(t, flags)
        return Frame(_FT_DATA, credits, aux, 0, HEADER_SIZE, aux, 0, 0, 0)
    if t == _RNDV:
        if byte_len != RNDV_SIZE:
            raise RemoteProtocolError(f"RNDV frame must be {RNDV_SIZE} bytes, got {byte_len}")
        if flags:
            raise _bad_flags(t, flags)
        length, addr, rkey = RNDV_BODY.unpack_from(buf, HEADER_SIZE)
        if length == 0 or length > max_message_size:
            raise RemoteProtocolError(
                f"RNDV length {length} out of range (1..max_message_size {max_message_size})"
            )
        return Frame(_FT_RNDV, credits, aux, 0, HEADER_SIZE, 0, length, addr, rkey)
    if t == _BATCH:
        if flags:
            raise _bad_flags(t, flags)
        if aux == 0 or aux * BATCH_RECORD > byte_len - HEADER_SIZE:
            raise RemoteProtocolError(
                f"BATCH of {aux} messages cannot fit {byte_len - HEADER_SIZE} bytes"
            )
        return Frame(_FT_BATCH, credits, aux, 0, HEADER_SIZE, byte_len - HEADER_SIZE, 0, 0, 0)
    ftype = _TYPES.get(t)
    if ftype is None:
        raise RemoteProtocolError(f"unknown frame type {t}")
    if byte_len != HEADER_SIZE:
        raise RemoteProtocolError(
            f"{ftype.name} frame has {byte_len - HEADER_SIZE} trailing bytes after the header"
        )
    if t == _RNDV_DONE:
        if flags > RNDV_FAILED:
            raise RemoteProtocolError(f"RNDV_DONE flags must be 0 (ok) or 1 (failed), got {flags}")
    else:
        if flags:
            raise _bad_flags(t, flags)
        if aux:
            raise RemoteProtocolError(f"{ftype.name} frame must have aux 0, got {aux}")
        if t == _CREDIT and credits == 0:
            raise RemoteProtocolError("CREDIT frame returns no credits")
    return Frame(ftype, credits, aux, flags, HEADER_SIZE, 0, 0, 0, 0)


def batch_records(
    buf: ReadableBuffer, byte_len: int, count: int, max_message_size: int
) -> list[tuple[int, int]]:
    """The ``count`` records of the BATCH frame in ``buf[:byte_len]`` (as checked by
    ``parse_frame``): a list of (payload offset in ``buf``, payload length), in order.

    Raises ``RemoteProtocolError`` when the records do not fill the frame exactly or one
    exceeds ``max_message_size``.
    """
    out = []
    off = HEADER_SIZE
    unpack = _REC.unpack_from
    for _ in range(count):
        if off + BATCH_RECORD > byte_len:
            raise RemoteProtocolError(f"BATCH record header at {off} beyond the frame ({byte_len})")
        (n,) = unpack(buf, off)
        off += BATCH_RECORD
        if n > max_message_size:
            raise RemoteProtocolError(
                f"BATCH message of {n} bytes exceeds max_message_size {max_message_size}"
            )
        out.append((off, n))
        off += n
    if off != byte_len:
        raise RemoteProtocolError(
            f"BATCH records span {off} bytes, the frame carries {byte_len}"
        )
    return out


def _bad_flags(t: int, flags: int) -> RemoteProtocolError:
    return RemoteProtocolError(f"{_TYPES[t].name} frame must have flags 0, got {flags:#x}")


# -- writers -------------------------------------------------------------------------------

_pack_header: Final = HEADER.pack_into
_pack_rndv: Final = RNDV_BODY.pack_into


def write_data_header(buf: WritableBuffer, credits: int, payload_len: int) -> int:
    """Write a DATA header at ``buf[0:8]``; the caller places the payload at ``buf[8:]``
    (or in a second SGE). Returns 8."""
    try:
        _pack_header(buf, 0, _DATA, 0, credits, payload_len)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, payload_len=(payload_len, _U32)) from None
    return HEADER_SIZE


def write_batch_header(buf: WritableBuffer, credits: int, count: int) -> int:
    """Write a BATCH header for ``count`` (>= 1) records at ``buf[0:8]``; the caller
    appends the records with ``write_batch_record``. Returns 8."""
    if count <= 0:
        raise LocalProtocolError(f"a BATCH carries at least one message, got {count}")
    try:
        _pack_header(buf, 0, _BATCH, 0, credits, count)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, count=(count, _U32)) from None
    return HEADER_SIZE


def write_batch(buf: WritableBuffer, credits: int, payloads: list[ReadableBuffer]) -> int:
    """Write a whole BATCH frame of ``payloads`` (at least one; byte-format buffers) at
    ``buf[0:]``; returns its length. Raises ``LocalProtocolError`` when it does not fit
    (nothing useful is left in ``buf`` then)."""
    off = write_batch_header(buf, credits, len(payloads))
    size = len(buf)
    pack = _REC.pack_into
    for p in payloads:
        n = len(p)
        start = off + BATCH_RECORD
        end = start + n
        if end > size:
            raise LocalProtocolError(
                f"a {n}-byte BATCH record at {off} does not fit a {size}-byte buffer"
            )
        pack(buf, off, n)
        buf[start:end] = p
        off = end
    return off


def write_batch_record(buf: WritableBuffer, offset: int, payload: ReadableBuffer) -> int:
    """Write one record (length, then ``payload``) at ``buf[offset:]``; returns the
    offset after it. Raises ``LocalProtocolError`` when it does not fit."""
    n = len(payload)
    end = offset + BATCH_RECORD + n
    if offset < HEADER_SIZE or end > len(buf):
        raise LocalProtocolError(
            f"a {n}-byte BATCH record at {offset} does not fit a {len(buf)}-byte buffer"
        )
    _REC.pack_into(buf, offset, n)
    buf[offset + BATCH_RECORD:end] = payload
    return end


def write_rndv(
    buf: WritableBuffer, credits: int, msg_id: int, length: int, addr: int, rkey: int
) -> int:
    """Write an RNDV frame advertising ``length`` bytes at ``addr``/``rkey``. Returns 28.

    ``length`` must be 1..2**64-1 (the receiver also enforces its max_message_size).
    """
    if length <= 0:
        raise LocalProtocolError(f"RNDV length must be positive, got {length}")
    try:
        _pack_header(buf, 0, _RNDV, 0, credits, msg_id)
        _pack_rndv(buf, HEADER_SIZE, length, addr, rkey)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(
            buf,
            RNDV_SIZE,
            credits,
            msg_id=(msg_id, _U32),
            length=(length, _U64),
            addr=(addr, _U64),
            rkey=(rkey, _U32),
        ) from None
    return RNDV_SIZE


def write_rndv_done(buf: WritableBuffer, credits: int, msg_id: int, ok: bool) -> int:
    """Write an RNDV_DONE frame (flags 0 if ``ok`` else 1). Returns 8."""
    try:
        _pack_header(buf, 0, _RNDV_DONE, RNDV_OK if ok else RNDV_FAILED, credits, msg_id)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, msg_id=(msg_id, _U32)) from None
    return HEADER_SIZE


def write_credit(buf: WritableBuffer, credits: int) -> int:
    """Write an explicit CREDIT frame; ``credits`` must be 1..65535. Returns 8."""
    if credits == 0:
        raise LocalProtocolError("a CREDIT frame must return at least one credit")
    return _write_empty(buf, _CREDIT, credits)


def write_close(buf: WritableBuffer, credits: int) -> int:
    """Write a CLOSE frame (graceful EOF). Returns 8."""
    return _write_empty(buf, _CLOSE, credits)


def _write_empty(buf: WritableBuffer, t: int, credits: int) -> int:
    try:
        _pack_header(buf, 0, t, 0, credits, 0)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits) from None
    return HEADER_SIZE


def _bad_args(
    buf: WritableBuffer, need: int, credits: int, **fields: tuple[int, int]
) -> Exception:
    """Build the precise error for a failed pack (only on the error path): TypeError for
    an argument of the wrong type (the compiled build raises it on entry already),
    LocalProtocolError for a value out of range or a buffer too short."""
    for name, (value, limit) in {"credits": (credits, MAX_CREDITS), **fields}.items():
        if not isinstance(value, int):
            return TypeError(f"{name} must be an int, got {type(value).__name__}")
        if not 0 <= value <= limit:
            return LocalProtocolError(f"{name} {value} out of range (0..{limit})")
    try:
        size = len(buf)
    except TypeError:
        return TypeError(f"not a writable buffer: {type(buf).__name__}")
    if size < need:
        return LocalProtocolError(f"buffer of {size} bytes too small for a {need}-byte frame")
    return TypeError(f"not a writable buffer: {type(buf).__name__}")
