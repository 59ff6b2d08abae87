# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The soft device's data path, compiled: C work on C data per packet.

One extension module (its parts are the ``core_*.pxi`` files it includes, one reason to
change each; ``_core.pxd`` declares their C-level interface):

* ``core_lock``      -- ``DeviceLock`` (the device lock) and ``PipeFlag`` (a pipe as a level flag)
* ``core_wire``      -- the 48-byte message header as a C struct, encoded and decoded in place
* ``core_mr``        -- ``SoftMR`` and the device's ``KeyTable`` (lkey/rkey -> MR)
* ``core_cq``        -- ``SoftCQ`` (a C ring of completions) and ``SoftCompChannel``
                        (manual progress: the loop moves the bytes)
* ``core_sink``      -- where a payload goes: the connection's sink, C segments of MRs
* ``core_conn``      -- ``Conn``: one connection's socket, output (writev) and life
* ``core_input``     -- a connection's input: staging buffers and the read loop (parser)
* ``core_qpcore``    -- the QP's queues as C rings, completions, local memory, errors
* ``core_requester`` -- transmit, responses, RNR go-back-N, the local ACK timer
* ``core_responder`` -- request execution (SEND/WRITE/READ/atomics), NAKs, coalesced ACKs
* ``core_qp``        -- the public QP: modify, post_send/post_recv, close
* ``core_post``      -- a post's checks, send WQEs from work requests, the C entry points

The control path (the NIC thread, admission, outgoing connections, CMA copies, the
context) stays in Python (``engine``, ``admission``, ``dial``, ``cma``, ``context``) and
calls the Python-level methods here. Work requests and completions cross this module's
Python API as ``aiordma.verbs.wr`` objects (``post_send``, ``post_recv``, ``poll``);
compiled callers use the C-level API of ``_core.pxd`` instead.
"""

from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.pycapsule cimport PyCapsule_New
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.pythread cimport PyThread_get_thread_ident
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memmove, memset

from aiordma.verbs.cverbs cimport (
    CCQ_OPS,
    CQP_OPS,
    c_cq_ops_t,
    c_qp_ops_t,
    c_recv_wr_t,
    c_send_wr_t,
    c_wc_t,
)

import collections
import errno as _errno
import os
import socket
import time

from ...errors import CQOverrunError, PostError, RDMAError, RegistrationError
from .. import api
from ..contract import check_cq_close, check_mr_access, check_recv_wrs, check_send_wr
from ..enums import (
    WC_OPCODE_FOR_WR,
    Access,
    EventType,
    QPState,
    SendFlags,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from ..wr import WC
from . import cma, dial, limits, wire


cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t writev(int fd, const iovec *iov, int iovcnt)


cdef extern from "<sys/socket.h>" nogil:
    ssize_t recv(int fd, void *buf, size_t n, int flags)
    int MSG_DONTWAIT


cdef extern from "<unistd.h>" nogil:
    ssize_t read(int fd, void *buf, size_t n)
    ssize_t write(int fd, const void *buf, size_t n)
    int close(int fd)
    int pipe2(int *fds, int flags)


cdef extern from "<fcntl.h>" nogil:
    int O_NONBLOCK
    int O_CLOEXEC


cdef extern from "<time.h>" nogil:
    struct timespec:
        long tv_sec
        long tv_nsec
    int clock_gettime(int clk, timespec *ts)
    int CLOCK_MONOTONIC


cdef extern from "<sys/epoll.h>" nogil:
    union epoll_data_t:
        int fd
        uint64_t u64
    struct epoll_event:
        uint32_t events
        epoll_data_t data
    int epoll_create1(int flags)
    int epoll_ctl(int epfd, int op, int fd, epoll_event *event)
    int epoll_wait(int epfd, epoll_event *events, int maxevents, int timeout)
    int EPOLL_CLOEXEC
    int EPOLL_CTL_ADD
    int EPOLL_CTL_MOD
    int EPOLL_CTL_DEL
    uint32_t EPOLLIN
    uint32_t EPOLLOUT
    uint32_t EPOLLERR
    uint32_t EPOLLHUP


cdef inline double monotonic() noexcept nogil:
    """``time.monotonic()`` (the same clock: the engine's timers compare the two)."""
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


# Enum members the data path hands out, indexed by their value: a C array index instead
# of an enum construction per completion.
_STATUS = tuple(WCStatus(i) for i in range(len(WCStatus)))
_OPCODE = tuple(WCOpcode(i) if i in WCOpcode._value2member_map_ else i for i in range(256))
_QP_STATE = tuple(QPState(i) for i in range(len(QPState)))
_WITH_IMM = WCFlags.WITH_IMM

# ibv_wc_status / ibv_wc_opcode / ibv_qp_state values (verbs enums)
cdef enum:
    WC_SUCCESS = 0
    WC_LOC_LEN_ERR = 1
    WC_LOC_PROT_ERR = 4
    WC_WR_FLUSH_ERR = 5
    WC_BAD_RESP_ERR = 7
    WC_REM_INV_REQ_ERR = 9
    WC_REM_ACCESS_ERR = 10
    WC_REM_OP_ERR = 11
    WC_RETRY_EXC_ERR = 12
    WC_RNR_RETRY_EXC_ERR = 13
    WCOP_SEND = 0
    WCOP_RDMA_READ = 2
    WCOP_RECV = 128
    WCOP_RECV_RDMA_WITH_IMM = 129
    QPS_RESET = 0
    QPS_INIT = 1
    QPS_RTR = 2
    QPS_RTS = 3
    QPS_ERR = 6
    ACC_LOCAL_WRITE = 1
    ACC_REMOTE_WRITE = 2
    ACC_REMOTE_READ = 4
    ACC_REMOTE_ATOMIC = 8
    SF_FENCE = 1
    SF_SIGNALED = 2
    SF_SOLICITED = 4
    SF_INLINE = 8


include "core_lock.pxi"
include "core_wire.pxi"
include "core_mr.pxi"
include "core_cq.pxi"
include "core_sink.pxi"
include "core_conn.pxi"
include "core_input.pxi"
include "core_qpcore.pxi"
include "core_requester.pxi"
include "core_responder.pxi"
include "core_qp.pxi"
include "core_post.pxi"
