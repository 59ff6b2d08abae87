"""aiordma: asyncio networking over RDMA.

``await ep.send()``/``recv()``, one-sided ``read``/``write``, atomics, on real RDMA
devices (``verbs`` provider, rdma-core's pyverbs) or on any machine (``soft``
provider). See DESIGN.md for the layers and README.md for usage.
"""

from __future__ import annotations

from typing import Any

from .device import Device, open_device
from .errors import (
    AuthenticationError,
    CompletionError,
    ConnectionClosed,
    ConnectionRefused,
    CQOverrunError,
    DeviceError,
    FlushedError,
    HandshakeError,
    HandshakeTimeout,
    LocalLengthError,
    LocalProtectionError,
    MessageTooLarge,
    PeerUnresponsive,
    PostError,
    RDMAError,
    RegistrationError,
    RemoteAccessError,
    RemoteInvalidRequestError,
    RemoteOperationError,
    ResourceLimitError,
    RetryExceededError,
    RNRRetryExceededError,
)
from .memory import MemoryRegion, RemoteBuffer
from .native import warn_if_stale as _warn_if_stale
from .transport import Endpoint, Listener, connect, listen
from .verbs import DeviceInfo, PortInfo

__version__ = "0.1.0"


def list_devices() -> list[DeviceInfo]:
    """Every device of every available provider, real devices first.

    Each ``DeviceInfo`` has ``.name``, ``.provider``, ``.ports`` (state, MTU, link
    layer) and ``.active``.
    """
    from .verbs import list_devices as _list

    return _list()


_warn_if_stale()


def __getattr__(name: str) -> Any:
    # Protocol/stream helpers (issue 4) load lazily so the core imports stay small.
    if name in ("create_connection", "create_server", "RDMATransport"):
        from . import transport

        return getattr(transport, name)
    if name in ("open_connection", "start_server"):
        from . import streams

        return getattr(streams, name)
    raise AttributeError(f"module 'aiordma' has no attribute {name!r}")


__all__ = [
    "AuthenticationError", "HandshakeTimeout", "ResourceLimitError",
    "CompletionError", "ConnectionClosed", "ConnectionRefused", "CQOverrunError", "Device",
    "DeviceError", "DeviceInfo", "Endpoint", "FlushedError", "HandshakeError", "Listener",
    "LocalLengthError", "LocalProtectionError", "MemoryRegion", "MessageTooLarge", "PeerUnresponsive", "PortInfo",
    "PostError", "RDMAError", "RegistrationError", "RemoteAccessError",
    "RemoteInvalidRequestError", "RemoteOperationError", "RemoteBuffer", "RetryExceededError",
    "RNRRetryExceededError", "connect", "list_devices", "listen", "open_device",
]
