"""Endpoints, connection setup and (issue 4) asyncio Transports over RDMA.

This module is the public face of the transport layer; the pieces live in
``endpoint.py`` (the message API), ``connection.py`` (handshake, ``listen``/``connect``).
"""

from __future__ import annotations

from .connection import Listener, connect, listen
from .endpoint import Endpoint

__all__ = ["Endpoint", "Listener", "connect", "listen"]
