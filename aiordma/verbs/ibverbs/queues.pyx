# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""A QP's outstanding work requests, counted the way hardware counts them (``WorkQueues``),
in C: the compiled data path (``fastpath``) accounts for its posts and completions here
without a Python object per message, and the Python posts and polls of ``IbvQP``/
``IbvCQ`` use the same object through its Python methods. It needs no system header, so
it is built wherever aiordma is (``aiordma.native.EXTENSIONS``, tag ``queues``).

A send-queue slot is held from posting until the completion of that WR, or of a later
signaled WR of the same QP, has been polled (unsignaled WRs that succeed produce no
completion; their slots come free with the next polled signaled completion). A receive
slot is held until its completion is polled. Posts are recorded only after the device
accepted them, so a chain that does not fit is refused before it is posted.
"""

from libc.stdint cimport uint8_t, uint64_t
from libc.stdlib cimport calloc, free

from aiordma.verbs.enums import WCOpcode

# every receive opcode of ibv_wc_opcode has this bit, no send opcode has it
cdef enum:
    _WC_RECV_BIT = 0x80
    _WC_RECV = 128  # IBV_WC_RECV

_M64 = 0xFFFFFFFFFFFFFFFF


cdef class WorkQueues:
    """The send and receive queues of one QP of depths ``max_send``/``max_recv``.

    Python API (``IbvQP``/``IbvCQ`` and tests): ``send_room()``, ``recv_room()``,
    ``posted_send(entries)``, ``posted_recv(wr_ids)``, ``completed(...)``,
    ``recv_completed()``, ``reset()``; ``sq``/``rq``: what is outstanding, oldest first
    (tuples, read only). The C API is in queues.pxd."""

    def __cinit__(self, int max_send, int max_recv):
        if max_send < 0 or max_recv < 0:
            raise ValueError("negative queue depth")
        self.max_send = max_send
        self.max_recv = max_recv
        self.sq_id = <uint64_t *>calloc(max_send + 1, sizeof(uint64_t))
        self.sq_signaled = <uint8_t *>calloc(max_send + 1, sizeof(uint8_t))
        self.sq_op = <uint8_t *>calloc(max_send + 1, sizeof(uint8_t))
        self.rq_id = <uint64_t *>calloc(max_recv + 1, sizeof(uint64_t))
        if (self.sq_id == NULL or self.sq_signaled == NULL or self.sq_op == NULL
                or self.rq_id == NULL):
            raise MemoryError()

    def __dealloc__(self):
        free(self.sq_id)
        free(self.sq_signaled)
        free(self.sq_op)
        free(self.rq_id)

    # --- C level ---------------------------------------------------------------------
    cdef int push_send(self, uint64_t wr_id, bint signaled, int wc_opcode) except -1:
        """Record a posted send WR; OverflowError when the queue is full (the caller
        checked ``send_room`` before posting)."""
        cdef int i
        if self.sq_len >= self.max_send:
            raise OverflowError("send queue accounting overflow")
        i = (self.sq_head + self.sq_len) % self.max_send
        self.sq_id[i] = wr_id
        self.sq_signaled[i] = 1 if signaled else 0
        self.sq_op[i] = <uint8_t>wc_opcode
        self.sq_len += 1
        return 0

    cdef int push_recv(self, uint64_t wr_id) except -1:
        """Record a posted receive WR; OverflowError when the queue is full."""
        if self.rq_len >= self.max_recv:
            raise OverflowError("receive queue accounting overflow")
        self.rq_id[(self.rq_head + self.rq_len) % self.max_recv] = wr_id
        self.rq_len += 1
        return 0

    cdef void recv_done(self) noexcept:
        """The oldest receive completed."""
        if self.rq_len:
            self.rq_head = (self.rq_head + 1) % self.max_recv
            self.rq_len -= 1

    cdef int _sq_index(self, uint64_t wr_id, bint signaled_only) noexcept:
        cdef int k, i
        for k in range(self.sq_len):
            i = (self.sq_head + k) % self.max_send
            if self.sq_id[i] == wr_id and (self.sq_signaled[i] or not signaled_only):
                return k
        return -1

    cdef int complete(self, uint64_t wr_id, bint success, int raw_opcode, bint send_side,
                      bint recv_side) noexcept:
        """Account for a polled completion; returns the ibv_wc_opcode the WR had (best
        knowledge), -1 when unknown. ``send_side``/``recv_side``: whether the CQ it was
        polled from is the QP's send CQ and/or receive CQ. On a shared CQ a successful
        completion is placed by its opcode, an error one (opcode undefined) by its
        wr_id."""
        cdef bint side_recv, in_sq, rq_head
        cdef int k, op
        if send_side and recv_side:
            if success:
                side_recv = (raw_opcode & _WC_RECV_BIT) != 0
            else:
                in_sq = self._sq_index(wr_id, False) >= 0
                rq_head = self.rq_len > 0 and self.rq_id[self.rq_head] == wr_id
                if rq_head and not in_sq:
                    side_recv = True
                elif in_sq and not rq_head:
                    side_recv = False
                elif in_sq and rq_head:
                    side_recv = (raw_opcode & _WC_RECV_BIT) != 0
                else:
                    return -1
        else:
            side_recv = recv_side
        if side_recv:
            self.recv_done()
            return _WC_RECV
        k = self._sq_index(wr_id, success)
        if k < 0 and success:  # wr_id reused or unknown: the oldest signaled one
            for k in range(self.sq_len):
                if self.sq_signaled[(self.sq_head + k) % self.max_send]:
                    break
            else:
                k = -1
        if k < 0:
            return -1
        op = self.sq_op[(self.sq_head + k) % self.max_send]
        self.sq_head = (self.sq_head + k + 1) % self.max_send
        self.sq_len -= k + 1
        return op

    # --- Python level ----------------------------------------------------------------
    def send_room(self):
        """How many send WRs may be posted now."""
        return self.max_send - self.sq_len

    def recv_room(self):
        """How many receive WRs may be posted now."""
        return self.max_recv - self.rq_len

    def posted_send(self, entries):
        """Record posted send WRs: ``(wr_id, signaled, WCOpcode)`` each, in order.
        OverflowError, recording none, when they do not fit."""
        entries = list(entries)
        if len(entries) > self.max_send - self.sq_len:
            raise OverflowError("send queue accounting overflow")
        for wr_id, signaled, op in entries:
            self.push_send(wr_id & _M64, signaled, int(op))

    def posted_recv(self, wr_ids):
        """Record posted receive WRs, in order; OverflowError, recording none, when they
        do not fit."""
        wr_ids = list(wr_ids)
        if len(wr_ids) > self.max_recv - self.rq_len:
            raise OverflowError("receive queue accounting overflow")
        for wr_id in wr_ids:
            self.push_recv(wr_id & _M64)

    def recv_completed(self):
        """The oldest receive completed (a successful receive completion)."""
        self.recv_done()

    def completed(self, wr_id, success, int raw_opcode, send_side, recv_side):
        """``complete`` (the C level) from Python: the ``WCOpcode`` the WR had, or None
        when unknown."""
        cdef int op = self.complete(wr_id & _M64, success, raw_opcode, send_side, recv_side)
        return None if op < 0 else WCOpcode(op)

    def reset(self):
        """Nothing outstanding (the QP was reset or destroyed)."""
        self.sq_head = self.sq_len = 0
        self.rq_head = self.rq_len = 0

    @property
    def sq(self):
        """The outstanding send WRs, oldest first: ``(wr_id, signaled, WCOpcode)``."""
        cdef int k, i
        out = []
        for k in range(self.sq_len):
            i = (self.sq_head + k) % self.max_send
            out.append((self.sq_id[i], bool(self.sq_signaled[i]), WCOpcode(self.sq_op[i])))
        return tuple(out)

    @property
    def rq(self):
        """The outstanding receive WRs' wr_ids, oldest first."""
        return tuple(self.rq_id[(self.rq_head + k) % self.max_recv] for k in range(self.rq_len))

    def __repr__(self):
        return (f"<WorkQueues send {self.sq_len}/{self.max_send} "
                f"recv {self.rq_len}/{self.max_recv}>")
