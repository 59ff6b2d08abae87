# cython: language_level=3
# The C-level interface of the compiled data path (fastpath.pyx), for compiled callers:
#
#     from aiordma.verbs.ibverbs.fastpath cimport QPPoster, CQPoller
#
# A caller fills the WRs of poster.send_array(n) (the SGE slots of WR i are at
# wrs[i].sg_list, poster.send_stride of them) and posts them as one chain with
# post_send_array(n, &posted); it polls into poller.wcs with poll_array(n) and arms the
# CQ with arm(solicited_only). No Python object is involved per message; the GIL is not
# needed by the *_array calls or arm.

from libc.stdint cimport uint32_t, uintptr_t

from aiordma.verbs.ibverbs.libibverbs cimport (
    ibv_ack_cq_events_fn,
    ibv_cq,
    ibv_get_cq_event_fn,
    ibv_qp,
    ibv_recv_wr,
    ibv_send_wr,
    ibv_sge,
    ibv_wc,
)
from aiordma.verbs.ibverbs.queues cimport WorkQueues


cdef class QPPoster:
    cdef ibv_qp *qp
    cdef ibv_send_wr *send_wrs
    cdef ibv_sge *send_sges
    cdef ibv_recv_wr *recv_wrs
    cdef ibv_sge *recv_sges
    # WRs allocated so far; a chain is at most the queue's depth (max_send / max_recv)
    cdef int send_cap
    cdef int recv_cap
    cdef readonly int max_send
    cdef readonly int max_recv
    # SGE slots per WR: the QP's max_send_sge / max_recv_sge, at least 1
    cdef readonly int send_stride
    cdef readonly int recv_stride
    # for the C-level operations (cverbs.pxd; QPPoster.attach): the QP's queue
    # accounting, its state (ibv_qp_state) and a weak reference to its IbvQP
    cdef WorkQueues queues
    cdef int state
    cdef object owner

    cdef ibv_send_wr *send_array(self, int n) except NULL
    cdef ibv_recv_wr *recv_array(self, int n) except NULL
    cdef int post_send_array(self, int n, int *posted) noexcept nogil
    cdef int post_recv_array(self, int n, int *posted) noexcept nogil


cdef class _Tracked:
    cdef uint32_t qp_num
    cdef WorkQueues queues
    cdef bint send_side
    cdef bint recv_side
    cdef object qp   # a weak reference to the IbvQP


cdef class CQPoller:
    cdef ibv_cq *cq
    cdef ibv_wc *wcs
    cdef readonly int entries
    # for the C-level poll (CQPoller.attach / track): the QPs completing here, by
    # qp_num (_Tracked), the last one found, a weak reference to the IbvCQ, and whether
    # completions were lost (the CQ is in error for good)
    cdef dict tracked
    cdef _Tracked last
    cdef object owner
    cdef bint overrun

    cdef int poll_array(self, int n) noexcept nogil
    cdef int arm(self, int solicited_only) noexcept nogil


cdef class CQEvents:
    cdef readonly object cq      # the IbvCQ
    cdef public uintptr_t cq_ptr
    cdef public long long got
    cdef public long long acked


cdef class ChannelEvents:
    cdef void *channel           # NULL once closed
    cdef ibv_get_cq_event_fn get_fn
    cdef ibv_ack_cq_events_fn ack_fn
    cdef dict cqs                # for next_cq: the channel's CQEvents by token (attach)
    cdef int _read(self, ibv_cq **cq, void **ctx) except -1
