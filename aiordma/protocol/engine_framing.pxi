# The frame header of every SEND between two endpoints (included by engine.pyx).
#
# Every two-sided message starts with an 8-byte little-endian header, ``HEADER``::
#
#     type u8 | flags u8 | credits u16 | aux u32
#
# ``credits`` is piggy-backed flow control: the number of receive buffers the sender of
# this frame re-posted since it last said so (see engine_credits.pxi). Per type:
#
# ==========  =====================================  ==========================================
# type        aux                                    rest of the frame
# ==========  =====================================  ==========================================
# DATA        payload length                         the payload (``byte_len == 8 + aux``)
# RNDV        msg_id                                 ``RNDV_BODY``: total length u64, addr u64,
#                                                    rkey u32 (frame is exactly 28 bytes); the
#                                                    receiver RDMA-READs the advertised buffer
# RNDV_DONE   msg_id the receiver has read           nothing; flags 0 = ok, 1 = failed
# CREDIT      0                                      nothing; credits > 0
# CLOSE       0                                      nothing (graceful EOF, after all data)
# BATCH       number of messages (>= 1)              that many records ``len u32 | payload``,
#                                                    filling the frame exactly; each record is
#                                                    one whole DATA message, in order
# ==========  =====================================  ==========================================
#
# BATCH aggregates small messages that were sent in the same loop iteration into one
# SEND (one receive buffer, one credit, one completion); the receiver hands them to the
# application one by one, as if each had come in its own DATA frame. A sender uses it
# only towards a peer that announced ``HANDSHAKE_FLAG_BATCH`` in its handshake.
#
# Flags are 0 except on RNDV_DONE. An empty DATA frame (aux 0) is a valid empty message.
# Writers raise ``LocalProtocolError`` for out-of-range arguments or a buffer too short for
# the header, ``TypeError`` for an argument of the wrong type (a non-int, a read-only
# buffer); ``parse_frame`` raises ``RemoteProtocolError`` for anything malformed.
#
# The data path writes and parses headers in C (``frame_write``, ``parse_c``); the Python
# functions below are the same rules for Python callers (and the tests).

HEADER = struct.Struct("<BBHI")
RNDV_BODY = struct.Struct("<QQI")
HEADER_SIZE = 8
RNDV_SIZE = 28
MAX_CREDITS = 0xFFFF
"""Largest credit count one frame can carry."""
RNDV_OK = 0
RNDV_FAILED = 1
BATCH_RECORD = 4
"""Bytes a BATCH frame spends per message besides its payload (the length field)."""
HANDSHAKE_FLAG_BATCH = 1
"""Handshake ``flags`` bit: this endpoint understands BATCH frames."""

cdef enum:
    C_HEADER_SIZE = 8
    C_RNDV_SIZE = 28
    C_MAX_CREDITS = 0xFFFF
    C_BATCH_RECORD = 4
    T_DATA = 1
    T_RNDV = 2
    T_RNDV_DONE = 3
    T_CREDIT = 4
    T_CLOSE = 5
    T_BATCH = 6

ctypedef struct frame_t:
    int type
    int flags
    int credits
    uint32_t aux
    Py_ssize_t payload_offset
    Py_ssize_t payload_len
    uint64_t rndv_length
    uint64_t rndv_addr
    uint32_t rndv_rkey


class FrameType(IntEnum):
    """The ``type`` byte of the header."""

    DATA = 1
    RNDV = 2
    RNDV_DONE = 3
    CREDIT = 4
    CLOSE = 5
    BATCH = 6


_TYPES = {int(t): t for t in FrameType}
_FT_BY_VALUE = (None,) + tuple(FrameType(i) for i in range(1, 7))


cdef inline void _le16(unsigned char *p, uint16_t v) noexcept:
    p[0] = v & 0xFF
    p[1] = v >> 8


cdef inline void _le32(unsigned char *p, uint32_t v) noexcept:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = v >> 24


cdef inline void _le64(unsigned char *p, uint64_t v) noexcept:
    _le32(p, <uint32_t>(v & 0xFFFFFFFFu))
    _le32(p + 4, <uint32_t>(v >> 32))


cdef inline uint32_t _get32(const unsigned char *p) noexcept:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
            | (<uint32_t>p[3] << 24))


cdef inline uint64_t _get64(const unsigned char *p) noexcept:
    return <uint64_t>_get32(p) | (<uint64_t>_get32(p + 4) << 32)


