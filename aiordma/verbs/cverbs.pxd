# cython: language_level=3
# The C-level verbs interface between compiled callers and providers: work requests and
# completions as C structs (the fields of ibv_send_wr, ibv_recv_wr and ibv_wc that aiordma
# uses, with their verbs values), and the operations a provider offers on them. A header
# only: no module implements it. A provider hands its operations out in a PyCapsule
# (``CQP_OPS`` / ``CCQ_OPS``), with the object to pass them as their first argument, from
# its QP's and CQ's ``c_ops()``; the caller keeps both alive meanwhile. Each
# operation runs with the GIL held and returns 0, or -1 with a Python exception set
# (the QP's state, a full queue: what ``post_send``/``post_recv``/``poll`` raise). The
# caller has checked the work requests (``verbs/contract.py``'s rules hold for them).

from libc.stdint cimport uint32_t, uint64_t


cdef extern from *:
    """
    #define AIORDMA_CQP_OPS "aiordma.verbs.cverbs.qp_ops"
    #define AIORDMA_CCQ_OPS "aiordma.verbs.cverbs.cq_ops"
    """
    const char *CQP_OPS "AIORDMA_CQP_OPS"
    const char *CCQ_OPS "AIORDMA_CCQ_OPS"


# a send work request with at most one SGE (``length`` 0: none)
ctypedef struct c_send_wr_t:
    uint64_t wr_id
    int opcode            # ibv_wr_opcode
    int send_flags        # ibv_send_flags
    uint64_t addr
    uint32_t length
    uint32_t lkey
    uint32_t imm_data
    uint32_t rkey
    uint64_t remote_addr
    uint64_t compare_add
    uint64_t swap


# a receive work request with one SGE
ctypedef struct c_recv_wr_t:
    uint64_t wr_id
    uint64_t addr
    uint32_t length
    uint32_t lkey


# a work completion
ctypedef struct c_wc_t:
    uint64_t wr_id
    int status            # ibv_wc_status
    int opcode            # ibv_wc_opcode
    uint32_t byte_len
    uint32_t imm_data
    uint32_t qp_num
    uint32_t src_qp
    int wc_flags          # ibv_wc_flags
    int vendor_err


ctypedef int (*c_post_send_t)(object qp, c_send_wr_t *wrs, int n) except -1
ctypedef int (*c_post_recv_t)(object qp, c_recv_wr_t *wrs, int n) except -1
ctypedef int (*c_poll_t)(object cq, c_wc_t *out, int n) except -1

ctypedef struct c_qp_ops_t:
    c_post_send_t post_send     # a chain, checked whole before anything is posted
    c_post_recv_t post_recv

ctypedef struct c_cq_ops_t:
    c_poll_t poll               # up to n completions into out; returns how many
