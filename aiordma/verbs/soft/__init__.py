"""The ``soft`` provider: a software RDMA device with RC verbs semantics over TCP (an
abstract Unix socket between devices on one host; ``AIORDMA_SOFT_UNIX=0`` keeps TCP).

Modules (one reason to change each):

* ``wire``      -- the wire protocol (hello, message header, opcodes, PSN arithmetic)
* ``addr``      -- configuration (AIORDMA_SOFT_ADDR/PORT/UNIX), GID table, peer addresses
* ``limits``    -- device attributes reported by query_device
* ``engine``    -- the per-process device: listeners, NIC thread (watchdog), timers, tables
* ``admission`` -- who may connect: peer credentials, pending HELLOs (cap, timeout), MACs
* ``dial``      -- outgoing connections (made in the caller's thread, adopted by the NIC)
* ``conn``      -- one connection: output queue, zero-copy input parser, its driver
* ``sink``      -- where a payload goes (slices of registered memory, or nowhere)
* ``cma``       -- same-host cross-memory attach (process_vm_readv/writev) for READ/WRITE
* ``notify``    -- pipe-backed readable flag (channel fds, async fd)
* ``cq``        -- CQ and completion channel (manual progress: the loop moves the bytes)
* ``keys``      -- memory keys (a secret permutation per PD), random QP numbers
* ``mr``        -- PD, MR and the lkey/rkey table
* ``qpcore``    -- QP state shared by both halves: WQEs, completions, error flush
* ``requester`` -- transmit, responses, RNR go-back-N, the local ACK timer and retries
* ``responder`` -- request execution (SEND/WRITE/READ/atomics), NAKs, coalesced ACKs
* ``qp``        -- the public QP: modify state machine, post_send/post_recv, close
* ``context``   -- the device context (queries, factories, async events)
* ``provider``  -- ``PROVIDER``: list_devices/open
"""

from __future__ import annotations

from .provider import SoftProvider

PROVIDER = SoftProvider()

__all__ = ["PROVIDER", "SoftProvider"]
