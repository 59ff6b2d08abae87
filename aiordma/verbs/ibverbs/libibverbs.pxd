# cython: language_level=3
# The part of rdma-core's <infiniband/verbs.h> that the compiled data path uses: the
# structs of a post and of a poll, and the three static inline calls of the data path.
# Only the members named here are declared; the C compiler sees the real structs.
#
# Verbs facts this relies on (verbs.h, libibverbs ABI 1, rdma-core 44..65):
# * ibv_post_send / ibv_post_recv / ibv_poll_cq are static inline functions that call
#   qp->context->ops.post_send / .post_recv and cq->context->ops.poll_cq: no symbol of
#   libibverbs is linked; the provider library that pyverbs loaded does the work.
# * The device copies a posted WR (and its SGE list) before ibv_post_* returns: the
#   arrays they come from may be rewritten at once.
# * On failure ibv_post_* return an errno value and set *bad_wr to the first WR not
#   posted; the WRs before it were posted. They never block.
# * ibv_poll_cq returns the number of completions written (0: none), negative on error
#   (the CQ is then in error, e.g. overrun). It never blocks.
# * A CQ or QP is polled / posted by one thread at a time (the caller's rule).
# * ibv_req_notify_cq is static inline too (cq->context->ops.req_notify_cq, the member
#   after poll_cq): it arms the CQ for one event on its channel; 0 or an errno value.
# * ibv_get_cq_event / ibv_ack_cq_events are libibverbs symbols (a read(2) of the
#   channel's fd, and the CQ's acknowledged-events count under its mutex), reached
#   through function pointers found in the process's libibverbs (clib.libibverbs), as
#   ibv_modify_qp below. ibv_get_cq_event returns 0, or -1 with errno set (EAGAIN: none
#   queued on a non-blocking fd); every event read must be acknowledged before
#   ibv_destroy_cq.

from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t


cdef extern from "<infiniband/verbs.h>" nogil:
    cdef enum:
        IBV_WR_RDMA_WRITE
        IBV_WR_RDMA_WRITE_WITH_IMM
        IBV_WR_SEND
        IBV_WR_SEND_WITH_IMM
        IBV_WR_RDMA_READ
        IBV_WR_ATOMIC_CMP_AND_SWP
        IBV_WR_ATOMIC_FETCH_AND_ADD
        IBV_SEND_SIGNALED   # ibv_send_flags
        IBV_WC_WITH_IMM     # ibv_wc_flags: imm_data holds the sender's immediate data

    # (function pointers, declared as void * for their offsets only)
    cdef struct ibv_context_ops:
        void *poll_cq
        void *req_notify_cq
        void *post_send
        void *post_recv

    cdef struct ibv_context:
        ibv_context_ops ops
        int cmd_fd
        int async_fd

    cdef struct ibv_cq:
        ibv_context *context
        void *cq_context

    cdef struct ibv_qp:
        ibv_context *context
        ibv_cq *send_cq
        ibv_cq *recv_cq
        uint32_t qp_num

    cdef struct ibv_sge:
        uint64_t addr
        uint32_t length
        uint32_t lkey

    # the anonymous members of struct ibv_send_wr: these type names never reach C (only
    # member accesses do)
    ctypedef struct _ibv_wr_rdma:
        uint64_t remote_addr
        uint32_t rkey

    ctypedef struct _ibv_wr_atomic:
        uint64_t remote_addr
        uint64_t compare_add
        uint64_t swap
        uint32_t rkey

    ctypedef union _ibv_wr_union:
        _ibv_wr_rdma rdma
        _ibv_wr_atomic atomic

    cdef struct ibv_send_wr:
        uint64_t wr_id
        ibv_send_wr *next
        ibv_sge *sg_list
        int num_sge
        int opcode  # enum ibv_wr_opcode
        unsigned int send_flags
        uint32_t imm_data  # __be32, in an anonymous union with invalidate_rkey
        _ibv_wr_union wr

    cdef struct ibv_recv_wr:
        uint64_t wr_id
        ibv_recv_wr *next
        ibv_sge *sg_list
        int num_sge

    cdef struct ibv_wc:
        uint64_t wr_id
        int status  # enum ibv_wc_status
        int opcode  # enum ibv_wc_opcode
        uint32_t vendor_err
        uint32_t byte_len
        uint32_t imm_data  # __be32, in an anonymous union with invalidated_rkey
        uint32_t qp_num
        uint32_t src_qp
        unsigned int wc_flags
        uint16_t pkey_index
        uint16_t slid
        uint8_t sl
        uint8_t dlid_path_bits

    # INIT -> RTR, the one state change made here (fastpath.QPPoster.modify_rtr): an
    # ibv_modify_qp call, a libibverbs symbol reached through a function pointer that
    # the caller found in the process's libibverbs (clib.libibverbs), so that the GIL is
    # released while the kernel resolves the destination GID's address (RoCE: ARP or
    # neighbour discovery, up to seconds when nobody answers).
    cdef enum:
        IBV_QPS_RTR
        IBV_QP_STATE
        IBV_QP_AV
        IBV_QP_PATH_MTU
        IBV_QP_DEST_QPN
        IBV_QP_RQ_PSN
        IBV_QP_MAX_DEST_RD_ATOMIC
        IBV_QP_MIN_RNR_TIMER

    cdef union ibv_gid:
        uint8_t raw[16]

    cdef struct ibv_global_route:
        ibv_gid dgid
        uint32_t flow_label
        uint8_t sgid_index
        uint8_t hop_limit
        uint8_t traffic_class

    cdef struct ibv_ah_attr:
        ibv_global_route grh
        uint16_t dlid
        uint8_t sl
        uint8_t is_global
        uint8_t port_num

    cdef struct ibv_qp_attr:
        int qp_state  # enum ibv_qp_state
        int path_mtu  # enum ibv_mtu
        uint32_t rq_psn
        uint32_t dest_qp_num
        ibv_ah_attr ah_attr
        uint8_t max_dest_rd_atomic
        uint8_t min_rnr_timer

    int ibv_post_send(ibv_qp *qp, ibv_send_wr *wr, ibv_send_wr **bad_wr)
    int ibv_post_recv(ibv_qp *qp, ibv_recv_wr *wr, ibv_recv_wr **bad_wr)
    int ibv_poll_cq(ibv_cq *cq, int num_entries, ibv_wc *wc)
    int ibv_req_notify_cq(ibv_cq *cq, int solicited_only)


# ibv_modify_qp's type (a function pointer: see the INIT -> RTR note above)
ctypedef int (*ibv_modify_qp_fn)(ibv_qp *qp, ibv_qp_attr *attr, int attr_mask) noexcept nogil

# ibv_get_cq_event's and ibv_ack_cq_events' types (function pointers: see above); the
# channel is a struct ibv_comp_channel *, opaque here
ctypedef int (*ibv_get_cq_event_fn)(void *channel, ibv_cq **cq, void **cq_context) noexcept nogil
ctypedef void (*ibv_ack_cq_events_fn)(ibv_cq *cq, unsigned int nevents) noexcept nogil
