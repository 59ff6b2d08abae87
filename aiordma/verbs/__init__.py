"""The verbs layer: the only code that touches a provider.

Providers register by name; ``get_provider(name)`` imports one lazily. Selection
(``select_provider``): the ``provider`` argument, else ``AIORDMA_PROVIDER``, else
``verbs`` when an ACTIVE RDMA port exists, else ``soft`` (logged once at INFO).
"""

from __future__ import annotations

import importlib
import logging
import os

from ..errors import DeviceError
from .api import (
    CQ,
    MR,
    PD,
    QP,
    AHAttr,
    AsyncEvent,
    CompChannel,
    Context,
    DeviceAttr,
    DeviceInfo,
    PortAttr,
    PortInfo,
    Provider,
    QPAttr,
    QPCap,
)
from .contract import InvalidWorkRequest
from .enums import (
    MTU,
    Access,
    EventType,
    LinkLayer,
    PortState,
    QPState,
    SendFlags,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from .wr import SGE, WC, RecvWR, SendWR

__all__ = [
    "CQ", "MR", "PD", "QP", "AHAttr", "AsyncEvent", "CompChannel", "Context", "DeviceAttr",
    "DeviceInfo", "PortAttr", "PortInfo", "Provider", "QPAttr", "QPCap", "MTU", "Access",
    "EventType", "LinkLayer", "PortState", "QPState", "SendFlags", "WCFlags", "WCOpcode",
    "WCStatus", "WROpcode", "SGE", "WC", "RecvWR", "SendWR", "PROVIDERS", "get_provider",
    "select_provider", "list_devices", "open_context", "InvalidWorkRequest",
]

log = logging.getLogger("aiordma")

#: provider name -> module that defines ``PROVIDER`` (a ``Provider`` instance)
PROVIDERS = {
    "soft": "aiordma.verbs.soft",
    "verbs": "aiordma.verbs.ibverbs",
}

_cache: dict[str, Provider] = {}
_auto_logged = False


def get_provider(name: str) -> Provider:
    """The provider called ``name``. Raises DeviceError for an unknown or unusable one."""
    if name not in PROVIDERS:
        raise DeviceError(f"unknown provider {name!r}; known: {', '.join(sorted(PROVIDERS))}")
    prov = _cache.get(name)
    if prov is None:
        try:
            mod = importlib.import_module(PROVIDERS[name])
        except ImportError as exc:
            raise DeviceError(f"provider {name!r} is not available: {exc}") from exc
        prov = mod.PROVIDER
        _cache[name] = prov
    return prov


def _active_verbs_port() -> bool:
    try:
        return any(d.active for d in get_provider("verbs").list_devices())
    except Exception:  # no pyverbs, no devices, no kernel support
        return False


def select_provider(name: str | None = None) -> Provider:
    """The provider to use (see module docstring)."""
    global _auto_logged
    name = name or os.environ.get("AIORDMA_PROVIDER") or None
    if name:
        return get_provider(name)
    chosen = "verbs" if _active_verbs_port() else "soft"
    if not _auto_logged:
        _auto_logged = True
        log.info("aiordma: using provider %r (set AIORDMA_PROVIDER to choose)", chosen)
    return get_provider(chosen)


def list_devices() -> list[DeviceInfo]:
    """Devices of every importable provider (real ones first)."""
    out: list[DeviceInfo] = []
    for name in ("verbs", "soft"):
        try:
            out.extend(get_provider(name).list_devices())
        except Exception:
            continue
    return out


def open_context(name: str | None = None, *, provider: str | None = None) -> Context:
    """Open device ``name`` of the selected provider."""
    return select_provider(provider).open(name)
