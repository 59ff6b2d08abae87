# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The compiled data path of the ``verbs`` provider (built from rdma-core's headers where
they were found, see ``aiordma.native``): work requests built in preallocated C arrays
of ``struct ibv_send_wr``/``ibv_recv_wr``, chained and posted with one
``ibv_post_send``/``ibv_post_recv``; completions polled with ``ibv_poll_cq`` into a C
array of ``struct ibv_wc``. Both run on the ``struct ibv_qp *``/``struct ibv_cq *`` of
objects that pyverbs created and keeps (creation, state changes, destruction); the
pointers are found and checked as the package docstring says ("The compiled data
path"). The verbs facts this relies on are in ``libibverbs.pxd``.

Python-level API, what ``IbvQP``/``IbvCQ`` call: ``QPPoster.post_send(wrs, ops)``,
``QPPoster.post_recv(wrs)`` (each ``(errno, number posted)``), ``CQPoller.poll(n)``
(``(count, RawWC tuples)``, as ``clib.CQPoller``), ``CQPoller.req_notify(solicited)``
(``ibv_req_notify_cq``: 0 or an errno value), ``ChannelEvents`` (a channel's events read
and acknowledged, as ``clib.ChannelReader``, and counted in each CQ's ``CQEvents``). The C-level API, for compiled callers
that post and poll without a Python object per message, is declared in fastpath.pxd.
The caller checks the work requests (``verbs/contract.py``) and accounts for the queues;
this module only refuses what would overrun its own arrays.

Here: ``QPPoster`` and ``abi()``; ``fastpath_completions.pxi``: ``CQPoller``,
``CQEvents`` and ``ChannelEvents``; ``fastpath_cops.pxi``: the C-level operations.
"""

from cpython.pycapsule cimport PyCapsule_New
from libc.errno cimport EAGAIN, EBADF, EINTR, EINVAL, EIO, ENOMEM, errno
from libc.stdint cimport uint32_t, uintptr_t
from libc.stdlib cimport calloc, free, realloc
from libc.string cimport memcpy, memset

import errno as _errno
import os

from aiordma.errors import CQOverrunError, PostError, RDMAError
from aiordma.verbs.enums import WC_OPCODE_FOR_WR, QPState

from aiordma.verbs.cverbs cimport (
    CCQ_OPS,
    CQP_OPS,
    c_cq_ops_t,
    c_qp_ops_t,
    c_recv_wr_t,
    c_send_wr_t,
    c_wc_t,
)
from aiordma.verbs.ibverbs.queues cimport WorkQueues

from aiordma.verbs.ibverbs.libibverbs cimport (
    IBV_QP_AV,
    IBV_QP_DEST_QPN,
    IBV_QP_MAX_DEST_RD_ATOMIC,
    IBV_QP_MIN_RNR_TIMER,
    IBV_QP_PATH_MTU,
    IBV_QP_RQ_PSN,
    IBV_QP_STATE,
    IBV_QPS_RTR,
    IBV_SEND_SIGNALED,
    IBV_WC_WITH_IMM,
    IBV_WR_ATOMIC_CMP_AND_SWP,
    IBV_WR_ATOMIC_FETCH_AND_ADD,
    IBV_WR_RDMA_READ,
    IBV_WR_RDMA_WRITE,
    IBV_WR_RDMA_WRITE_WITH_IMM,
    IBV_WR_SEND_WITH_IMM,
    ibv_ack_cq_events_fn,
    ibv_context,
    ibv_cq,
    ibv_get_cq_event_fn,
    ibv_modify_qp_fn,
    ibv_poll_cq,
    ibv_post_recv,
    ibv_post_send,
    ibv_qp,
    ibv_qp_attr,
    ibv_recv_wr,
    ibv_req_notify_cq,
    ibv_send_wr,
    ibv_sge,
    ibv_wc,
)


cdef extern from "<arpa/inet.h>" nogil:
    uint32_t htonl(uint32_t)
    uint32_t ntohl(uint32_t)


cdef extern from "<errno.h>" nogil:
    int EWOULDBLOCK  # (libc.errno has no EWOULDBLOCK; EAGAIN on Linux)


_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
# first allocation of a WR array (it grows by doubling, up to the queue's depth)
cdef enum:
    _FIRST_CAP = 16
    # every receive opcode of ibv_wc_opcode has this bit, no send opcode has it
    _WC_RECV_BIT = 0x80


cdef inline int _grow(int cap, int n, int limit) noexcept nogil:
    if cap == 0:
        cap = _FIRST_CAP
    while cap < n:
        cap *= 2
    return limit if cap > limit else cap


ctypedef fused _wr_t:
    ibv_send_wr
    ibv_recv_wr


cdef int _grow_wrs(_wr_t **wrs, ibv_sge **sges, int *cap, int n, int limit,
                   int stride) except -1:
    """Grow the WR array ``*wrs`` (``*cap`` of them) to hold ``n``, doubling up to
    ``limit``, and its SGE array ``*sges`` (``stride`` per WR) with it; every WR's
    ``sg_list`` points to its slots again, new WRs are zeroed. Raises MemoryError (the
    arrays then stay valid, with their old capacity)."""
    cdef int new_cap, i
    cdef void *p
    if n <= cap[0]:
        return 0
    new_cap = _grow(cap[0], n, limit)
    p = realloc(wrs[0], new_cap * sizeof(_wr_t))
    if p == NULL:
        raise MemoryError()
    wrs[0] = <_wr_t *>p
    p = realloc(sges[0], new_cap * stride * sizeof(ibv_sge))
    if p == NULL:
        raise MemoryError()  # (the WR array grew, its sg_lists still point to *sges)
    sges[0] = <ibv_sge *>p
    memset(&wrs[0][cap[0]], 0, (new_cap - cap[0]) * sizeof(_wr_t))
    for i in range(new_cap):
        wrs[0][i].sg_list = &sges[0][i * stride]
    cap[0] = new_cap
    return 0


cdef class QPPoster:
    """Posts work requests to one QP (``struct ibv_qp *`` as an int) from this object's
    arrays. ``max_send``/``max_recv``: the QP's queue depths (the longest chain);
    ``send_sge``/``recv_sge``: its max SGEs per WR. The caller keeps the QP alive and
    calls ``close()`` before destroying it (``IbvQP`` does): a closed poster posts
    nothing (EBADF). It holds no Python object, so it never joins a reference cycle
    (the order in which pyverbs objects die in the cyclic GC decides whether their
    destruction fails). One thread posts at a time."""

    def __cinit__(self, uintptr_t qp_ptr, int max_send, int max_recv, int send_sge,
                  int recv_sge):
        if qp_ptr == 0:
            raise ValueError("NULL struct ibv_qp *")
        if max_send < 0 or max_recv < 0 or send_sge < 0 or recv_sge < 0:
            raise ValueError("negative queue size")
        self.qp = <ibv_qp *>qp_ptr
        self.max_send = max_send
        self.max_recv = max_recv
        self.send_stride = send_sge if send_sge > 0 else 1
        self.recv_stride = recv_sge if recv_sge > 0 else 1

    def __dealloc__(self):
        free(self.send_wrs)
        free(self.send_sges)
        free(self.recv_wrs)
        free(self.recv_sges)

    def close(self):
        """Post nothing from now on (call it before the QP is destroyed)."""
        self.qp = NULL

    def attach(self, WorkQueues queues not None, owner):
        """For the C-level posts (``qp_ops``): the QP's queue accounting, and a weak
        reference to its ``IbvQP`` (a QP in ERR is flushed through it after a post)."""
        self.queues = queues
        self.owner = owner

    def set_state(self, int state):
        """The QP's state (ibv_qp_state), which the C-level posts check."""
        self.state = state

    @property
    def closed(self):
        return self.qp == NULL

    @property
    def qp_ptr(self):
        return <uintptr_t>self.qp

    def modify_rtr(self, uintptr_t modify_qp, int path_mtu, uint32_t dest_qp_num,
                   uint32_t rq_psn, int max_dest_rd_atomic, int min_rnr_timer,
                   const unsigned char[:] dgid, int is_global, int dlid, int sl,
                   int sgid_index, int hop_limit, int port_num):
        """``ibv_modify_qp`` INIT -> RTR with these attributes (their verbs meaning; the
        caller checked and clamped them), through ``modify_qp``: the address of
        libibverbs' ``ibv_modify_qp``. The GIL is released for the call: on RoCE the
        kernel resolves ``dgid``'s address to a MAC address there, waiting up to seconds
        for an answer, and other threads (an event loop) run meanwhile. Returns 0 or the
        errno value ibv_modify_qp returned; EBADF once closed. Raises ValueError for a
        ``dgid`` that is not 16 bytes or a NULL ``modify_qp``. The caller keeps the QP
        alive (and this poster open) until the call returns."""
        cdef ibv_qp_attr attr
        cdef ibv_modify_qp_fn fn = <ibv_modify_qp_fn>modify_qp
        cdef ibv_qp *qp = self.qp
        cdef int rc
        if modify_qp == 0:
            raise ValueError("NULL ibv_modify_qp")
        if dgid.shape[0] != 16:
            raise ValueError(f"a GID is 16 bytes, not {dgid.shape[0]}")
        if qp == NULL:
            return EBADF
        memset(&attr, 0, sizeof(attr))
        attr.qp_state = IBV_QPS_RTR
        attr.path_mtu = path_mtu
        attr.dest_qp_num = dest_qp_num
        attr.rq_psn = rq_psn
        attr.max_dest_rd_atomic = <unsigned char>max_dest_rd_atomic
        attr.min_rnr_timer = <unsigned char>min_rnr_timer
        memcpy(attr.ah_attr.grh.dgid.raw, &dgid[0], 16)
        attr.ah_attr.grh.sgid_index = <unsigned char>sgid_index
        attr.ah_attr.grh.hop_limit = <unsigned char>hop_limit
        attr.ah_attr.is_global = <unsigned char>is_global
        attr.ah_attr.dlid = <unsigned short>dlid
        attr.ah_attr.sl = <unsigned char>sl
        attr.ah_attr.port_num = <unsigned char>port_num
        with nogil:
            rc = fn(qp, &attr, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN
                    | IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER)
        return rc

    # --- C level ---------------------------------------------------------------------
    cdef ibv_send_wr *send_array(self, int n) except NULL:
        """At least ``n`` send WRs, each with ``send_stride`` SGE slots at ``sg_list``
        (kept across calls: only the fields of the opcode posted need setting). Raises
        ValueError beyond ``max_send``, MemoryError. Earlier arrays may have moved."""
        if n > self.max_send or n < 1:
            raise ValueError(f"a chain of {n} send WRs (queue depth {self.max_send})")
        _grow_wrs(&self.send_wrs, &self.send_sges, &self.send_cap, n, self.max_send,
                  self.send_stride)
        return self.send_wrs

    cdef ibv_recv_wr *recv_array(self, int n) except NULL:
        """``send_array`` for receives (``recv_stride`` SGE slots per WR)."""
        if n > self.max_recv or n < 1:
            raise ValueError(f"a chain of {n} receive WRs (queue depth {self.max_recv})")
        _grow_wrs(&self.recv_wrs, &self.recv_sges, &self.recv_cap, n, self.max_recv,
                  self.recv_stride)
        return self.recv_wrs

    cdef int post_send_array(self, int n, int *posted) noexcept nogil:
        """Chain the first ``n`` WRs of the send array and post them with one
        ``ibv_post_send``. Returns 0 or the errno (EBADF once closed); ``*posted`` is
        how many were posted (on failure, those before ``bad_wr``)."""
        cdef ibv_send_wr *wrs = self.send_wrs
        cdef ibv_send_wr *bad = NULL
        cdef int i, rc
        posted[0] = 0
        if self.qp == NULL:
            return EBADF
        if n <= 0:
            return 0
        if n > self.send_cap:
            return EINVAL
        for i in range(n - 1):
            wrs[i].next = &wrs[i + 1]
        wrs[n - 1].next = NULL
        rc = ibv_post_send(self.qp, wrs, &bad)
        if rc == 0:
            posted[0] = n
            return 0
        if bad != NULL and bad >= wrs and bad < wrs + n:
            posted[0] = <int>(bad - wrs)
        return -rc if rc < 0 else rc

    cdef int post_recv_array(self, int n, int *posted) noexcept nogil:
        """``post_send_array`` for the receive array (``ibv_post_recv``)."""
        cdef ibv_recv_wr *wrs = self.recv_wrs
        cdef ibv_recv_wr *bad = NULL
        cdef int i, rc
        posted[0] = 0
        if self.qp == NULL:
            return EBADF
        if n <= 0:
            return 0
        if n > self.recv_cap:
            return EINVAL
        for i in range(n - 1):
            wrs[i].next = &wrs[i + 1]
        wrs[n - 1].next = NULL
        rc = ibv_post_recv(self.qp, wrs, &bad)
        if rc == 0:
            posted[0] = n
            return 0
        if bad != NULL and bad >= wrs and bad < wrs + n:
            posted[0] = <int>(bad - wrs)
        return -rc if rc < 0 else rc

    # --- Python level ----------------------------------------------------------------
    def post_send(self, list wrs, list ops):
        """Post ``wrs`` (``verbs.wr.SendWR``, already checked) as one chain, ``ops[i]``
        being the opcode of ``wrs[i]``: ``(errno or 0, number posted)``. Each WR gets
        wr_id, opcode, flags, SGEs and what its opcode reads: immediate data (put in
        network byte order, as ``compat.imm_to_wire``), the RDMA or the atomic part.
        OverflowError for a field out of range, before anything is posted."""
        cdef Py_ssize_t n = len(wrs)
        cdef Py_ssize_t i, j, k
        cdef ibv_send_wr *arr
        cdef ibv_send_wr *w
        cdef ibv_sge *s
        cdef int op, rc
        cdef int posted = 0
        if n == 0:
            return 0, 0
        if len(ops) != n:
            raise ValueError("one opcode per WR")
        arr = self.send_array(<int>n)
        for i in range(n):
            wr = wrs[i]
            op = ops[i]
            w = &arr[i]
            sg = wr.sg_list
            k = len(sg)
            if k > self.send_stride:
                raise ValueError(f"{k} SGEs in a WR; the QP takes {self.send_stride}")
            s = w.sg_list
            for j in range(k):
                e = sg[j]
                s[j].addr = e.addr
                s[j].length = e.length
                s[j].lkey = e.lkey
            w.num_sge = <int>k
            w.wr_id = wr.wr_id & _M64
            w.opcode = op
            w.send_flags = wr.send_flags
            if op == IBV_WR_SEND_WITH_IMM or op == IBV_WR_RDMA_WRITE_WITH_IMM:
                w.imm_data = htonl(<uint32_t>(wr.imm_data & _M32))
            if op == IBV_WR_RDMA_WRITE or op == IBV_WR_RDMA_WRITE_WITH_IMM \
                    or op == IBV_WR_RDMA_READ:
                w.wr.rdma.remote_addr = wr.remote_addr & _M64
                w.wr.rdma.rkey = wr.rkey & _M32
            elif op == IBV_WR_ATOMIC_CMP_AND_SWP or op == IBV_WR_ATOMIC_FETCH_AND_ADD:
                w.wr.atomic.remote_addr = wr.remote_addr & _M64
                w.wr.atomic.compare_add = wr.compare_add & _M64
                w.wr.atomic.swap = wr.swap & _M64
                w.wr.atomic.rkey = wr.rkey & _M32
        rc = self.post_send_array(<int>n, &posted)
        return rc, posted

    def post_recv(self, list wrs):
        """Post ``wrs`` (``verbs.wr.RecvWR``, already checked) as one chain:
        ``(errno or 0, number posted)``; OverflowError as ``post_send``."""
        cdef Py_ssize_t n = len(wrs)
        cdef Py_ssize_t i, j, k
        cdef ibv_recv_wr *arr
        cdef ibv_sge *s
        cdef int rc
        cdef int posted = 0
        if n == 0:
            return 0, 0
        arr = self.recv_array(<int>n)
        for i in range(n):
            wr = wrs[i]
            sg = wr.sg_list
            k = len(sg)
            if k > self.recv_stride:
                raise ValueError(f"{k} SGEs in a WR; the QP takes {self.recv_stride}")
            s = arr[i].sg_list
            for j in range(k):
                e = sg[j]
                s[j].addr = e.addr
                s[j].length = e.length
                s[j].lkey = e.lkey
            arr[i].num_sge = <int>k
            arr[i].wr_id = wr.wr_id & _M64
        rc = self.post_recv_array(<int>n, &posted)
        return rc, posted

    def post_send_again(self, int n):
        """Post the first ``n`` send WRs as the last ``post_send`` left them (what a
        compiled caller's ``post_send_array`` costs, for benchmarks): ``(errno,
        posted)``."""
        cdef int posted = 0
        cdef int rc = self.post_send_array(n, &posted)
        return rc, posted

    def post_recv_again(self, int n):
        """``post_send_again`` for receives."""
        cdef int posted = 0
        cdef int rc = self.post_recv_array(n, &posted)
        return rc, posted

    def __repr__(self):
        return (f"<QPPoster qp={<uintptr_t>self.qp:#x} send {self.send_cap}/"
                f"{self.max_send} recv {self.recv_cap}/{self.max_recv}>")


include "fastpath_completions.pxi"


def abi():
    """Sizes and offsets of the structs this module was compiled against (verbs.h):
    ``{"struct.member": offset, "sizeof struct": size}``, for the ctypes code and the
    tests that fake these structs."""
    cdef ibv_context c
    cdef ibv_qp q
    cdef ibv_cq cq
    cdef ibv_send_wr w
    cdef ibv_recv_wr r
    cdef ibv_qp_attr a
    cdef char *b
    out = {}
    b = <char *>&c
    out["ibv_context.ops.poll_cq"] = <char *>&c.ops.poll_cq - b
    out["ibv_context.ops.req_notify_cq"] = <char *>&c.ops.req_notify_cq - b
    out["ibv_context.ops.post_send"] = <char *>&c.ops.post_send - b
    out["ibv_context.ops.post_recv"] = <char *>&c.ops.post_recv - b
    out["ibv_context.cmd_fd"] = <char *>&c.cmd_fd - b
    out["ibv_context.async_fd"] = <char *>&c.async_fd - b
    b = <char *>&q
    out["ibv_qp.context"] = <char *>&q.context - b
    out["ibv_qp.send_cq"] = <char *>&q.send_cq - b
    out["ibv_qp.recv_cq"] = <char *>&q.recv_cq - b
    out["ibv_qp.qp_num"] = <char *>&q.qp_num - b
    b = <char *>&cq
    out["ibv_cq.context"] = <char *>&cq.context - b
    out["ibv_cq.cq_context"] = <char *>&cq.cq_context - b
    b = <char *>&w
    out["ibv_send_wr.wr_id"] = <char *>&w.wr_id - b
    out["ibv_send_wr.next"] = <char *>&w.next - b
    out["ibv_send_wr.sg_list"] = <char *>&w.sg_list - b
    out["ibv_send_wr.num_sge"] = <char *>&w.num_sge - b
    out["ibv_send_wr.opcode"] = <char *>&w.opcode - b
    out["ibv_send_wr.send_flags"] = <char *>&w.send_flags - b
    out["ibv_send_wr.imm_data"] = <char *>&w.imm_data - b
    out["ibv_send_wr.wr.rdma.remote_addr"] = <char *>&w.wr.rdma.remote_addr - b
    out["ibv_send_wr.wr.rdma.rkey"] = <char *>&w.wr.rdma.rkey - b
    out["ibv_send_wr.wr.atomic.remote_addr"] = <char *>&w.wr.atomic.remote_addr - b
    out["ibv_send_wr.wr.atomic.compare_add"] = <char *>&w.wr.atomic.compare_add - b
    out["ibv_send_wr.wr.atomic.swap"] = <char *>&w.wr.atomic.swap - b
    out["ibv_send_wr.wr.atomic.rkey"] = <char *>&w.wr.atomic.rkey - b
    b = <char *>&r
    out["ibv_recv_wr.wr_id"] = <char *>&r.wr_id - b
    out["ibv_recv_wr.next"] = <char *>&r.next - b
    out["ibv_recv_wr.sg_list"] = <char *>&r.sg_list - b
    out["ibv_recv_wr.num_sge"] = <char *>&r.num_sge - b
    b = <char *>&a
    out["ibv_qp_attr.qp_state"] = <char *>&a.qp_state - b
    out["ibv_qp_attr.path_mtu"] = <char *>&a.path_mtu - b
    out["ibv_qp_attr.rq_psn"] = <char *>&a.rq_psn - b
    out["ibv_qp_attr.dest_qp_num"] = <char *>&a.dest_qp_num - b
    out["ibv_qp_attr.ah_attr.grh.dgid"] = <char *>&a.ah_attr.grh.dgid - b
    out["ibv_qp_attr.ah_attr.grh.sgid_index"] = <char *>&a.ah_attr.grh.sgid_index - b
    out["ibv_qp_attr.ah_attr.grh.hop_limit"] = <char *>&a.ah_attr.grh.hop_limit - b
    out["ibv_qp_attr.ah_attr.dlid"] = <char *>&a.ah_attr.dlid - b
    out["ibv_qp_attr.ah_attr.sl"] = <char *>&a.ah_attr.sl - b
    out["ibv_qp_attr.ah_attr.is_global"] = <char *>&a.ah_attr.is_global - b
    out["ibv_qp_attr.ah_attr.port_num"] = <char *>&a.ah_attr.port_num - b
    out["ibv_qp_attr.max_dest_rd_atomic"] = <char *>&a.max_dest_rd_atomic - b
    out["ibv_qp_attr.min_rnr_timer"] = <char *>&a.min_rnr_timer - b
    out["sizeof ibv_qp_attr"] = sizeof(ibv_qp_attr)
    out["sizeof ibv_send_wr"] = sizeof(ibv_send_wr)
    out["sizeof ibv_recv_wr"] = sizeof(ibv_recv_wr)
    out["sizeof ibv_sge"] = sizeof(ibv_sge)
    out["sizeof ibv_wc"] = sizeof(ibv_wc)
    return out


include "fastpath_cops.pxi"
