"""Wire protocol of the ``soft`` device (one TCP stream per direction of a QP pair).

Connections
-----------
A QP moving to RTR needs a *requester connection* to the peer QP: its requests travel
on it to the peer, and the peer's responses to them come back on it, in order. If the
peer QP already connected to us (it reached RTR first; its connection waits, held,
for our RTR), we adopt that connection: one TCP stream then carries both directions,
and each side tells requests from responses by opcode. Otherwise we open one, and the
peer adopts it when it reaches RTR later -- or, when both opened one at the same time,
each side's requests travel on its own connection and the other one carries the
responses (the peer's requests arrive on our *responder connection*). The responder
answers on the connection its requests came from.

The first bytes of a connection, from the side that opened it, are a ``HELLO``::

    magic "AIOSOFT1" | u16 version | u16 src_port | u32 src_qpn | u32 dst_qpn | 16s src_gid
    | 16s nonce | 16s mac

``mac`` is the first 16 bytes of HMAC-SHA256(key, "aiordma-soft-hello" | every field
before it), ``key`` being the secret both QPs of the pair were given (``QPAttr.auth_key``:
the aiordma handshake derives a fresh one per connection; without one, the device's
own secret, which never leaves the process). The accepting device (admission.py)
binds the connection to QP ``dst_qpn`` only if that QP exists, has a key, the MAC is
right for it, the nonce was not seen before on that QP, and the QP is (or becomes)
RTR/RTS with ``dest_qp_num`` = ``src_qpn``; otherwise it closes the connection without
a byte of answer, the same way whatever the reason. Nothing is allocated for a
connection before its HELLO passes.

Acknowledgements are coalesced: one ACK per batch of input. When the application's
event loop reads the input (manual progress, cq.py) the ACK waits until the loop has
run the callbacks that input woke, so that it usually travels in the same write as
the application's answer; it is sent on its own at the latest one loop iteration later.

Messages
--------
Everything after the hello is a sequence of fixed 48-byte headers, each followed by
``length`` payload bytes for the opcodes in ``PAYLOAD_OPS``. All fields little-endian::

    u8 op | u8 flags | u16 aux | u32 psn | u32 length | u32 imm | u32 rkey | u32 pad
    | u64 remote_addr | u64 compare_add | u64 swap

Requests (requester -> responder): SEND, SEND_IMM, WRITE, WRITE_IMM (payload =
the data), READ (``length`` = bytes to read, no payload), CMP_SWP, FETCH_ADD (8-byte
operand(s) in ``compare_add``/``swap``). Each request consumes one PSN (24 bits,
modular), the first one being the requester's ``sq_psn`` = the responder's ``rq_psn``.

Responses (responder -> requester): ACK (cumulative: every request up to and including
``psn`` is done), NAK (``aux`` = syndrome, request ``psn`` failed; an RNR NAK carries
the responder's min_rnr_timer code in ``flags``), READ_RESP (payload = the data read),
ATOMIC_RESP (``compare_add`` = the original remote value). Any response for ``psn``
also acknowledges every earlier request (as IB's implicit acknowledgement does).

Same-host cross-memory attach (``cma``): a WRITE, WRITE_IMM or READ request with
``FLAG_CMA`` carries, instead of the data, ``aux`` iovec records ``u64 addr | u64 len``
(the requester's local SGEs, ``length`` bytes in all) as its payload; the responder
validates it as any request, then copies the data itself between the requester's
process (pid from ``SO_PEERCRED``) and the MR, and answers as usual (a READ with a
READ_RESP carrying ``FLAG_CMA`` and no payload). A requester sends FLAG_CMA only on a
connection whose probe succeeded: CMA_PROBE (``remote_addr``/``compare_add`` = the
address and value of a probe word in the requester) is answered by CMA_ACK (``aux`` =
1 when the responder could read the word, else 0). Neither consumes a PSN.

Shared memory (``cma``: ``PeerMaps``): a READ with FLAG_CMA whose one local SGE lies in
a ``SharedMemory`` buffer of the requester also carries ``FLAG_SHM``, with ``imm`` = the
buffer's fd in the requester, ``compare_add`` = the SGE's offset in it, ``swap`` = its
inode. The responder may then copy into its own mapping of that buffer instead of
using the iovec records; its answer is the same. A responder that cannot (or does not
know the flag) uses the records.

The responder only executes the request whose PSN is the expected one and silently
drops others; after an RNR NAK for PSN p the requester waits and retransmits
go-back-N from p, and the responder drops everything until p arrives again.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
from typing import Final

MAGIC: Final = b"AIOSOFT1"
VERSION: Final = 3  # 3: the authenticated HELLO; 2: the CMA probe (cma.py)

HELLO: Final = struct.Struct("<8sHHII16s16s16s")
#: what the HELLO's MAC covers: every field before it
_HELLO_SIGNED: Final = struct.Struct("<8sHHII16s16s")
_HELLO_LABEL: Final = b"aiordma-soft-hello"
MAC_SIZE: Final = 16
HDR: Final = struct.Struct("<BBHIIIIIQQQ")

# requests
OP_SEND: Final = 1
OP_SEND_IMM: Final = 2
OP_WRITE: Final = 3
OP_WRITE_IMM: Final = 4
OP_READ: Final = 5
OP_CMP_SWP: Final = 6
OP_FETCH_ADD: Final = 7
# responses
OP_ACK: Final = 16
OP_NAK: Final = 17
OP_READ_RESP: Final = 18
OP_ATOMIC_RESP: Final = 19
# connection control (no PSN; handled by the connection itself)
OP_CMA_PROBE: Final = 32
OP_CMA_ACK: Final = 33

REQUEST_OPS: Final = frozenset({OP_SEND, OP_SEND_IMM, OP_WRITE, OP_WRITE_IMM, OP_READ, OP_CMP_SWP,
                         OP_FETCH_ADD})
RESPONSE_OPS: Final = frozenset({OP_ACK, OP_NAK, OP_READ_RESP, OP_ATOMIC_RESP})
PAYLOAD_OPS: Final = frozenset({OP_SEND, OP_SEND_IMM, OP_WRITE, OP_WRITE_IMM, OP_READ_RESP})

# flags
FLAG_SOLICITED: Final = 1
FLAG_CMA: Final = 2  # WRITE/READ by cross-memory attach (see above)
FLAG_SHM: Final = 4  # READ (with FLAG_CMA): the destination is shared memory (above)
CMA_OPS: Final = frozenset({OP_WRITE, OP_WRITE_IMM, OP_READ})
IOV_SIZE: Final = 16

# NAK syndromes (aux)
NAK_RNR: Final = 1
NAK_INV_REQ: Final = 2
NAK_REM_ACCESS: Final = 3
NAK_REM_OP: Final = 4

PSN_MASK: Final = 0xFFFFFF
MAX_MSG: Final = 1 << 31


# The opcode sets above as comparisons of a C integer: the per-packet path asks these
# (a frozenset's membership test is a hash lookup of a boxed int); the tests check that
# each predicate agrees with its set on every u8.
def is_request(op: int) -> bool:
    """``op in REQUEST_OPS``."""
    return OP_SEND <= op <= OP_FETCH_ADD


def is_response(op: int) -> bool:
    """``op in RESPONSE_OPS``."""
    return OP_ACK <= op <= OP_ATOMIC_RESP


def has_payload(op: int) -> bool:
    """``op in PAYLOAD_OPS``."""
    return OP_SEND <= op <= OP_WRITE_IMM or op == OP_READ_RESP


def is_rd_atomic(op: int) -> bool:
    """``op`` reads the responder's memory (READ, CMP_SWP, FETCH_ADD)."""
    return OP_READ <= op <= OP_FETCH_ADD


