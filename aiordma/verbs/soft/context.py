"""The soft device context: queries, object factories and device async events."""

from __future__ import annotations

import errno
from collections import deque

from ...errors import DeviceError, RDMAError
from ..api import AsyncEvent, CompChannel, Context, DeviceAttr, PortAttr
from ..enums import MTU, LinkLayer, PortState
from . import addr, engine, limits
from ._core import PipeFlag, SoftCompChannel, SoftCQ
from .mr import SoftPD

DEVICE_NAME = "soft0"
GID_TABLE_LEN = 16


class SoftContext(Context):
    name = DEVICE_NAME
    provider = "soft"
    maps_shared_memory = True  # responder.py: READs into SharedMemory by memmove
    reads_on_cpu = True  # READs are copies: the responder's (CMA, memmove) or a socket's

    def __init__(self) -> None:
        self._engine = engine.acquire()
        self._async: deque[AsyncEvent] = deque()
        self._async_flag = PipeFlag()
        self._children: set[object] = set()
        self._closed = False

    def __repr__(self) -> str:
        return f"<SoftContext {self.name} {self._engine.host}:{self._engine.port}>"

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(errno.EBADF, "device context is closed")

    def _children_changed(self, obj: object, alive: bool) -> None:
        with self._engine.lock:
            if alive:
                self._children.add(obj)
            else:
                self._children.discard(obj)

    def _post_async(self, ev: AsyncEvent) -> None:
        """Queue an async event (device lock held)."""
        if not self._closed:
            self._async.append(ev)
            self._async_flag.raise_()

    # --- queries -----------------------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        return limits.DEVICE_ATTR

    def query_port(self, port_num: int = 1) -> PortAttr:
        if port_num != 1:
            raise RDMAError(errno.EINVAL, f"{self.name} has only port 1")
        return PortAttr(
            state=PortState.ACTIVE,
            active_mtu=MTU.MTU_4096,
            max_mtu=MTU.MTU_4096,
            lid=self._engine.port,
            gid_tbl_len=max(GID_TABLE_LEN, len(self._engine.gids)),
            link_layer=LinkLayer.ETHERNET,
            max_msg_sz=limits.MAX_MSG_SIZE,
        )

    def query_gid(self, port_num: int = 1, index: int = 0) -> bytes:
        if port_num != 1:
            raise RDMAError(errno.EINVAL, f"{self.name} has only port 1")
        gids = self._engine.gids
        if not 0 <= index < max(GID_TABLE_LEN, len(gids)):
            raise RDMAError(errno.EINVAL, f"GID index {index} out of range")
        return gids[index] if index < len(gids) else b"\0" * 16

    def gid_index_for(self, ip: str, port_num: int = 1) -> int:
        if port_num != 1:
            raise DeviceError(errno.EINVAL, f"{self.name} has only port 1")
        try:
            gid = addr.gid_of(ip)
        except ValueError:
            raise DeviceError(errno.EINVAL, f"{ip!r} is not an IP address") from None
        gids = self._engine.gids
        if gid in gids:
            return gids.index(gid)
        have = ", ".join(addr.gid_str(g) for g in gids)
        raise DeviceError(
            errno.ENODEV,
            f"no GID of {self.name} matches {ip} (the soft device listens on "
            f"{self._engine.host}:{self._engine.port}, GIDs: {have}); set AIORDMA_SOFT_ADDR "
            f"to {ip} or 0.0.0.0",
        )

    def peer_address_problem(self, gid: bytes, lid: int, seen_ip: str) -> str | None:
        """The soft device connects to ``gid``/``lid`` itself: only where the peer is,
        i.e. the GID's address is the setup connection's peer address, or both are
        addresses of this host."""
        try:
            _family, (ip, _port) = addr.sockaddr_of(gid, lid)
            if addr.same_host(ip, seen_ip):
                return None
        except ValueError as exc:
            return f"bad soft device address: {exc}"
        return (f"the peer's soft device address {ip} is not the address {seen_ip} its "
                f"connection comes from")

    # --- factories ---------------------------------------------------------------------
    def alloc_pd(self) -> SoftPD:
        self._check_open()
        pd = SoftPD(self)
        self._children_changed(pd, alive=True)
        return pd

    def create_comp_channel(self) -> SoftCompChannel:
        self._check_open()
        ch = SoftCompChannel(self)
        self._children_changed(ch, alive=True)
        return ch

    def create_cq(self, cqe: int, channel: CompChannel | None = None) -> SoftCQ:
        self._check_open()
        if not 1 <= cqe <= limits.DEVICE_ATTR.max_cqe:
            raise RDMAError(errno.EINVAL, f"cqe={cqe} outside 1..{limits.DEVICE_ATTR.max_cqe}")
        if channel is not None:
            if not isinstance(channel, SoftCompChannel) or channel._ctx._engine is not self._engine:
                raise RDMAError(errno.EINVAL, "completion channel of another device")
            if channel._closed:
                raise RDMAError(errno.EINVAL, "completion channel is closed")
        cq = SoftCQ(self, cqe, channel)
        with self._engine.lock:
            if channel is not None:
                channel._ncqs += 1
        self._children_changed(cq, alive=True)
        return cq

    # --- async events --------------------------------------------------------------------
    @property
    def async_fd(self) -> int:
        return self._async_flag.fd

    def get_async_events(self) -> list[AsyncEvent]:
        with self._engine.lock:
            out = list(self._async)
            self._async.clear()
            self._async_flag.lower()
        return out

    def close(self) -> None:
        if self._closed:
            return
        with self._engine.lock:
            if self._children:
                kinds = sorted({type(c).__name__ for c in self._children})
                raise RDMAError(errno.EBUSY,
                                f"device context still has {len(self._children)} object(s): "
                                f"{', '.join(kinds)}")
            self._closed = True
            self._async.clear()
        self._async_flag.close()
        engine.release(self._engine)