cdef inline Py_ssize_t payload_len(object payload) except -1:
    """The size in bytes of a queued DATA payload: bytes, or a flat view of unsigned
    bytes (its length is its size); raises ValueError for a released view."""
    if type(payload) is bytes:
        return PyBytes_GET_SIZE(payload)
    return len(payload)


cdef inline Py_ssize_t payload_copy(object payload, unsigned char *dst,
                                    Py_ssize_t room) except -2:
    """Copy a queued DATA payload (as ``payload_len``) to ``dst``; returns its size,
    or -1 (nothing copied) when it is over ``room`` bytes."""
    cdef Py_buffer src
    cdef Py_ssize_t n
    if type(payload) is bytes:
        n = PyBytes_GET_SIZE(payload)
        if n > room:
            return -1
        memcpy(dst, PyBytes_AS_STRING(payload), n)
        return n
    PyObject_GetBuffer(payload, &src, PyBUF_SIMPLE)
    n = src.len
    if n <= room:
        memcpy(dst, src.buf, n)
    PyBuffer_Release(&src)
    return n if n <= room else -1


cdef inline void frame_write(unsigned char *p, int t, int flags, int credits,
                             uint32_t aux) noexcept:
    """The 8-byte header at ``p`` (the caller checked the ranges)."""
    p[0] = <unsigned char>t
    p[1] = <unsigned char>flags
    _le16(p + 2, <uint16_t>credits)
    _le32(p + 4, aux)


cdef int parse_c(const unsigned char *p, Py_ssize_t size, Py_ssize_t byte_len,
                 int64_t max_message_size, frame_t *f) except -1:
    """Parse the frame in ``p[:byte_len]`` (``size``: the buffer's length) into ``f``;
    raises ``RemoteProtocolError`` naming the violated rule (``parse_frame``)."""
    cdef int t, flags
    cdef uint32_t aux
    if byte_len < C_HEADER_SIZE:
        raise RemoteProtocolError(f"frame too short: {byte_len} bytes, the header is {HEADER_SIZE}")
    if byte_len > size:
        raise RemoteProtocolError(
            f"frame length {byte_len} exceeds the receive buffer ({size} bytes)"
        )
    t = p[0]
    flags = p[1]
    f.type = t
    f.flags = flags
    f.credits = p[2] | (p[3] << 8)
    aux = _get32(p + 4)
    f.aux = aux
    f.payload_offset = C_HEADER_SIZE
    f.payload_len = 0
    f.rndv_length = 0
    f.rndv_addr = 0
    f.rndv_rkey = 0
    if t == T_DATA:
        if aux != byte_len - C_HEADER_SIZE:
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
        f.payload_len = aux
        return 0
    if t == T_RNDV:
        if byte_len != C_RNDV_SIZE:
            raise RemoteProtocolError(f"RNDV frame must be {RNDV_SIZE} bytes, got {byte_len}")
        if flags:
            raise _bad_flags(t, flags)
        f.rndv_length = _get64(p + 8)
        f.rndv_addr = _get64(p + 16)
        f.rndv_rkey = _get32(p + 24)
        if f.rndv_length == 0 or f.rndv_length > <uint64_t>max_message_size:
            raise RemoteProtocolError(
                f"RNDV length {f.rndv_length} out of range (1..max_message_size "
                f"{max_message_size})"
            )
        return 0
    if t == T_BATCH:
        if flags:
            raise _bad_flags(t, flags)
        if aux == 0 or <int64_t>aux * C_BATCH_RECORD > byte_len - C_HEADER_SIZE:
            raise RemoteProtocolError(
                f"BATCH of {aux} messages cannot fit {byte_len - HEADER_SIZE} bytes"
            )
        f.payload_len = byte_len - C_HEADER_SIZE
        return 0
    if t < T_DATA or t > T_BATCH:
        raise RemoteProtocolError(f"unknown frame type {t}")
    ftype = _TYPES[t]
    if byte_len != C_HEADER_SIZE:
        raise RemoteProtocolError(
            f"{ftype.name} frame has {byte_len - HEADER_SIZE} trailing bytes after the header"
        )
    if t == T_RNDV_DONE:
        if flags > RNDV_FAILED:
            raise RemoteProtocolError(f"RNDV_DONE flags must be 0 (ok) or 1 (failed), got {flags}")
    else:
        if flags:
            raise _bad_flags(t, flags)
        if aux:
            raise RemoteProtocolError(f"{ftype.name} frame must have aux 0, got {aux}")
        if t == T_CREDIT and f.credits == 0:
            raise RemoteProtocolError("CREDIT frame returns no credits")
    return 0


