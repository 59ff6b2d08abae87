"""Dask over RDMA: the ``rdma://`` comm backend of ``distributed``.

Install with ``pip install 'aiordma[dask]'``; the ``distributed.comm.backends`` entry
point makes the scheme known to every Dask process, so a cluster on RDMA (or on the
``soft`` provider) is one address away::

    from distributed import Client, LocalCluster
    with LocalCluster(protocol="rdma://", n_workers=2) as cluster, Client(cluster) as c:
        ...

Importing this package also registers the backend (for processes that run aiordma
from a checkout, without the entry point: ``dask scheduler --preload aiordma.dask``).

Modules: ``frames`` (how a Dask message is laid out on aiordma messages, sans-IO, no
distributed needed), ``comm`` (``RDMAComm``, connector, listener), ``backend``
(``RDMABackend``), ``bench`` (tcp:// against rdma://: ``python -m aiordma.dask.bench``).
"""

from __future__ import annotations

from typing import Any

_backends: dict[str, Any] | None
try:
    from distributed.comm.registry import backends as _registry
except ImportError:  # pragma: no cover - depends on the environment
    _backends = None
else:
    _backends = _registry

__all__ = ["RDMABackend", "RDMAComm", "RDMAConnector", "RDMAListener"]

if _backends is not None:
    from .backend import RDMABackend
    from .comm import RDMAComm, RDMAConnector, RDMAListener

    _backends.setdefault("rdma", RDMABackend())


def __getattr__(name: str) -> Any:
    if name in __all__:  # only reached without distributed
        raise ImportError(f"aiordma.dask.{name} needs distributed: "
                          "pip install 'aiordma[dask]'")
    raise AttributeError(f"module 'aiordma.dask' has no attribute {name!r}")
