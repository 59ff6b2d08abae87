"""The transport layer's public face: Endpoints, connection setup, asyncio Transports.

The pieces live in ``endpoint.py`` (the message API), ``connection.py`` (handshake,
``listen``/``connect``) and ``rdma_transport.py`` (``RDMATransport``,
``create_connection``/``create_server``: asyncio Protocols over an Endpoint).
"""

from __future__ import annotations

from .connection import connect
from .endpoint import Endpoint
from .listener import Listener, listen
from .rdma_transport import RDMAServer, RDMATransport, create_connection, create_server

__all__ = ["Endpoint", "Listener", "RDMAServer", "RDMATransport", "connect",
           "create_connection", "create_server", "listen"]
