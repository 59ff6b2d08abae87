"""``IbvContext``: an open device (``struct ibv_context``), its queries, async events
and the factories of PDs, completion channels and CQs."""

from __future__ import annotations

import ctypes
import errno
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ...errors import DeviceError, RDMAError
from ..api import AsyncEvent, CompChannel, Context, DeviceAttr, PortAttr
from ..enums import MTU, EventType, LinkLayer, PortState
from . import clib, compat, probe
from .channel import IbvCompChannel
from .cq import IbvCQ
from .loader import enum_value, load_pyverbs, text
from .pd import IbvPD

if TYPE_CHECKING:
    from .qp import IbvQP

log = logging.getLogger("aiordma.verbs")

_QP_EVENTS = frozenset({
    EventType.QP_FATAL, EventType.QP_REQ_ERR, EventType.QP_ACCESS_ERR, EventType.COMM_EST,
    EventType.SQ_DRAINED, EventType.PATH_MIG, EventType.PATH_MIG_ERR,
    EventType.QP_LAST_WQE_REACHED,
})
_PORT_EVENTS = frozenset({
    EventType.PORT_ACTIVE, EventType.PORT_ERR, EventType.LID_CHANGE, EventType.PKEY_CHANGE,
    EventType.SM_CHANGE, EventType.CLIENT_REREGISTER, EventType.GID_CHANGE,
})
_INLINE_PROBE = (512, 256, 128, 64, 32)
#: device name -> the largest max_inline_data an RC QP accepts (probed once per process)
_inline_cache: dict[str, int] = {}