class Frame:
    """A parsed frame header (the payload stays in the receive buffer).

    ``payload_offset``/``payload_len`` locate a DATA payload (for BATCH: the records,
    see ``batch_records``) inside the buffer that was parsed (offset 8; length 0 for
    every other type). The ``rndv_*`` fields are set for RNDV only. For RNDV and
    RNDV_DONE, ``aux`` is the msg_id. Frames compare by value; the parser builds a new
    one per frame and nothing changes it afterwards."""

    __slots__ = ("type", "credits", "aux", "flags", "payload_offset", "payload_len",
                 "rndv_length", "rndv_addr", "rndv_rkey")

    def __init__(self, type, credits, aux, flags, payload_offset, payload_len,
                 rndv_length=0, rndv_addr=0, rndv_rkey=0):
        self.type = type
        self.credits = credits
        self.aux = aux
        self.flags = flags
        self.payload_offset = payload_offset
        self.payload_len = payload_len
        self.rndv_length = rndv_length
        self.rndv_addr = rndv_addr
        self.rndv_rkey = rndv_rkey

    def _fields(self):
        return (self.type, self.credits, self.aux, self.flags, self.payload_offset,
                self.payload_len, self.rndv_length, self.rndv_addr, self.rndv_rkey)

    def __eq__(self, other):
        if not isinstance(other, Frame):
            return NotImplemented
        return self._fields() == other._fields()

    __hash__ = None

    def __repr__(self):
        return ("Frame(type={!r}, credits={}, aux={}, flags={}, payload_offset={}, "
                "payload_len={}, rndv_length={}, rndv_addr={}, rndv_rkey={})".format(
                    self.type, *self._fields()[1:]))

    @property
    def msg_id(self):
        """The rendezvous message id (RNDV, RNDV_DONE); same as ``aux``."""
        return self.aux

    @property
    def ok(self):
        """For RNDV_DONE: True if the receiver read the message successfully."""
        return self.flags == RNDV_OK


def parse_frame(buf, Py_ssize_t byte_len, int64_t max_message_size):
    """Parse the frame in ``buf[:byte_len]`` (``byte_len`` from the receive completion).

    Returns a ``Frame``; raises ``RemoteProtocolError`` naming the violated rule: frame
    shorter than the header, longer than the buffer, unknown type, nonzero flags (except
    RNDV_DONE's 0/1), DATA length mismatch, RNDV not exactly 28 bytes or advertising
    length 0 or more than ``max_message_size``, control frames with trailing bytes or a
    nonzero aux, CREDIT carrying no credits, BATCH with nonzero flags or a count of
    0 or more records than its bytes can hold (``batch_records`` checks the records).
    """
    cdef frame_t f
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        parse_c(<const unsigned char *>view.buf, view.len, byte_len, max_message_size, &f)
    finally:
        PyBuffer_Release(&view)
    return Frame(_FT_BY_VALUE[f.type], f.credits, f.aux, f.flags, f.payload_offset,
                 f.payload_len, f.rndv_length, f.rndv_addr, f.rndv_rkey)


cdef int batch_check_c(const unsigned char *p, Py_ssize_t byte_len, uint32_t count,
                       int64_t max_message_size) except -1:
    """Check the ``count`` records of the BATCH frame at ``p`` (``byte_len`` bytes, its
    header checked by ``parse_c``): each record header inside the frame, no message
    over ``max_message_size``, the records filling the frame exactly. Returns 0; raises
    ``RemoteProtocolError``. Allocates nothing: the receiver then walks the records
    with ``batch_next_c``."""
    cdef Py_ssize_t off = C_HEADER_SIZE
    cdef uint32_t i, n
    for i in range(count):
        if off + C_BATCH_RECORD > byte_len:
            raise RemoteProtocolError(f"BATCH record header at {off} beyond the frame ({byte_len})")
        n = _get32(p + off)
        off += C_BATCH_RECORD
        if n > max_message_size:
            raise RemoteProtocolError(
                f"BATCH message of {n} bytes exceeds max_message_size {max_message_size}"
            )
        off += n
    if off != byte_len:
        raise RemoteProtocolError(
            f"BATCH records span {off} bytes, the frame carries {byte_len}"
        )
    return 0


