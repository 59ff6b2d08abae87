# The records of the message engine (included by engine.pyx): operations to post,
# messages received, and what the engine asks of the waiters it completes.
#
# A **waiter** is whatever the engine's user waits on (an ``asyncio.Future`` in the
# endpoint; a plain recorder in the sans-IO tests): the engine only looks at ``done()``
# and calls ``set_result``/``set_exception`` once, so it never touches an event loop.

cimport cython

# op kinds (BATCH: several DATA ops sent as one BATCH frame; its payload lists them)
DATA = 0
RNDV = 1
CTRL = 2
WRITE = 3
READ = 4
ATOMIC = 5
IMM = 6
RNDV_READ = 7
BATCH = 8
cdef enum:
    K_DATA = 0
    K_RNDV = 1
    K_CTRL = 2
    K_WRITE = 3
    K_READ = 4
    K_ATOMIC = 5
    K_IMM = 6
    K_RNDV_READ = 7
    K_BATCH = 8

# received message kinds
RX_DATA = 0
RX_RNDV = 1
RX_EOF = 2
cdef enum:
    R_DATA = 0
    R_RNDV = 1
    R_EOF = 2


class Waiter(Protocol):
    """What the engine completes: resolved at most once."""

    def done(self) -> bool: ...

    def set_result(self, result, /) -> None: ...

    def set_exception(self, exception, /) -> None: ...


@cython.freelist(64)
cdef class Op:
    """One operation on the send side: queued, then posted as one work request.

    ``wr`` is the provider's work request (a ``SendWR``: the engine sets its ``wr_id``
    and signaled flag and reads its SGE lengths); ``slot`` the eager send buffer a
    frame occupies; ``keep`` what must stay alive until the completion; ``payload``
    the bytes of a DATA op (until copied), the source of a RNDV op, the members of a
    BATCH op or ``(frame type, arg)`` of a CTRL op."""

    def __init__(self, int kind, fut, payload=None, *, wr=None, keep=None, msg_id=0):
        self.kind = kind
        self.fut = fut
        self.slot = None
        self.keep = keep
        self.wr = wr
        self.payload = payload
        self.msg_id = msg_id
        self.posted = False
        self.nbytes = 0

    def __repr__(self):
        return f"<Op kind={self.kind} slot={self.slot} posted={self.posted}>"


def rdma_op(int kind, fut, int opcode, uint64_t laddr, uint32_t length, uint32_t lkey,
            uint64_t raddr, uint32_t rkey, uint32_t imm=0, keep=None):
    """An op of one one-sided work request with one SGE (``opcode``: a ``WROpcode``
    value; ``laddr``/``length``/``lkey`` the local memory, ``raddr``/``rkey`` the
    peer's, ``imm`` a WRITE_WITH_IMM's immediate) held as C fields: the C path posts
    it without a ``SendWR`` (the port path makes one when it posts). Raises
    OverflowError for a field out of its C range."""
    cdef Op op = Op.__new__(Op)
    op.kind = kind
    op.fut = fut
    op.keep = keep
    op.msg_id = 0
    op.c_wr = True
    op.c_opcode = opcode
    op.c_laddr = laddr
    op.c_length = length
    op.c_lkey = lkey
    op.c_raddr = raddr
    op.c_rkey = rkey
    op.c_imm = imm
    op.c_compare_add = op.c_swap = 0
    return op


def atomic_op(fut, int opcode, uint64_t raddr, uint32_t rkey, uint64_t compare_add,
              uint64_t swap=0):
    """An atomic op (``opcode``: ATOMIC_FETCH_AND_ADD or ATOMIC_CMP_AND_SWP, a
    ``WROpcode`` value) on the 8 bytes at ``raddr``/``rkey`` held as C fields, like
    ``rdma_op``; its 8-byte result lands in a send buffer the sender takes when it
    posts, and ``fut`` gets the old value. Raises OverflowError for a field out of its
    C range."""
    cdef Op op = Op.__new__(Op)
    op.kind = K_ATOMIC
    op.fut = fut
    op.msg_id = 0
    op.c_wr = True
    op.c_opcode = opcode
    op.c_laddr = 0  # (the result buffer: set when posted)
    op.c_length = 8
    op.c_lkey = 0
    op.c_raddr = raddr
    op.c_rkey = rkey
    op.c_imm = 0
    op.c_compare_add = compare_add
    op.c_swap = swap
    return op


cdef inline Op new_op(int kind, object fut, object payload):
    """An Op without the constructor's argument parsing (the data path's): as
    ``Op(kind, fut, payload)``: no slot, WR or ``keep`` yet, msg_id 0, not posted."""
    cdef Op op = Op.__new__(Op)
    op.kind = kind
    op.fut = fut
    op.payload = payload
    op.msg_id = 0
    return op


cdef inline Py_ssize_t op_payload_len(Op op) except -1:
    """The size in bytes of a queued DATA op's payload (held in the op, or ``payload``:
    as ``payload_len``)."""
    if op.c_inline:
        return op.c_small_len
    return payload_len(op.payload)


