# cython: language_level=3
# The soft device's data path (_core.pyx and the .pxi files it includes): its C-level
# declarations, for the module itself and for compiled callers that post and poll
# without a Python object per message:
#
#     from aiordma.verbs.soft._core cimport SoftQP, SoftCQ, cqe_t
#
# Every structure here is protected by the device lock (``DeviceLock``) except where a
# comment says otherwise; the GIL makes each C-level update atomic for Python threads.

from cpython.object cimport PyObject
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from aiordma.verbs.cverbs cimport c_cq_ops_t, c_qp_ops_t, c_recv_wr_t, c_send_wr_t, c_wc_t


# --- the wire header (core_wire.pxi; wire.py documents the format) ---------------------
ctypedef struct hdr_t:
    uint8_t op
    uint8_t flags
    uint16_t aux
    uint32_t psn
    uint32_t length
    uint32_t imm
    uint32_t rkey
    uint32_t pad
    uint64_t raddr
    uint64_t compare_add
    uint64_t swap


# a piece of memory a work request reads or writes; ``mr``: the SoftMR it lies in, pinned
# (SoftMR.users) while referenced from here (NULL: memory the entry owns itself)
ctypedef struct seg_t:
    char *ptr
    Py_ssize_t len
    void *mr


# a send work queue entry (core_qpcore.pxi)
ctypedef struct swqe_t:
    uint64_t wr_id
    int op            # wire opcode
    int wc_opcode     # ibv_wc_opcode of its completion
    uint32_t length   # bytes it moves
    uint32_t psn
    int signaled
    int fence
    int rd_atomic
    int error         # a WCStatus it completes with when transmitted, or -1
    int rnr_left      # RNR retries left (-1: not NAK'd yet)
    int nsegs
    seg_t *segs       # its local memory (the QP's seg array: max(max_send_sge, 1) each)
    unsigned char hdr[48]


# a receive work queue entry
ctypedef struct sge_t:
    uint64_t addr
    uint32_t length
    uint32_t lkey


ctypedef struct rwqe_t:
    uint64_t wr_id
    int64_t length
    int nsge
    sge_t *sges       # the QP's SGE array: max(max_recv_sge, 1) each


# a completion queue entry (the fields of ibv_wc aiordma reads), with the send-queue
# slots it releases when polled
ctypedef struct cqe_t:
    uint64_t wr_id
    int status
    int opcode
    uint32_t byte_len
    uint32_t imm_data
    uint32_t qp_num
    uint32_t src_qp
    int wc_flags
    int vendor_err
    void *qp          # the SoftQP (a reference held while queued) or NULL
    int gen
    int release


cdef extern from "<semaphore.h>" nogil:
    ctypedef struct sem_t:
        pass
    int sem_init(sem_t *sem, int pshared, unsigned int value)
    int sem_destroy(sem_t *sem)
    int sem_wait(sem_t *sem)
    int sem_trywait(sem_t *sem)
    int sem_post(sem_t *sem)


cdef class DeviceLock:
    cdef sem_t _sem
    cdef bint _ready
    cdef int acquire_c(self) except -1
    cdef void release_c(self) noexcept


cdef class PipeFlag:
    cdef public int fd
    cdef int _wfd
    cdef bint _up
    cdef void raise_c(self) noexcept
    cdef void lower_c(self) noexcept


cdef class SoftMR:
    cdef readonly object pd
    cdef readonly object view
    cdef readonly object access
    cdef readonly uint64_t addr
    cdef readonly Py_ssize_t length
    cdef readonly uint32_t lkey
    cdef readonly uint32_t rkey
    cdef readonly int acc
    cdef char *base
    cdef object _pinned
    cdef bint _closed
    cdef int users                # work requests and sinks referring to its memory
    cdef bint _release_pending    # closed while users > 0: released by the last unpin
    cdef void pin(self) noexcept
    cdef void unpin(self)


cdef enum:
    KEY_CACHE = 64  # KeyTable's direct-mapped cache (a power of two)


cdef class KeyTable:
    cdef dict _by_key
    # recent lookups, slot key % KEY_CACHE: the key and its MR (borrowed: _by_key holds
    # it; remove() clears the slot before it goes)
    cdef uint32_t _ckey[KEY_CACHE]
    cdef PyObject *_cmr[KEY_CACHE]
    cdef SoftMR lookup(self, uint32_t key)


cdef class SoftCompChannel:
    cdef readonly object _ctx
    cdef DeviceLock _lock
    cdef PipeFlag _flag
    cdef public int fd
    cdef object _events
    cdef object _events_append   # _events's bound methods: no lookup per event
    cdef object _events_popleft
    cdef public int _ncqs
    cdef public bint _closed
    cdef int _ep
    cdef public int progress_fd
    cdef dict _conns
    cdef long _consumer
    cdef bint _quiet
    cdef long _serviced
    cdef long _seen
    cdef bint _suspect
    cdef public bint takeover
    cdef set _acks
    cdef void post_event(self, SoftCQ cq)
    cdef bint is_consumer(self) noexcept
    cdef bint defer_ack(self, SoftQP qp)
    cdef void ack_sent(self, SoftQP qp)
    cdef void set_interest(self, Conn conn, int ev)


