# cython: language_level=3
# The message engine, compiled (engine.pyx and the engine_*.pxi files it includes): its
# C-level declarations, for the module itself and for compiled drivers.

from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t

from aiordma.verbs.cverbs cimport c_qp_ops_t, c_recv_wr_t, c_send_wr_t, c_wc_t


cdef class ConnectionState:
    cdef readonly object local       # our side (Local)
    cdef readonly object remote      # the peer's side (Remote)
    cdef readonly bint failed
    cdef readonly bint final
    cdef bint _poisoned
    cdef object summary_c(self)
    cpdef object handle(self, object event)
    cdef bint can_send_c(self) noexcept
    cdef bint can_receive_c(self) noexcept


cdef class Slots:
    cdef readonly object view
    cdef readonly object base
    cdef readonly object lkey
    cdef readonly int slot_size
    cdef readonly int count
    cdef unsigned char *mem      # the view's memory (NULL once forgotten)
    cdef uint64_t base_addr      # ``base`` and ``lkey`` as C integers
    cdef uint32_t lkey_c
    cdef Py_ssize_t _size
    cdef int *_free              # a stack of free slot indices
    cdef int _nfree
    cdef unsigned char *_used
    cdef int acquire_c(self) noexcept     # -1: none free
    cdef int release_c(self, int i) except -1
    cdef inline unsigned char *ptr(self, int i) noexcept


cdef class CreditState:
    cdef int _peer_credits
    cdef int _held
    cdef int _initial_peer
    cdef int _local_slots
    cdef int _owed
    cdef int _repost_batch
    cdef int _reserve
    cdef int _threshold
    cpdef bint can_send_data(self) except -1
    cpdef bint can_send_control(self) except -1
    cdef int consume_c(self, bint control) except -1
    cdef int consume_close_c(self) except -1
    cdef int on_credits_c(self, int n) except -1
    cdef int on_reposted_c(self, int n) except -1
    cdef int take_piggyback_c(self) noexcept
    cdef bint should_send_credit_c(self) noexcept


cdef enum:
    # a DATA payload of up to this many bytes (not bytes) is copied into its op itself
    C_SMALL_PAYLOAD = 256


cdef class Op:
    cdef public int kind
    cdef public object fut
    cdef public object slot
    cdef public object keep
    cdef public object wr
    cdef public object payload
    cdef public object msg_id
    cdef public bint posted
    cdef public int nbytes       # a frame's length (the C path builds no SendWR for it)
    # a one-sided work request of one SGE as C fields (``rdma_op``; c_wr False: ``wr``)
    cdef bint c_wr
    cdef int c_opcode
    cdef uint32_t c_length, c_lkey, c_rkey, c_imm
    cdef uint64_t c_laddr, c_raddr, c_compare_add, c_swap
    # a small DATA payload held in the op itself (``c_small_len`` bytes of ``c_small``;
    # ``c_inline`` False: ``payload``)
    cdef bint c_inline
    cdef int c_small_len
    cdef unsigned char c_small[C_SMALL_PAYLOAD]
    # the error it finished with while it had no waiter (``send_now`` hands it on)
    cdef object error


cdef class Rx:
    cdef public int kind
    cdef public int slot
    cdef public Py_ssize_t offset
    cdef public Py_ssize_t length
    cdef public object addr
    cdef public object rkey
    cdef public object msg_id
    cdef public object read
    cdef public object staging
    cdef public bint done_sent
    cdef public bint deferred


ctypedef struct sq_entry_t:
    uint64_t wr_id
    void *op          # the op (a reference held while queued)


cdef class SendQueue:
    cdef readonly int depth
    cdef readonly int signal_interval
    cdef readonly int signal_bytes
    cdef sq_entry_t *_q
    cdef int _head
    cdef int _n
    cdef int _since_signal
    cdef int64_t _bytes_since
    cdef uint64_t _last_signaled
    cdef bint _signaled_any
    cdef bint push_c(self, uint64_t wr_id, object op, bint last_in_batch, int64_t nbytes) except -1
    cdef int count_to(self, uint64_t wr_id) noexcept
    cdef object pop_c(self, uint64_t *wr_id)


cdef class EnginePort:
    # (the driver's methods are Python methods: a driver written in Python overrides them)
    cdef public bint destroyed


