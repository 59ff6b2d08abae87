"""Open devices shared by endpoints: one context per (provider, name), one reactor per loop.

``Device.acquire(name, provider)`` returns the process-wide shared, refcounted device;
``release()`` drops a reference and closes the context with the last one. Users may
also open a device explicitly with ``aiordma.open_device()`` and pass it as
``device=`` to ``connect``/``listen``.
"""

from __future__ import annotations

import asyncio
from typing import Any

from .cq_reactor import CQReactor
from .verbs import Context, open_context, select_provider


class Device:
    """An open RDMA device: its verbs ``Context`` and its CQ reactors (one per loop)."""

    _shared: dict[tuple[str, str | None], Device] = {}

    def __init__(self, ctx: Context, *, shared_key: tuple[str, str | None] | None = None) -> None:
        self.ctx = ctx
        self.name = ctx.name
        self.provider = ctx.provider
        self._reactors: dict[int, CQReactor] = {}
        self._refs = 1
        self._shared_key = shared_key
        self.closed = False

    @classmethod
    def acquire(cls, name: str | None = None, provider: str | None = None) -> Device:
        """The shared device for (provider, name), opened on first use (refcounted)."""
        prov = select_provider(provider).name
        key = (prov, name)
        dev = cls._shared.get(key)
        if dev is not None and not dev.closed:
            dev._refs += 1
            return dev
        dev = cls(open_context(name, provider=prov), shared_key=key)
        cls._shared[key] = dev
        return dev

    def ref(self) -> Device:
        self._refs += 1
        return self

    def reactor(self, loop: asyncio.AbstractEventLoop | None = None, **opts: Any) -> CQReactor:
        """The CQ reactor of this device on ``loop`` (the running loop by default)."""
        loop = loop or asyncio.get_running_loop()
        r = self._reactors.get(id(loop))
        if r is None or r.loop is not loop or r._closed:
            r = CQReactor(self.ctx, loop, **opts)
            self._reactors[id(loop)] = r
        return r

    def release(self) -> None:
        """Drop one reference; the last one closes reactors and the context."""
        self._refs -= 1
        if self._refs <= 0:
            self.close()

    def close(self) -> None:
        """Close every reactor and the context. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for r in self._reactors.values():
            r.close()
        self._reactors.clear()
        if self._shared_key is not None and Device._shared.get(self._shared_key) is self:
            del Device._shared[self._shared_key]
        self.ctx.close()

    def __repr__(self) -> str:
        return f"<Device {self.name} provider={self.provider} refs={self._refs}>"


def open_device(name: str | None = None, *, provider: str | None = None) -> Device:
    """Open a device for explicit use (``device=`` option); close it with ``close()``."""
    return Device(open_context(name, provider=provider))
