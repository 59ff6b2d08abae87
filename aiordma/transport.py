"""The transport layer's public face: Endpoints, connection setup, asyncio Transports.

The pieces live in ``endpoint.py`` (the message API), ``connection.py`` (handshake,
``listen``/``connect``), ``rdma_transport.py`` (``RDMATransport``: an asyncio Transport
over an Endpoint) and ``rdma_server.py`` (``create_connection``/``create_server``).
"""

from __future__ import annotations

from .connection import connect
from .endpoint import Endpoint
from .listener import Listener, listen
from .rdma_server import RDMAServer, create_connection, create_server
from .rdma_transport import RDMATransport

__all__ = ["Endpoint", "Listener", "RDMAServer", "RDMATransport", "connect",
           "create_connection", "create_server", "listen"]
