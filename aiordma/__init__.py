"""aiordma: asyncio networking over RDMA.

``await ep.send()``/``recv()``, one-sided ``read``/``write``, atomics, on real RDMA
devices (``verbs`` provider, rdma-core's pyverbs) or on any machine (``soft``
provider). README.md is the manual; docs/design.md describes the layers.
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


#: the asyncio Protocol and streams helpers, loaded on first use so that the core
#: imports stay small: name -> the submodule that defines it
_LAZY = {"create_connection": "transport", "create_server": "transport",
         "RDMATransport": "transport", "open_connection": "streams", "start_server": "streams"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module 'aiordma' has no attribute {name!r}")


__all__ = [
    "AuthenticationError", "HandshakeTimeout", "ResourceLimitError",
    "CompletionError", "ConnectionClosed", "ConnectionRefused", "CQOverrunError", "Device",
    "DeviceError", "DeviceInfo", "Endpoint", "FlushedError", "HandshakeError", "Listener",
    "LocalLengthError", "LocalProtectionError", "MemoryRegion", "MessageTooLarge", "PeerUnresponsive", "PortInfo",
    "PostError", "RDMAError", "RegistrationError", "RemoteAccessError",
    "RemoteInvalidRequestError", "RemoteOperationError", "RemoteBuffer", "RetryExceededError",
    "RNRRetryExceededError", "connect", "list_devices", "listen", "open_device",
    *_LAZY,
]