cdef class SoftCQ:
    cdef readonly object _ctx
    cdef DeviceLock _lock
    cdef public int cqe
    cdef public SoftCompChannel channel
    cdef cqe_t *_ring
    cdef int _head
    cdef int _count
    cdef int _armed
    cdef bint _overrun
    cdef public int _events_got
    cdef public int _events_acked
    cdef dict _qps
    cdef public bint _closed
    cdef void push(self, const cqe_t *e, SoftQP qp, bint solicited)
    cdef int poll_c(self, c_wc_t *out, int n) except -1
    cdef void _clear(self)


cdef class Conn:
    cdef public object engine
    cdef DeviceLock _lock
    cdef public object sock
    cdef public SoftQP owner
    cdef public int state
    cdef public object out
    cdef public bint reading
    cdef public bint want_write
    cdef bint _write_requested
    cdef public int _sel_events
    cdef public double last_tx
    cdef public double last_rx
    cdef public object hello
    cdef public object peer
    cdef int fd
    # input staging (lent from the module's pool while bytes are staged)
    cdef unsigned char *_stage
    cdef Py_ssize_t _rpos
    cdef Py_ssize_t _wpos
    cdef bint _short
    cdef bint _busy
    cdef public bint requests_sent
    cdef public SoftCompChannel driver
    cdef bint _write_broken
    cdef public int cma
    cdef public int cma_min
    cdef int _pid
    cdef object _maps
    # the sink: where the current payload goes (core_sink.pxi)
    cdef bint _sinking
    cdef int _sink_nsegs
    cdef int _sink_idx
    cdef Py_ssize_t _sink_off
    cdef Py_ssize_t _sink_remaining
    cdef bint _sink_discard
    cdef seg_t _sink_segs[33]
    cdef int _done
    cdef uint32_t _d_psn
    cdef uint32_t _d_length
    cdef uint32_t _d_imm
    cdef int _d_flags
    cdef int _d_gen
    cdef uint64_t _d_seq
    cdef object _d_job
    cdef object _d_call
    cdef object _d_keep
    cdef object _d_qp

    cdef int send_c(self, list bufs) except -1
    cdef int send_segs(self, seg_t *segs, int nsegs, Py_ssize_t total) except -1
    cdef void _flush_c(self)
    cdef void _queue_rest(self, seg_t *segs, int nsegs, Py_ssize_t skip)
    cdef void _need_write(self)
    cdef void _drop_sent(self, Py_ssize_t n)
    cdef Py_ssize_t _write(self, list bufs) except -2
    cdef void _broken(self)
    cdef void update_sel(self)
    cdef int on_readable_c(self) except -1
    cdef bint cma_ready_c(self) except -1
    cdef void _cma_control(self, const hdr_t *h) except *


cdef class SoftQP:
    # (the data path's functions take it as their first argument: core_qpcore.pxi and the
    # files after it)
    cdef object __weakref__
    cdef object _engine
    cdef readonly object _ctx
    cdef public object pd
    cdef public SoftCQ send_cq
    cdef public SoftCQ recv_cq
    cdef public object cap
    cdef int _max_send_wr
    cdef int _max_recv_wr
    cdef int _max_inline
    cdef int _send_sge
    cdef int _recv_sge
    cdef DeviceLock _lock
    cdef KeyTable _keys
    cdef public uint32_t qp_num
    cdef public int _state
    cdef public bint _closed
    cdef public int _gen
    cdef public int _sq_used
    cdef int _unsig
    # the send queue: a ring of _max_send_wr entries, oldest first; [head, head+nsent) are
    # in flight (transmitted), the rest up to head+count not transmitted yet
    cdef swqe_t *_sq
    cdef seg_t *_sq_segs
    cdef unsigned char *_sq_inline
    cdef int _sq_head
    cdef int _sq_nsent
    cdef int _sq_count
    # the receive queue: a ring of _max_recv_wr entries; _rq_seq counts the entries ever
    # taken off its head (a sink names the entry it fills by that number)
    cdef rwqe_t *_rq
    cdef sge_t *_rq_sges
    cdef int _rq_head
    cdef int _rq_count
    cdef uint64_t _rq_seq
    # attributes
    cdef public object _access
    cdef int _acc
    cdef public uint32_t _dest_qpn
    cdef public object _ah
    cdef uint32_t _epsn
    cdef uint32_t _next_psn
    cdef int _min_rnr_timer
    cdef int _timeout
    cdef int _retry_cnt
    cdef int _rnr_retry
    cdef public object _auth_key
    cdef set _hello_nonces
    cdef public Conn _req_conn
    cdef public Conn _resp_conn
    cdef bint _rnr_wait
    cdef bint _ack_armed
    cdef double _progress
    cdef double _try_start
    cdef int _retries_left
    cdef public long local_ack_timeouts
    cdef int64_t _ack_pending
    cdef bint _conn_wait
