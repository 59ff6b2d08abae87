"""The ``soft`` provider: a software RDMA device with RC verbs semantics over TCP.

Modules (one reason to change each):

* ``wire``      -- the wire protocol (hello, message header, opcodes, PSN arithmetic)
* ``addr``      -- configuration (AIORDMA_SOFT_ADDR/PORT), GID table, peer addresses
* ``limits``    -- device attributes reported by query_device
* ``engine``    -- the per-process device: listener, NIC thread, timers, QP/key tables
* ``conn``      -- one TCP connection: output queue, zero-copy input parser
* ``notify``    -- pipe-backed readable flag (channel fds, async fd)
* ``cq``        -- CQ and completion channel
* ``mr``        -- PD, MR and the lkey/rkey table
* ``qpcore``    -- QP state shared by both halves: WQEs, completions, error flush
* ``requester`` -- transmit, responses, RNR go-back-N, ACK timeout
* ``responder`` -- request execution (SEND/WRITE/READ/atomics), NAKs, coalesced ACKs
* ``qp``        -- the public QP: modify state machine, post_send/post_recv, close
* ``context``   -- the device context (queries, factories, async events)
* ``provider``  -- ``PROVIDER``: list_devices/open
"""

from __future__ import annotations

from .provider import SoftProvider

PROVIDER = SoftProvider()

__all__ = ["PROVIDER", "SoftProvider"]
