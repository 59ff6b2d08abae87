"""The ``soft`` provider: one software device, ``soft0``."""

from __future__ import annotations

from ...errors import DeviceError
from ..api import DeviceInfo, PortInfo, Provider
from ..enums import MTU, LinkLayer, PortState
from . import addr, engine
from .context import DEVICE_NAME, SoftContext


class SoftProvider(Provider):
    name = "soft"

    def list_devices(self) -> list[DeviceInfo]:
        """``soft0``; its lid is the listening TCP port (the configured one if not open)."""
        e = engine.current()
        if e is not None:
            port = e.port
        else:
            try:
                port = addr.configured()[1]
            except DeviceError:
                port = 0
        return [DeviceInfo(
            name=DEVICE_NAME,
            provider=self.name,
            ports=(PortInfo(1, PortState.ACTIVE, LinkLayer.ETHERNET, MTU.MTU_4096, lid=port),),
        )]

    def open(self, name: str | None = None) -> SoftContext:
        if name not in (None, DEVICE_NAME):
            raise DeviceError(f"no soft device {name!r} (the soft provider has {DEVICE_NAME!r})")
        return SoftContext()