class IbvContext(Context):
    provider = "verbs"

    def __init__(self, name: str) -> None:
        pv = load_pyverbs()
        self._pv = pv
        self.name = name
        before = probe.event_fds()
        try:
            self._ctx: Any = pv.device.Context(name=name)
        except pv.Error as exc:
            raise DeviceError(compat.errno_of(exc, errno.ENODEV),
                              f"cannot open RDMA device {name}: {exc}") from None
        after = probe.event_fds()
        self._closed = False
        self._children: set[object] = set()  # PDs, CQs, channels
        self._qps: dict[int, IbvQP] = {}
        self._cqs_by_token: dict[int, IbvCQ] = {}
        self._mem = probe.ProcSelfMem()
        self._attr: DeviceAttr | None = None
        try:
            self._ctx_ptr = self._find_ctx_ptr()
            self._reader: clib.AsyncReader | None = None
            afd: int | None = None
            if self._ctx_ptr:
                afd = ctypes.c_int.from_address(self._ctx_ptr + compat.CTX_ASYNC_FD_OFFSET).value
                lib = clib.libibverbs()
                if lib is not None:
                    self._reader = clib.AsyncReader(lib, self._ctx_ptr)
            if afd is None:
                afd = probe.new_event_fd(before, after)
            if afd is None:
                raise DeviceError(errno.EIO, f"cannot find the async event fd of {name} "
                                  f"({pv.describe()})")
            probe.set_nonblocking(afd)
            self._async_fd = afd
        except BaseException:
            self._ctx.close()
            self._mem.close()
            self._closed = True  # (nothing left for __del__ to release)
            raise
        log.debug("aiordma: opened %s (%s, context %#x, async fd %d, events through libibverbs %s)", name,
                  pv.describe(), self._ctx_ptr or 0, self._async_fd, self._reader is not None)

    def __repr__(self) -> str:
        return f"<IbvContext {self.name}>"

    def _find_ctx_ptr(self) -> int | None:
        """``struct ibv_context *`` of the pyverbs Context (see the package docstring)."""
        cmd_fd = int(self._ctx.cmd_fd)
        words: list[int] = []
        if self._pv.context_ptr_property:
            try:
                words.append(int(self._ctx.context))
            except (TypeError, ValueError):
                pass
        for ws in (words, None):
            if ws is None:
                try:
                    ws = probe.object_words(self._ctx)
                except Exception:  # pragma: no cover - non-CPython
                    return None
            ptr = probe.find_context_pointer(ws, cmd_fd, self._mem.read, probe.is_event_fd)
            if ptr:
                return ptr
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise DeviceError(errno.EBADF, f"device context {self.name} is closed")

    def _error(self, exc: BaseException, what: str) -> RDMAError:
        return RDMAError(compat.errno_of(exc), f"{what} on {self.name}: {exc}")

    # --- queries -----------------------------------------------------------------------
    def query_device(self) -> DeviceAttr:
        self._check_open()
        if self._attr is None:
            try:
                a = self._ctx.query_device()
            except self._pv.Error as exc:
                raise self._error(exc, "ibv_query_device") from None
            self._attr = DeviceAttr(
                max_qp_wr=int(a.max_qp_wr),
                max_sge=int(a.max_sge),
                max_cqe=int(a.max_cqe),
                max_mr_size=int(a.max_mr_size),
                max_qp_rd_atom=int(a.max_qp_rd_atom),
                max_qp_init_rd_atom=int(a.max_qp_init_rd_atom),
                max_inline_data=self._max_inline(),
                atomic_cap=int(a.atomic_caps),
                vendor=f"{int(a.vendor_id):#06x}:{int(a.vendor_part_id):#x}",
                fw_ver=text(a.fw_version),
            )
        return self._attr

    def _max_inline(self) -> int:
        """The largest ``max_inline_data`` an RC QP accepts (not in ibv_device_attr):
        probed once per device by creating throw-away QPs."""
        if self.name in _inline_cache:
            return _inline_cache[self.name]
        pv, best = self._pv, 0
        try:
            pd = pv.pd.PD(self._ctx)
            try:
                cq = pv.cq.CQ(self._ctx, 2, None, None, 0)
                try:
                    for size in _INLINE_PROBE:
                        cap = pv.qp.QPCap(max_send_wr=1, max_recv_wr=1, max_send_sge=1,
                                          max_recv_sge=1, max_inline_data=size)
                        init = pv.qp.QPInitAttr(qp_type=pv.e["IBV_QPT_RC"], scq=cq, rcq=cq,
                                                cap=cap, sq_sig_all=0)
                        try:
                            qp = pv.qp.QP(pd, init)
                        except pv.Error:
                            continue
                        qp.close()
                        best = size
                        break
                finally:
                    cq.close()
            finally:
                pd.close()
        except pv.Error as exc:
            log.debug("aiordma: inline probe failed on %s: %s", self.name, exc)
        _inline_cache[self.name] = best
        return best

    def _port_attr(self, port_num: int) -> Any:
        self._check_open()
        try:
            return self._ctx.query_port(port_num)
        except self._pv.Error as exc:
            raise self._error(exc, f"ibv_query_port({port_num})") from None

    def query_port(self, port_num: int = 1) -> PortAttr:
        pa = self._port_attr(port_num)
        return PortAttr(
            state=enum_value(PortState, pa.state, PortState.NOP),
            active_mtu=enum_value(MTU, pa.active_mtu, MTU.MTU_1024),
            max_mtu=enum_value(MTU, pa.max_mtu, MTU.MTU_1024),
            lid=int(pa.lid),
            gid_tbl_len=int(pa.gid_tbl_len),
            link_layer=enum_value(LinkLayer, pa.link_layer, LinkLayer.UNSPECIFIED),
            max_msg_sz=int(pa.max_msg_sz),
        )

    def query_gid(self, port_num: int = 1, index: int = 0) -> bytes:
        self._check_open()
        try:
            gid = self._ctx.query_gid(port_num, index)
        except self._pv.Error as exc:
            raise self._error(exc, f"ibv_query_gid({port_num}, {index})") from None
        return compat.gid_from_str(str(gid))

    def gid_index_for(self, ip: str, port_num: int = 1) -> int:
        pa = self.query_port(port_num)
        if pa.link_layer == LinkLayer.INFINIBAND:
            # LID addressing: the default GID (index 0) serves when a GRH is needed.
            override = compat.gid_index_override()
            return 0 if override is None else override
        entries = compat.read_sysfs_gids(self.name, port_num)
        if entries is None:  # no sysfs (containers): ask the device, type unknown
            entries = []
            for i in range(pa.gid_tbl_len):
                try:
                    g = self.query_gid(port_num, i)
                except RDMAError:
                    continue
                if g != compat.ZERO_GID:
                    entries.append(compat.GidEntry(i, g, None))
        return compat.select_gid_index(entries, ip, dev=self.name, port=port_num)

    # --- factories ---------------------------------------------------------------------
    def alloc_pd(self) -> IbvPD:
        self._check_open()
        return IbvPD(self)

    def create_comp_channel(self) -> IbvCompChannel:
        self._check_open()
        return IbvCompChannel(self)

    def create_cq(self, cqe: int, channel: CompChannel | None = None) -> IbvCQ:
        self._check_open()
        if channel is not None and not isinstance(channel, IbvCompChannel):
            raise RDMAError(errno.EINVAL, "completion channel of another provider")
        return IbvCQ(self, cqe, channel)

    # --- async events --------------------------------------------------------------------
    @property
    def async_fd(self) -> int:
        return self._async_fd

    def _convert_async(self, etype: int, element: int) -> AsyncEvent | None:
        try:
            et = EventType(etype)
        except ValueError:
            log.debug("aiordma: ignoring async event type %d on %s", etype, self.name)
            return None
        if et == EventType.CQ_ERR:
            cq = self._cqs_by_token.get(clib.cq_context_of(element)) if element else None
            if cq is not None:
                cq._overrun_detected()
            return AsyncEvent(et, cq=cq)
        if et in _QP_EVENTS:
            return AsyncEvent(et, qp_num=clib.qp_num_of(element) if element else None)
        if et in _PORT_EVENTS:
            return AsyncEvent(et, port_num=clib.element_port(element))
        return AsyncEvent(et)

    def _read_async(self) -> list[AsyncEvent]:
        if self._closed:
            return []
        if self._reader is not None:
            return self._reader.drain(self._convert_async)
        out: list[AsyncEvent] = []  # fallback: pyverbs, without the element
        while probe.readable(self._async_fd):
            try:
                ev = self._ctx.get_async_event()
            except self._pv.Error:
                break
            try:
                et = enum_value(EventType, ev.event_type, None)
            finally:
                ev.ack()
            if et is not None:
                out.append(AsyncEvent(et))
        return out

    def get_async_events(self) -> list[AsyncEvent]:
        return self._read_async()

    def __del__(self) -> None:
        # A context dropped while open (a program that never closed its endpoints): as
        # cyclic garbage, its pyverbs objects would be destroyed in whatever order the GC
        # clears them, and one destroyed after the device context fails (EBADF: pyverbs
        # prints it) or blocks (a CQ with unacknowledged events). Finalizers run while
        # the garbage is still intact (PEP 442), so destroy them here, children first.
        if not getattr(self, "_closed", True):
            try:
                self._release_all()
            except Exception:  # (interpreter shutdown: nothing is left to report to)
                pass

    def _release_all(self) -> None:
        """Destroy every object of this context still open, children first (QPs, MRs,
        CQs with their events acknowledged, channels, PDs), then the context; failures
        are logged at debug level (nobody is left to tell)."""
        children = list(self._children)
        steps: list[Callable[[], None]] = [qp.close for qp in list(self._qps.values())]
        steps += [mr.close for pd in children if isinstance(pd, IbvPD) for mr in list(pd._mrs)]
        for cq in children:
            if isinstance(cq, IbvCQ):
                steps += [functools.partial(cq.ack_events, cq.unacked_events()),
                          cq.close]
        steps += [c.close for c in children if isinstance(c, IbvCompChannel)]
        steps += [pd.close for pd in children if isinstance(pd, IbvPD)]
        steps.append(self.close)
        for step in steps:
            try:
                step()
            except Exception as exc:
                log.debug("aiordma: releasing %s: %s failed: %r", self.name, step, exc)

    def close(self) -> None:
        if self._closed:
            return
        if self._children or self._qps:
            kinds = sorted({type(c).__name__ for c in self._children}
                           | ({"IbvQP"} if self._qps else set()))
            raise RDMAError(errno.EBUSY, f"device context {self.name} still has "
                            f"{len(self._children) + len(self._qps)} object(s): {', '.join(kinds)}")
        self._read_async()  # ack what is queued (nobody will read it any more)
        try:
            self._ctx.close()
        except self._pv.Error as exc:
            raise self._error(exc, "ibv_close_device") from None
        self._closed = True
        self._reader = None
        self._mem.close()
