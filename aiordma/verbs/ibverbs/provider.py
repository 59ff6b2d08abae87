"""``IbverbsProvider``: the devices pyverbs sees, and opening one (``IbvContext``)."""

from __future__ import annotations

import errno
import logging
from typing import Any

from ...errors import DeviceError
from ..api import DeviceInfo, PortInfo, Provider
from ..enums import MTU, LinkLayer, PortState
from .context import IbvContext
from .loader import enum_value, load_pyverbs, text

log = logging.getLogger("aiordma.verbs")


class IbverbsProvider(Provider):
    name = "verbs"

    def _port_info(self, pctx: Any, port: int) -> PortInfo:
        pa = pctx.query_port(port)
        return PortInfo(
            port_num=port,
            state=enum_value(PortState, pa.state, PortState.NOP),
            link_layer=enum_value(LinkLayer, pa.link_layer, LinkLayer.UNSPECIFIED),
            active_mtu=enum_value(MTU, pa.active_mtu, MTU.MTU_1024),
            lid=int(pa.lid),
        )

    def list_devices(self) -> list[DeviceInfo]:
        pv = load_pyverbs()
        try:
            devs = pv.device.get_device_list()
        except pv.Error as exc:  # no kernel support (ENOSYS) and the like
            log.debug("aiordma: ibv_get_device_list failed: %s", exc)
            return []
        out: list[DeviceInfo] = []
        for dev in devs:
            name = text(dev.name)
            ports: tuple[PortInfo, ...] = ()
            try:
                pctx = pv.device.Context(name=name)
                try:
                    n = int(pctx.query_device().phys_port_cnt)
                    ports = tuple(self._port_info(pctx, p) for p in range(1, n + 1))
                finally:
                    pctx.close()
            except pv.Error as exc:
                log.debug("aiordma: cannot query RDMA device %s: %s", name, exc)
            out.append(DeviceInfo(name=name, provider=self.name, ports=ports))
        return out

    def open(self, name: str | None = None) -> IbvContext:
        devs = self.list_devices()
        listing = ", ".join(
            f"{d.name} ({'/'.join(p.state.name for p in d.ports) or 'no ports'})" for d in devs
        ) or "none"
        if name is None:
            active = [d for d in devs if d.active]
            if not active:
                raise DeviceError(errno.ENODEV,
                                  f"no RDMA device with an ACTIVE port; devices: {listing}")
            name = active[0].name
        elif name not in {d.name for d in devs}:
            raise DeviceError(errno.ENODEV, f"no RDMA device {name!r}; devices: {listing}")
        return IbvContext(name)


__all__ = ["IbverbsProvider"]