cdef inline Py_ssize_t op_payload_copy(Op op, unsigned char *dst, Py_ssize_t room) except -2:
    """Copy a queued DATA op's payload to ``dst`` (as ``payload_copy``); returns its
    size, or -1 (nothing copied) when it is over ``room`` bytes."""
    if op.c_inline:
        if op.c_small_len > room:
            return -1
        memcpy(dst, op.c_small, op.c_small_len)
        return op.c_small_len
    return payload_copy(op.payload, dst, room)


cdef object send_wr_of_op(Op op):
    """The ``SendWR`` of an ``rdma_op`` or ``atomic_op`` (the port path posts
    objects)."""
    return SendWR(0, WROpcode(op.c_opcode), [SGE(op.c_laddr, op.c_length, op.c_lkey)],
                  imm_data=op.c_imm, remote_addr=op.c_raddr, rkey=op.c_rkey,
                  compare_add=op.c_compare_add, swap=op.c_swap)


@cython.freelist(64)
cdef class Rx:
    """A received message waiting for the application (the receive queue's head).

    DATA: ``offset``/``length`` in the receive pool, ``slot`` the buffer to re-post
    once consumed (-1 for all but the last message of a BATCH). RNDV: the sender's
    ``addr``/``rkey``/``length`` and ``msg_id``; ``read`` the waiter of its READ once
    started, ``staging`` the buffer it lands in (None: the receiver's own),
    ``deferred`` not read ahead on arrival (the read-ahead budget was spent)."""

    def __init__(self, int kind, int slot=-1, Py_ssize_t offset=0, Py_ssize_t length=0, *,
                 addr=0, rkey=0, msg_id=0):
        self.kind = kind
        self.slot = slot
        self.offset = offset
        self.length = length
        self.addr = addr
        self.rkey = rkey
        self.msg_id = msg_id
        self.read = None
        self.staging = None
        self.done_sent = False
        self.deferred = False


cdef inline Rx new_rx(int kind, int slot, Py_ssize_t offset, Py_ssize_t length):
    """An Rx without the constructor's argument parsing (the data path's)."""
    cdef Rx rx = Rx.__new__(Rx)
    rx.kind = kind
    rx.slot = slot
    rx.offset = offset
    rx.length = length
    rx.addr = 0
    rx.rkey = 0
    rx.msg_id = 0
    return rx


def wake(list waiters):
    """Resolve every waiter of ``waiters`` (with None) and empty the list."""
    wake_c(waiters)


cdef inline void wake_c(list waiters) except *:
    for w in waiters:
        resolve_c(w, None)
    del waiters[:]


# The waiter class the engine's driver uses (``register_waiter_type``: the endpoint's
# asyncio.Future), its ``done`` and ``set_result`` taken unbound once: a waiter of
# exactly that class is resolved without a method lookup per call; any other (the
# sans-IO tests' recorders) by name.
cdef object WAITER_TYPE = None
cdef object WAITER_DONE = None
cdef object WAITER_SET_RESULT = None


def register_waiter_type(cls):
    """Resolve waiters of exactly class ``cls`` through its ``done`` and ``set_result``
    taken once (they must behave as ``Waiter``'s; a subclass's waiters, or ones whose
    instances override them, are not of exactly ``cls`` or must not be registered);
    None clears the registration. Returns the class registered before (None: none);
    raises AttributeError, changing nothing, when ``cls`` lacks them."""
    global WAITER_TYPE, WAITER_DONE, WAITER_SET_RESULT
    done = set_result = None
    if cls is not None:
        done, set_result = cls.done, cls.set_result
    old = WAITER_TYPE
    WAITER_TYPE, WAITER_DONE, WAITER_SET_RESULT = cls, done, set_result
    return old


def check_messages(list msgs, Py_ssize_t limit):
    """``(total bytes, -1)`` when every item of ``msgs`` is a C-contiguous bytes-like
    object of at most ``limit`` bytes; else ``(0, i)``, ``i`` the first item that is
    not (the caller raises its precise error). Allocates nothing per item."""
    cdef Py_ssize_t i, n, total = 0
    cdef Py_buffer view
    for i in range(len(msgs)):
        m = msgs[i]
        t = type(m)
        if t is bytes:
            n = PyBytes_GET_SIZE(m)
        elif t is bytearray:
            n = PyByteArray_GET_SIZE(m)
        else:
            try:
                PyObject_GetBuffer(m, &view, PyBUF_C_CONTIGUOUS)
            except (TypeError, BufferError, ValueError):
                return 0, i
            n = view.len
            PyBuffer_Release(&view)
        if n > limit:
            return 0, i
        total += n
    return total, -1


def new_waiter(cls, dict kwargs):
    """A new waiter ``cls(**kwargs)``, the caller's dict passed as it is: a call from
    Python would copy it, or build one for keyword arguments; the driver keeps one per
    event loop (``{"loop": loop}``), which must not change while a call runs. Returns
    the waiter; raises what ``cls`` raises (TypeError where it is not callable)."""
    return PyObject_Call(cls, (), kwargs)


cdef inline int resolve_c(object w, object result) except -1:
    """Set waiter ``w``'s result to ``result`` unless it is done (cancelled, say);
    returns 1 when it set it, else 0."""
    if type(w) is WAITER_TYPE:
        if WAITER_DONE(w):
            return 0
        WAITER_SET_RESULT(w, result)
        return 1
    if w.done():
        return 0
    w.set_result(result)
    return 1
