"""The ``soft`` provider: a software RDMA device with RC verbs semantics over TCP (an
abstract Unix socket between devices on one host; ``AIORDMA_SOFT_UNIX=0`` keeps TCP).

Modules (one reason to change each):

* ``_core``     -- the data path, compiled (``_core.pyx``: the device lock, the header
  codec, MRs and keys, CQs and completion channels, connections and their sinks, the
  QP's requester and responder; its parts are the ``core_*.pxi`` files). The provider
  needs it: without a build of it, ``get_provider("soft")`` says why.
* ``wire``      -- the wire protocol (hello, message header, opcodes, PSN arithmetic)
* ``addr``      -- configuration (AIORDMA_SOFT_ADDR/PORT/UNIX), GID table, peer addresses
* ``limits``    -- device attributes reported by query_device
* ``engine``    -- the per-process device: listeners, NIC thread (watchdog), timers, tables
* ``admission`` -- who may connect: peer credentials, pending HELLOs (cap, timeout), MACs
* ``dial``      -- outgoing connections' sockets (made in the caller's thread)
* ``cma``       -- same-host cross-memory attach (process_vm_readv/writev) for READ/WRITE
* ``keys``      -- memory keys (a secret permutation per PD), random QP numbers
* ``mr``        -- the protection domain
* ``context``   -- the device context (queries, factories, async events)
* ``provider``  -- ``PROVIDER``: list_devices/open
"""

from __future__ import annotations

try:
    from . import _core  # noqa: F401  (the data path: see the module list)
except ImportError as exc:  # not built: say why (aiordma.native records the reason)
    from ...native import extension_status

    raise ImportError(f"the soft provider's compiled data path is missing "
                      f"({extension_status('aiordma.verbs.soft._core') or exc}); build it "
                      "with a C compiler: pip install . or make native") from exc

from .provider import SoftProvider

PROVIDER = SoftProvider()

__all__ = ["PROVIDER", "SoftProvider"]
