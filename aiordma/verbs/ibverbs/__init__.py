"""The ``verbs`` provider: real RDMA devices through rdma-core's pyverbs (rdma-core 44..65+).

This package is the only code in aiordma that imports pyverbs, and it does so lazily:
importing it never fails; without pyverbs, ``PROVIDER.list_devices()``/``open()`` raise
``DeviceError`` with the install hint. Modules: one per verbs object, then what they share:

* ``provider`` -- ``IbverbsProvider``: the device list, opening a device;
* ``context``  -- ``IbvContext``: device queries, async events, the factories;
* ``pd``       -- ``IbvPD``: protection domain, factory of MRs and QPs;
* ``mr``       -- ``IbvMR``: registered memory;
* ``channel``  -- ``IbvCompChannel``: completion channel events;
* ``cq``       -- ``IbvCQ``: polling, completion accounting;
* ``qp``       -- ``IbvQP``: state changes and posts;
* ``pyverbs_wrs`` -- work requests as pyverbs objects, where the compiled path is not used;
* ``fastpath`` -- the compiled data path (Cython: ``fastpath.pyx`` posts,
  ``fastpath_completions.pxi`` polls and reads channel events, ``fastpath_cops.pxi``
  is the C-level interface declared in ``fastpath.pxd``; verbs.h's part in
  ``libibverbs.pxd``);
* ``queues``   -- ``WorkQueues``: a QP's outstanding work requests, counted as hardware
  counts them (Cython, ``queues.pyx``; no system header needed);
* ``loader``   -- pyverbs imported lazily, and what its version can do;
* ``compat``   -- pure-Python shims for what differs between versions or is missing
  (unit-tested without pyverbs in ``tests/test_ibverbs_compat.py``);
* ``probe``    -- the fds and C pointers pyverbs hides, found in the process;
* ``clib``     -- libibverbs' C API through ctypes: async and channel events, CQ polling.

Version differences handled
---------------------------
* Enums: ``pyverbs.enums`` (flat ``IBV_*`` names) up to rdma-core 49,
  ``pyverbs.libibverbs_enums`` (``cpdef enum`` classes) from 50 -> ``compat.EnumTable``.
* ``CompChannel.fd`` exists from rdma-core 57 (``71e7499``); ``Context.context`` returns
  the ``struct ibv_context *`` as an int only from 61 (before, it casts the C pointer to a
  Python object and must never be called); no version exposes the context's async fd.
* ``SendWR``/``RecvWR`` refuse zero SGEs before rdma-core ~50: a zero-length SGE is given
  and ``num_sge`` set to 0 afterwards. The 44 ``SGE``/``SendWR`` leak their C memory
  (``__dealloc`` typo): the provider calls ``close()`` on them after posting.
* ``MR(pd, length, access, address=addr)`` registers caller memory in every version
  (44 included): ``reg_mr`` passes the address of a ``PinnedBuffer``; the MR never frees it.

How the hidden file descriptors are found
-----------------------------------------
The completion channel's fd (``struct ibv_comp_channel {context*, int fd, int refcnt}``)
before rdma-core 57, and the context's ``async_fd`` (``struct ibv_context {device*,
ops (32 function pointers), int cmd_fd, int async_fd, int num_comp_vectors, ...}``, an ABI
that libibverbs keeps stable) in every version, are read from the C structs:

1. The ``struct ibv_context *``: from ``Context.context`` on rdma-core >= 61; otherwise the
   pyverbs ``Context`` object's own C struct (``id(obj)``, ``type(obj).__basicsize__``
   bytes, i.e. memory that belongs to the object) is scanned for pointer-sized words, and
   a word is accepted only if the struct it points to has ``cmd_fd`` equal to pyverbs'
   ``Context.cmd_fd``, an ``async_fd`` that is an open ``anon_inode:[infinibandevent]``
   file, and a sane ``num_comp_vectors``; exactly one word must qualify.
2. Candidate pointers are dereferenced only with ``pread`` on ``/proc/self/mem``, which
   returns EIO for an unmapped address instead of crashing, so a wrong guess is harmless.
3. The channel fd (pyverbs < 57) is found the same way in the ``CompChannel`` object: the
   word whose struct starts with our context pointer and holds an fd that is a verbs event
   file which appeared in ``/proc/self/fd`` while the channel was being created.
   If ``/proc/self/mem`` cannot be read, the fd that appeared in ``/proc/self/fd`` during
   ``ibv_create_comp_channel`` (resp. ``ibv_open_device``) is used when there is exactly
   one; otherwise opening fails with a clear ``DeviceError`` (nothing is guessed).

Both fds are set O_NONBLOCK (fcntl) at once. pyverbs never releases the GIL, so nothing
here may block. Events are read through libibverbs' C API with ctypes (``clib``):
``ibv_get_cq_event`` on the channel struct found above (any number of CQs may share a
channel; the ``cq_context`` of each CQ maps an event back to it) with
``ibv_ack_cq_events``, and ``ibv_get_async_event``/``ibv_ack_async_event``, which also
yield the element (QP number, CQ, port) that pyverbs' ``AsyncEvent`` drops. EAGAIN (via
``use_errno``) means "no event". Async events are acknowledged as soon as they are read;
a CQ refuses to close while channel events it got are unacknowledged. (The kernel counts
an event as reported only when it is read, so unread events never make a destroy wait.)
(Where the compiled data path below is built, the channel's events are read and
acknowledged by ``fastpath.ChannelEvents`` instead, which calls the same two functions
of the process's libibverbs through their addresses: a C call each, not a ctypes call.)
If the channel struct cannot be located, pyverbs' ``get_cq_event(expected_cq)`` is used
on the non-blocking fd, EAGAIN being ``PyverbsRDMAError.error_code``; that call needs the
CQ in advance, so such a channel serves a single CQ.

The compiled data path
----------------------
Per message, pyverbs costs Python objects: a ``SendWR``/``RecvWR`` (or a cached one
whose fields are set one property at a time) per post, a ``WC`` object per completion
(a logger look-up and a dozen property reads). Where the Cython extension ``fastpath``
is built (``aiordma.native.EXTENSIONS``; it needs rdma-core's headers at build time),
work requests are written into preallocated C arrays of ``struct ibv_send_wr``/
``ibv_recv_wr``, chained and posted with one ``ibv_post_send``/``ibv_post_recv``, and
``ibv_poll_cq`` writes completions into a C array of ``struct ibv_wc``; a CQ is armed
with ``ibv_req_notify_cq``. These four are
static inline functions of verbs.h that call ``qp->context->ops`` /
``cq->context->ops`` (the stable ABI), so the extension links nothing of libibverbs and
runs on the ``struct ibv_qp *``/``struct ibv_cq *`` of the objects pyverbs created;
pyverbs keeps the control path (devices, PD, MR, CQ/QP creation, state changes,
events). Its C-level interface (``fastpath.pxd``) posts from and polls into C arrays
with no Python object per message, for compiled callers.

The pointers are found the same way as the context's, in the pyverbs objects' own
memory: a CQ's is the word whose struct starts with our context pointer and holds the
CQ's ``cq_context`` (the token the CQ was created with); a QP's, the word whose struct
starts with our context pointer and holds the QP's number and the ``struct ibv_cq *``
of its two CQs. Exactly one word must qualify. Where the extension is not built, CQs
are polled by ``clib.CQPoller``, which calls ``ctx->ops.poll_cq`` through ctypes (GIL
held) into a buffer unpacked with ``struct``, and WRs are posted as pyverbs objects;
where a pointer is not found, pyverbs does it. ``AIORDMA_VERBS_POST=pyverbs`` and
``AIORDMA_VERBS_POLL=ctypes|pyverbs`` choose these paths; ``IbvQP.data_path`` and
``IbvCQ.data_path`` say which one an object uses (what each path costs:
docs/benchmarks.md).

Other choices
-------------
* Queue-full is refused by the provider's own accounting (``compat.WorkQueues``) before
  the device is called, as is every malformed WR the device would refuse (SGE count,
  inline length, atomic operand and alignment), so such a chain is never partly posted;
  a chain the device refuses at ``bad_wr`` leaves the WRs before it posted and
  accounted for.
* Immediate data: the integer the user passes is put on the wire in network byte order
  (``htonl``) and converted back on receipt (``ntohl``): both sides see the same value,
  as with the ``soft`` provider, and C peers using ``htonl``/``ntohl`` agree.
* GID for an IP address (RoCE): the IPv4-mapped GID of type "RoCE v2" (sysfs
  ``gid_attrs/types``); ``AIORDMA_GID_INDEX`` overrides; InfiniBand uses LID addressing.
"""

from __future__ import annotations

from .provider import IbverbsProvider

PROVIDER = IbverbsProvider()

__all__ = ["PROVIDER", "IbverbsProvider"]