cdef inline Py_ssize_t batch_next_c(const unsigned char *p, Py_ssize_t *off) noexcept:
    """The next record of a BATCH frame checked by ``batch_check_c``: ``off`` at its
    record header (``C_HEADER_SIZE`` for the first) moves to its payload; returns the
    payload's length (the caller adds it to ``off`` for the next record)."""
    cdef Py_ssize_t n = _get32(p + off[0])
    off[0] += C_BATCH_RECORD
    return n


cdef list batch_records_c(const unsigned char *p, Py_ssize_t byte_len, uint32_t count,
                          int64_t max_message_size):
    cdef Py_ssize_t off = C_HEADER_SIZE
    cdef Py_ssize_t n
    cdef uint32_t i
    batch_check_c(p, byte_len, count, max_message_size)
    out = []
    for i in range(count):
        n = batch_next_c(p, &off)
        out.append((off, n))
        off += n
    return out


def batch_records(buf, Py_ssize_t byte_len, uint32_t count, int64_t max_message_size):
    """The ``count`` records of the BATCH frame in ``buf[:byte_len]`` (as checked by
    ``parse_frame``): a list of (payload offset in ``buf``, payload length), in order.

    Raises ``RemoteProtocolError`` when the records do not fill the frame exactly or one
    exceeds ``max_message_size``.
    """
    cdef Py_buffer view
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if byte_len > view.len:
            raise RemoteProtocolError(f"BATCH of {byte_len} bytes exceeds its buffer")
        return batch_records_c(<const unsigned char *>view.buf, byte_len, count,
                               max_message_size)
    finally:
        PyBuffer_Release(&view)


def _bad_flags(t, flags):
    return RemoteProtocolError(f"{_TYPES[t].name} frame must have flags 0, got {flags:#x}")


# -- writers -------------------------------------------------------------------------------

_pack_header = HEADER.pack_into
_pack_rndv = RNDV_BODY.pack_into
_REC = struct.Struct("<I")
_DATA, _RNDV, _RNDV_DONE, _CREDIT, _CLOSE, _BATCH = 1, 2, 3, 4, 5, 6
_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


def write_data_header(buf, credits, payload_len):
    """Write a DATA header at ``buf[0:8]``; the caller places the payload at ``buf[8:]``
    (or in a second SGE). Returns 8."""
    try:
        _pack_header(buf, 0, _DATA, 0, credits, payload_len)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, payload_len=(payload_len, _U32)) from None
    return HEADER_SIZE


def write_batch_header(buf, credits, count):
    """Write a BATCH header for ``count`` (>= 1) records at ``buf[0:8]``; the caller
    appends the records with ``write_batch_record``. Returns 8."""
    if count <= 0:
        raise LocalProtocolError(f"a BATCH carries at least one message, got {count}")
    try:
        _pack_header(buf, 0, _BATCH, 0, credits, count)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, count=(count, _U32)) from None
    return HEADER_SIZE


def write_batch(buf, credits, payloads):
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


def write_batch_record(buf, offset, payload):
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


def write_rndv(buf, credits, msg_id, length, addr, rkey):
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


def write_rndv_done(buf, credits, msg_id, ok):
    """Write an RNDV_DONE frame (flags 0 if ``ok`` else 1). Returns 8."""
    try:
        _pack_header(buf, 0, _RNDV_DONE, RNDV_OK if ok else RNDV_FAILED, credits, msg_id)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits, msg_id=(msg_id, _U32)) from None
    return HEADER_SIZE


def write_credit(buf, credits):
    """Write an explicit CREDIT frame; ``credits`` must be 1..65535. Returns 8."""
    if credits == 0:
        raise LocalProtocolError("a CREDIT frame must return at least one credit")
    return _write_empty(buf, _CREDIT, credits)


def write_close(buf, credits):
    """Write a CLOSE frame (graceful EOF). Returns 8."""
    return _write_empty(buf, _CLOSE, credits)


def _write_empty(buf, t, credits):
    try:
        _pack_header(buf, 0, t, 0, credits, 0)
    except (struct.error, ValueError, TypeError):
        raise _bad_args(buf, HEADER_SIZE, credits) from None
    return HEADER_SIZE


def _bad_args(buf, need, credits, **fields):
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
