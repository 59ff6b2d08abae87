# The engine's C path (included by engine.pyx): where the QP offers C-level operations
# (``verbs/cverbs.pxd``: ``MessageEngine.use_qp``), the engine posts its frames and
# receive buffers as C work requests, with wr_ids of its own, and takes its completions
# as C structs from ``poll_dispatch`` -- no ``SendWR``/``WC`` object and no call through
# Python per message. Elsewhere (the sans-IO tests, a provider without them) it posts
# through its port's Python methods, with the port's wr_ids, as before.
#
# The engine's wr_ids: ``WR_ENGINE`` set (never one of a reactor's counter), then
# ``WR_RECV`` and the slot for a receive buffer, else an increasing number per QP (the
# send queue's order). A completion names its QP (``qp_num``: valid for every status),
# which names the engine.

cdef uint64_t WR_ENGINE_C = (<uint64_t>1) << 63
cdef uint64_t WR_RECV_C = (<uint64_t>1) << 62
WR_ENGINE = 1 << 63
"""Set in every wr_id the engine makes itself (its C path)."""


cdef inline uint64_t u64_of(object v) except? 0xFFFFFFFFFFFFFFFF:
    """``v mod 2**64`` of a Python int: a C conversion, Python arithmetic only for a
    value outside 0..2**64-1."""
    try:
        return <uint64_t>v
    except OverflowError:
        return <uint64_t>(v & 0xFFFFFFFFFFFFFFFF)


cdef int c_send_wr_of(wr, c_send_wr_t *w) except? -1:
    """``w`` = the provider-neutral ``SendWR`` ``wr`` (one SGE at most: the engine's
    one-sided work); returns its send flags."""
    sg = wr.sg_list
    if len(sg) > 1:
        raise LocalProtocolError("the C path posts work requests of one SGE")
    w.opcode = <int>wr.opcode  # (an IntEnum: its int value)
    if sg:
        s = sg[0]
        w.addr = u64_of(s.addr)
        w.length = <uint32_t>u64_of(s.length)
        w.lkey = <uint32_t>u64_of(s.lkey)
    else:
        w.addr = 0
        w.length = 0
        w.lkey = 0
    w.imm_data = <uint32_t>u64_of(wr.imm_data)
    w.rkey = <uint32_t>u64_of(wr.rkey)
    w.remote_addr = u64_of(wr.remote_addr)
    w.compare_add = u64_of(wr.compare_add)
    w.swap = u64_of(wr.swap)
    return <int>wr.send_flags


_STATUSES = tuple(WCStatus(i) for i in range(len(WCStatus)))
_OPCODES = tuple(WCOpcode(i) if i in WCOpcode._value2member_map_ else i for i in range(256))


cdef object make_wc(const c_wc_t *wc):
    """The ``WC`` of a C completion (the slow paths: a failure, a wr_id not the engine's)."""
    status = _STATUSES[wc.status] if 0 <= wc.status < len(_STATUSES) else wc.status
    return WC(wc.wr_id, status, _OPCODES[wc.opcode & 0xFF], wc.byte_len, wc.vendor_err,
              wc.imm_data, wc.qp_num, wc.src_qp, wc.wc_flags)


cdef class EngineTable:
    """The engines of a reactor's QPs, by qp_num: where ``poll_dispatch`` (and the
    reactor's Python dispatch, through ``get``) sends the completions of the wr_ids an
    engine made. The entry found last is kept, so a run of completions of one
    connection looks nothing up; ``attach`` and ``detach`` drop it (a handler may
    detach an engine in the middle of a batch: its later completions are then no
    engine's)."""

    def __cinit__(self):
        self.engines = {}
        self.last = None

    def attach(self, qp_num, MessageEngine engine not None):
        """Completions of QP ``qp_num`` with an engine's wr_id go to ``engine``."""
        self.engines[qp_num] = engine
        self.last = None

    def detach(self, qp_num):
        """Forget QP ``qp_num``'s engine (nothing happens if it has none)."""
        self.engines.pop(qp_num, None)
        self.last = None

    def get(self, qp_num):
        """QP ``qp_num``'s engine, or None."""
        return self.engines.get(qp_num)

    def __len__(self):
        return len(self.engines)

    cdef MessageEngine find(self, uint32_t qp_num):
        if self.last is not None and self.last_qp == qp_num:
            return self.last
        found = self.engines.get(qp_num)
        if found is None:
            return None
        self.last = <MessageEngine>found
        self.last_qp = qp_num
        return self.last


def poll_dispatch(cq, ops, EngineTable engines not None, int budget, other, report):
    """Poll up to ``budget`` completions through a CQ's C-level operations (``ops``
    and ``cq``: the capsule and the target of its ``c_ops()``) and dispatch each, in
    order: one of an engine's wr_ids to the engine of its QP (``engines``), any other
    as a ``WC`` to ``other(wc)``. An exception a handler raises goes to
    ``report(exc)`` and the dispatch goes on. Returns how many were polled; raises
    what the poll raises (CQOverrunError)."""
    cdef c_cq_ops_t *o = <c_cq_ops_t *>PyCapsule_GetPointer(ops, CCQ_OPS)
    cdef c_wc_t wcs[32]
    cdef int n, i
    cdef c_wc_t *wc
    cdef MessageEngine eng
    n = o.poll(cq, wcs, budget if budget < 32 else 32)
    for i in range(n):
        wc = &wcs[i]
        try:
            if wc.wr_id & WR_ENGINE_C:
                eng = engines.find(wc.qp_num)  # (per completion: a handler may detach one)
                if eng is None:
                    other(make_wc(wc))
                    continue
                if wc.wr_id & WR_RECV_C:
                    eng.rx.on_wc_c(wc, <int>(wc.wr_id & <uint64_t>0xFFFFFFFF))
                else:
                    sent_wc_c(eng.tx, wc)
            else:
                other(make_wc(wc))
        except Exception as exc:  # a bug in a handler must not stop the dispatch
            report(exc)
    return n