cdef class Fifo:
    cdef list _items             # the ring (a power of two of places; None where empty)
    cdef Py_ssize_t _head
    cdef readonly Py_ssize_t n   # how many items it holds
    cdef int push_c(self, object obj) except -1
    cdef object pop_c(self)
    cdef object head_c(self)
    cdef list _snapshot(self)
    cdef int _rebuild(self, list items, Py_ssize_t cap) except -1


cdef class Sender:
    cdef MessageEngine e
    cdef public Slots spool
    cdef public list frame_wrs
    cdef public SendQueue sq
    cdef readonly Fifo ctrlq
    cdef readonly Fifo oneq
    cdef readonly Fifo sendq
    cdef public dict rndv_out
    cdef uint32_t _msg_ids
    cdef public bint in_tick
    cdef bint _pump_scheduled
    cdef public long messages_batched
    cdef public long work_requests_posted
    cdef c_send_wr_t *_cwrs      # the C path's chain (the send queue's depth of them)
    cdef uint64_t _wr_seq
    cdef int _post_c(self, list batch, int last) except -1
    cdef int _post_marker_c(self) except -1
    cdef int kick_c(self) except -1
    cdef int pump_c(self) except -1
    cdef int _post(self, list batch) except -1
    cdef int _post_batch(self, list batch, int room) except -1
    cdef bint _post_alone_c(self, Op op) except -1
    cdef Op queue_data_c(self, object fut, object payload)
    cdef Op queue_op_c(self, Op op)


cdef class Receiver:
    cdef MessageEngine e
    cdef public Slots rpool
    cdef Py_ssize_t _rslot
    cdef public int repost_batch
    cdef public int64_t rndv_prefetch
    cdef public int64_t busy_ahead
    cdef public int64_t direct_ahead
    cdef bint _direct
    cdef public long posted
    cdef list _repost_q
    cdef readonly Fifo rx
    cdef public list rx_waiters
    cdef readonly Fifo imm
    cdef public list imm_waiters
    cdef public int receivers
    cdef public int64_t prefetched
    cdef public int deferred
    cdef bint _prefetch_scheduled
    cdef public long messages_received
    cdef public int64_t bytes_received
    cdef public long rndv_staged
    cdef c_recv_wr_t *_crwrs     # the C path's chain (one per receive buffer)
    cdef int on_wc_c(self, const c_wc_t *wc, int slot) except -1
    cdef int _on_frame(self, int slot, int opcode, uint32_t imm, Py_ssize_t byte_len) except -1
    cdef int post_c(self, list slots) except -1
    cdef int repost_c(self, int slot) except -1
    cdef int flush_reposts_c(self) except -1
    cdef int consume_data_c(self, Rx rx) except -1
    cdef Rx data_head_c(self)
    cdef Py_ssize_t take_into_c(self, object buffer) except -2
    cdef int64_t ahead_c(self) noexcept


cdef class MessageEngine:
    cdef public EnginePort port
    cdef readonly ConnectionState state
    cdef public CreditState credits
    cdef public object first_error
    cdef public int eager
    cdef public int eager_payload
    cdef public int64_t max_message_size
    cdef public int inline_cap
    cdef public bint batching
    # a close() waits for the pending work: tell the port when work finishes
    # (EnginePort.maybe_closed); the lifecycle sets it when a close begins
    cdef public bint close_watch
    # the port wants EnginePort.posted after each post (False: the reactor's poll mode
    # does nothing with it)
    cdef public bint poke_posts
    cdef int _repost_batch_asked
    cdef public Sender tx
    cdef public Receiver rx
    cdef object _qp              # the QP the C path posts to (None: the port's methods)
    cdef c_qp_ops_t *_qp_ops
    cdef object _waiter_kw       # send_now's waiters: WAITER_TYPE(**_waiter_kw), or
    cdef object _waiter_make     # _waiter_make() where _waiter_kw is None
    cdef Op _send_eager_c(self, object fut, object data)


cdef class EngineTable:
    cdef dict engines            # qp_num -> MessageEngine
    cdef uint32_t last_qp        # the QP last found, and its engine (None: nothing kept)
    cdef MessageEngine last
    cdef MessageEngine find(self, uint32_t qp_num)
