# cython: language_level=3
# The C-level interface of queues.pyx (a QP's outstanding work requests, counted as
# hardware counts them), for the compiled data path (fastpath.pyx):
#
#     from aiordma.verbs.ibverbs.queues cimport WorkQueues
#
# The send queue is a ring of (wr_id, signaled, ibv_wc_opcode) entries, the receive
# queue a ring of wr_ids; both hold at most their QP's depth.

from libc.stdint cimport uint8_t, uint64_t


cdef class WorkQueues:
    cdef readonly int max_send
    cdef readonly int max_recv
    cdef uint64_t *sq_id
    cdef uint8_t *sq_signaled
    cdef uint8_t *sq_op        # the ibv_wc_opcode the WR completes with
    cdef int sq_head
    cdef int sq_len
    cdef uint64_t *rq_id
    cdef int rq_head
    cdef int rq_len

    cdef int push_send(self, uint64_t wr_id, bint signaled, int wc_opcode) except -1
    cdef int push_recv(self, uint64_t wr_id) except -1
    cdef void recv_done(self) noexcept
    cdef int _sq_index(self, uint64_t wr_id, bint signaled_only) noexcept
    cdef int complete(self, uint64_t wr_id, bint success, int raw_opcode, bint send_side,
                      bint recv_side) noexcept
