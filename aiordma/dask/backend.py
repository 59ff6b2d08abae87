"""``RDMABackend``: the ``rdma`` scheme of ``distributed.comm``.

Registered through the ``distributed.comm.backends`` entry point (``pip install
'aiordma[dask]'``), so ``rdma://host:port`` works wherever Dask takes an address
(``LocalCluster(protocol="rdma://")``, ``dask scheduler --protocol rdma``). Addresses
are IP-based like ``tcp://``: the host is the address of the setup connection (for
``verbs``, the IP of the RDMA interface; see aiordma's README), so the address helpers
(``get_address_host``, ``resolve_address``, ``get_local_address_for``, ...) are those
of Dask's TCP backend.
"""

from __future__ import annotations

from distributed.comm.tcp import BaseTCPBackend

from .comm import RDMAConnector, RDMAListener


class RDMABackend(BaseTCPBackend):
    """The ``rdma`` backend: ``RDMAConnector``, ``RDMAListener`` and TCP's address
    handling."""

    _connector_class = RDMAConnector
    _listener_class = RDMAListener
