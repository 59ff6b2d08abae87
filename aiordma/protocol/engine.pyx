# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""The message engine, compiled: one connection's data path, sans-IO (no event loop, no
provider), with its per-message state in C.

One extension module; its parts are the ``engine_*.pxi`` files it includes, one reason
to change each (``engine.pxd`` declares their C-level interface, ``engine.pyi`` the
Python one):

* ``engine_state``    -- ``ConnectionState``: the connection state machine (``state.py``'s rules)
* ``engine_slots``    -- ``Slots``: fixed-size buffer slots of one region (a C free stack)
* ``engine_credits``  -- ``CreditState``: receive-credit flow control (its rules)
* ``engine_framing``  -- the 8-byte frame header of every SEND: writers and the parser
* ``engine_ops``      -- ``Op`` and ``Rx``: the records of operations and received messages
* ``engine_fifo``     -- ``Fifo``: the queues of ops and of received messages
* ``engine_sendq``    -- ``SendQueue``: send-queue accounting with selective signaling
* ``engine_sender``   -- ``Sender``: the send queues, what to post when, the posts
* ``engine_frames``   -- the frames a pump posts, built in the sender's send buffers
* ``engine_sent``     -- what a send completion finishes (the Sender's completions)
* ``engine_receiver`` -- ``Receiver``: receive buffers, frames, messages, rendezvous reads
* ``engine_core``     -- ``EnginePort`` (what the engine asks of its driver) and
  ``MessageEngine`` (state, credits, the single failure path)
* ``engine_cpath``    -- the C path: posting to a QP's C-level operations and taking a
  CQ's completions as C structs (``verbs/cverbs.pxd``), the engine's own wr_ids

Without a build of it (a C compiler: ``pip install .``, ``make core``) aiordma cannot
run: ``aiordma.native.build()`` says why it was not built.
"""

from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS, PyBUF_FULL_RO, PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_GET_SIZE
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize, PyBytes_GET_SIZE
from cpython.memoryview cimport PyMemoryView_FromObject
from cpython.object cimport PyObject_Call
from cpython.pycapsule cimport PyCapsule_GetPointer
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport int64_t, uint8_t, uint16_t, uint32_t, uint64_t
from libc.stdlib cimport calloc, free, malloc
from libc.string cimport memcpy, memset

from aiordma.verbs.cverbs cimport (
    CCQ_OPS,
    CQP_OPS,
    c_cq_ops_t,
    c_qp_ops_t,
    c_recv_wr_t,
    c_send_wr_t,
    c_wc_t,
)

import itertools
import struct
from enum import IntEnum
from typing import Protocol

from aiordma.errors import (
    CompletionError,
    ConnectionClosed,
    FlushedError,
    RDMAError,
    RetryExceededError,
    RNRRetryExceededError,
    completion_error,
)
from aiordma.verbs.enums import WCOpcode, WCStatus, WROpcode
from aiordma.verbs.wr import SGE, WC, SendWR

from .errors import LocalProtocolError, RemoteProtocolError
from . import state as _state_rules
from .state import Event, Local, Remote, State

# The enum members the data path compares with, looked up once: a member's lookup on
# its class goes through the enum's metaclass (``EnumType.__getattr__`` on Python
# 3.11), some 800 instructions each time.
cdef object REMOTE_GONE = Remote.GONE
cdef object LOCAL_CLOSE_SENT = Local.CLOSE_SENT
cdef object EV_RECV_DATA = Event.RECV_DATA
cdef object EV_RECV_CLOSE = Event.RECV_CLOSE

include "engine_state.pxi"
include "engine_slots.pxi"
include "engine_credits.pxi"
include "engine_framing.pxi"
include "engine_ops.pxi"
include "engine_fifo.pxi"
include "engine_sendq.pxi"
include "engine_core.pxi"
include "engine_sender.pxi"
include "engine_frames.pxi"
include "engine_sent.pxi"
include "engine_receiver.pxi"
include "engine_cpath.pxi"