def is_cma_op(op: int) -> bool:
    """``op in CMA_OPS``."""
    return OP_WRITE <= op <= OP_READ


def payload_len(h: tuple[int, ...]) -> int:
    """How many payload bytes follow the header ``h`` (an unpacked ``HDR``)."""
    op: int = h[0]
    if h[1] & FLAG_CMA:
        return IOV_SIZE * h[2] if is_cma_op(op) else 0
    return h[4] if has_payload(op) else 0


def psn_add(psn: int, n: int = 1) -> int:
    return (psn + n) & PSN_MASK


def psn_before(a: int, b: int) -> bool:
    """True when PSN ``a`` comes strictly before ``b`` (24-bit serial arithmetic)."""
    d = (b - a) & PSN_MASK
    return 0 < d < 0x800000


def hello_mac(key: bytes, magic: bytes, version: int, src_port: int, src_qpn: int,
              dst_qpn: int, src_gid: bytes, nonce: bytes) -> bytes:
    """The MAC of a HELLO with these fields under ``key``."""
    signed = _HELLO_SIGNED.pack(magic, version, src_port, src_qpn, dst_qpn, src_gid, nonce)
    return hmac.new(key, _HELLO_LABEL + signed, hashlib.sha256).digest()[:MAC_SIZE]


def pack_hello(src_port: int, src_qpn: int, dst_qpn: int, src_gid: bytes, key: bytes) -> bytes:
    """A HELLO from QP ``src_qpn`` to ``dst_qpn``, with a fresh nonce, signed with ``key``."""
    nonce = secrets.token_bytes(16)
    mac = hello_mac(key, MAGIC, VERSION, src_port, src_qpn, dst_qpn, src_gid, nonce)
    return HELLO.pack(MAGIC, VERSION, src_port, src_qpn, dst_qpn, src_gid, nonce, mac)


def pack(op: int, psn: int, length: int = 0, *, flags: int = 0, aux: int = 0, imm: int = 0,
         rkey: int = 0, remote_addr: int = 0, compare_add: int = 0, swap: int = 0) -> bytes:
    return _HDR_PACK(op, flags, aux, psn, length, imm, rkey, 0, remote_addr, compare_add, swap)


_HDR_PACK: Final = HDR.pack  # (bound once: a call, not a method lookup, per packet)


#: IB min_rnr_timer encoding -> seconds (IBTA table 45).
RNR_TIMER_S: Final = (
    655.36e-3, 0.01e-3, 0.02e-3, 0.03e-3, 0.04e-3, 0.06e-3, 0.08e-3, 0.12e-3,
    0.16e-3, 0.24e-3, 0.32e-3, 0.48e-3, 0.64e-3, 0.96e-3, 1.28e-3, 1.92e-3,
    2.56e-3, 3.84e-3, 5.12e-3, 7.68e-3, 10.24e-3, 15.36e-3, 20.48e-3, 30.72e-3,
    40.96e-3, 61.44e-3, 81.92e-3, 122.88e-3, 163.84e-3, 245.76e-3, 327.68e-3, 491.52e-3,
)
