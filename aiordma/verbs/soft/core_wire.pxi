# The message header as a C struct (included by _core.pyx). wire.py documents the
# format: 48 bytes, every field little-endian,
#     u8 op | u8 flags | u16 aux | u32 psn | u32 length | u32 imm | u32 rkey | u32 pad
#     | u64 remote_addr | u64 compare_add | u64 swap
# and keeps the opcode and flag values; tests/test_soft_wire.py checks that this codec
# and wire.HDR agree.

cdef enum:
    HDR_SIZE = 48

# wire.py's values, as C constants
cdef enum:
    OP_SEND = 1
    OP_SEND_IMM = 2
    OP_WRITE = 3
    OP_WRITE_IMM = 4
    OP_READ = 5
    OP_CMP_SWP = 6
    OP_FETCH_ADD = 7
    OP_ACK = 16
    OP_NAK = 17
    OP_READ_RESP = 18
    OP_ATOMIC_RESP = 19
    OP_CMA_PROBE = 32
    OP_CMA_ACK = 33
    FLAG_SOLICITED = 1
    FLAG_CMA = 2
    FLAG_SHM = 4
    NAK_RNR = 1
    NAK_INV_REQ = 2
    NAK_REM_ACCESS = 3
    NAK_REM_OP = 4
    IOV_SIZE = 16
    PSN_MASK = 0xFFFFFF

# the largest message (wire.py's MAX_MSG, taken once: not a module lookup per post)
cdef int64_t WIRE_MAX_MSG = wire.MAX_MSG


cdef inline void _put16(unsigned char *p, uint16_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = v >> 8


cdef inline void _put32(unsigned char *p, uint32_t v) noexcept nogil:
    p[0] = v & 0xFF
    p[1] = (v >> 8) & 0xFF
    p[2] = (v >> 16) & 0xFF
    p[3] = v >> 24


cdef inline void _put64(unsigned char *p, uint64_t v) noexcept nogil:
    _put32(p, <uint32_t>(v & 0xFFFFFFFFu))
    _put32(p + 4, <uint32_t>(v >> 32))


cdef inline uint16_t _get16(const unsigned char *p) noexcept nogil:
    return <uint16_t>(p[0] | (<uint16_t>p[1] << 8))


cdef inline uint32_t _get32(const unsigned char *p) noexcept nogil:
    return (<uint32_t>p[0] | (<uint32_t>p[1] << 8) | (<uint32_t>p[2] << 16)
            | (<uint32_t>p[3] << 24))


cdef inline uint64_t _get64(const unsigned char *p) noexcept nogil:
    return <uint64_t>_get32(p) | (<uint64_t>_get32(p + 4) << 32)


cdef inline void hdr_encode(const hdr_t *h, unsigned char *p) noexcept nogil:
    p[0] = h.op
    p[1] = h.flags
    _put16(p + 2, h.aux)
    _put32(p + 4, h.psn)
    _put32(p + 8, h.length)
    _put32(p + 12, h.imm)
    _put32(p + 16, h.rkey)
    _put32(p + 20, h.pad)
    _put64(p + 24, h.raddr)
    _put64(p + 32, h.compare_add)
    _put64(p + 40, h.swap)


cdef inline void hdr_decode(const unsigned char *p, hdr_t *h) noexcept nogil:
    h.op = p[0]
    h.flags = p[1]
    h.aux = _get16(p + 2)
    h.psn = _get32(p + 4)
    h.length = _get32(p + 8)
    h.imm = _get32(p + 12)
    h.rkey = _get32(p + 16)
    h.pad = _get32(p + 20)
    h.raddr = _get64(p + 24)
    h.compare_add = _get64(p + 32)
    h.swap = _get64(p + 40)


cdef inline void hdr_set(hdr_t *h, int op, uint32_t psn, uint32_t length) noexcept nogil:
    memset(h, 0, sizeof(hdr_t))
    h.op = <uint8_t>op
    h.psn = psn
    h.length = length


cdef inline bint is_request(int op) noexcept nogil:
    return OP_SEND <= op <= OP_FETCH_ADD


cdef inline bint is_response(int op) noexcept nogil:
    return OP_ACK <= op <= OP_ATOMIC_RESP


cdef inline bint has_payload(int op) noexcept nogil:
    return OP_SEND <= op <= OP_WRITE_IMM or op == OP_READ_RESP


cdef inline bint is_rd_atomic(int op) noexcept nogil:
    return OP_READ <= op <= OP_FETCH_ADD


cdef inline bint is_cma_op(int op) noexcept nogil:
    return OP_WRITE <= op <= OP_READ


cdef inline uint32_t payload_len(const hdr_t *h) noexcept nogil:
    """How many payload bytes follow the header ``h``."""
    if h.flags & FLAG_CMA:
        return IOV_SIZE * h.aux if is_cma_op(h.op) else 0
    return h.length if has_payload(h.op) else 0


cdef inline uint32_t psn_add(uint32_t psn, uint32_t n) noexcept nogil:
    return (psn + n) & PSN_MASK


cdef inline bint psn_before(uint32_t a, uint32_t b) noexcept nogil:
    """True when PSN ``a`` comes strictly before ``b`` (24-bit serial arithmetic)."""
    cdef uint32_t d = (b - a) & PSN_MASK
    return 0 < d < 0x800000


def encode_header(int op, int flags, int aux, uint32_t psn, uint32_t length, uint32_t imm,
                  uint32_t rkey, uint64_t remote_addr, uint64_t compare_add, uint64_t swap):
    """The 48 header bytes of these fields (what the data path writes; tests compare it
    with ``wire.pack``)."""
    cdef hdr_t h
    cdef unsigned char out[HDR_SIZE]
    h.op = <uint8_t>op
    h.flags = <uint8_t>flags
    h.aux = <uint16_t>aux
    h.psn = psn
    h.length = length
    h.imm = imm
    h.rkey = rkey
    h.pad = 0
    h.raddr = remote_addr
    h.compare_add = compare_add
    h.swap = swap
    hdr_encode(&h, out)
    return PyBytes_FromStringAndSize(<char *>out, HDR_SIZE)


def decode_header(const unsigned char[:] data):
    """The fields of a 48-byte header, as ``wire.HDR.unpack`` orders them."""
    cdef hdr_t h
    if data.shape[0] < HDR_SIZE:
        raise ValueError("a header is 48 bytes")
    hdr_decode(&data[0], &h)
    return (h.op, h.flags, h.aux, h.psn, h.length, h.imm, h.rkey, h.pad, h.raddr,
            h.compare_add, h.swap)
