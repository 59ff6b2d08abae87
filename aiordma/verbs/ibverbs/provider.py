"""The ``verbs`` provider objects: pyverbs wrapped into the interface of ``verbs/api.py``.

pyverbs is imported lazily (``load_pyverbs``), so that importing this package never fails
on a machine without it; ``list_devices``/``open`` then raise ``DeviceError`` with the
install hint. See the package docstring for the version notes.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import select
from collections.abc import Iterable
from typing import Any

from ...errors import CQOverrunError, DeviceError, PostError, RDMAError, RegistrationError
from ..api import (
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
from ..buffers import PinnedBuffer
from ..contract import ATOMIC_OPS as _ATOMIC_OPS
from ..contract import (
    InvalidWorkRequest,
    check_cq_close,
    check_mr_access,
    check_recv_wrs,
    check_send_wr,
)
from ..enums import (
    MTU,
    WC_OPCODE_FOR_WR,
    Access,
    EventType,
    LinkLayer,
    PortState,
    QPState,
    SendFlags,
    WCOpcode,
    WROpcode,
)
from ..wr import WC, RecvWR, SendWR
from . import compat, native

log = logging.getLogger("aiordma.verbs")

INSTALL_HINT = (
    "the 'verbs' provider needs pyverbs (rdma-core's Python bindings): install the "
    "distribution package (Debian/Ubuntu: apt install python3-pyverbs; a virtualenv sees it "
    "when created with --system-site-packages), or pip install pyverbs matching the "
    "system's rdma-core version"
)

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_IMM_OPS = frozenset({WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM})
_RDMA_OPS = frozenset({WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.RDMA_READ})
# what a post sets besides wr_id, opcode, flags and SGEs, per opcode: one look-up
_K_IMM, _K_RDMA, _K_ATOMIC = 1, 2, 4
_OP_KIND = {op: ((_K_IMM if op in _IMM_OPS else 0) | (_K_RDMA if op in _RDMA_OPS else 0)
                 | (_K_ATOMIC if op in _ATOMIC_OPS else 0)) for op in WROpcode}
_NO_SEND_STATES = frozenset({QPState.RESET, QPState.INIT, QPState.RTR})
_WC_RECV_BIT = 0x80  # IBV_WC_RECV: every receive opcode has it, no send opcode does


def _set_op_fields(p: Any, wr: SendWR, kind: int) -> None:
    """Set on the pyverbs SendWR ``p`` the fields that ``wr``'s opcode reads besides
    wr_id, opcode, flags and SGEs (``kind`` = ``_OP_KIND[opcode]``): immediate data,
    the RDMA or the atomic part. Single posts and chains both build WRs through it."""
    if kind & _K_IMM:
        p.imm_data = compat.imm_to_wire(wr.imm_data)
    if kind & _K_RDMA:
        p.set_wr_rdma(wr.rkey & _M32, wr.remote_addr & _M64)
    elif kind & _K_ATOMIC:
        p.set_wr_atomic(wr.rkey & _M32, wr.remote_addr & _M64,
                        wr.compare_add & _M64, wr.swap & _M64)

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
# plain ints: IntFlag arithmetic runs Python-level enum code on every post
_F_INLINE = int(SendFlags.INLINE)
_F_SIGNALED = int(SendFlags.SIGNALED)
# pyverbs work requests of single-WR, single-SGE posts kept per QP for reuse (IbvQP)
_WR_CACHE = 64


# ----------------------------------------------------------------------------------------
# pyverbs loading
# ----------------------------------------------------------------------------------------


class Pyverbs:
    """The pyverbs modules and what this version of them can do."""

    def __init__(self) -> None:
        import pyverbs
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.qp
        import pyverbs.wr
        from pyverbs.pyverbs_error import PyverbsError

        self.device: Any = pyverbs.device
        self.pd: Any = pyverbs.pd
        self.cq: Any = pyverbs.cq
        self.qp: Any = pyverbs.qp
        self.mr: Any = pyverbs.mr
        self.wr: Any = pyverbs.wr
        self.addr: Any = pyverbs.addr
        self.Error: type[BaseException] = PyverbsError
        self.version = compat.parse_version(getattr(pyverbs, "__version__", None))
        self.e = compat.import_enums()
        # rdma-core >= 57: CompChannel.fd. >= 61: Context.context is the pointer as an int
        # (before, it casts the C pointer to a Python object: never touch it there).
        self.channel_has_fd = hasattr(self.cq.CompChannel, "fd")
        self.context_ptr_property = self.version is not None and self.version >= (61,)

    def describe(self) -> str:
        ver = ".".join(map(str, self.version)) if self.version else "unknown (< 65)"
        return f"pyverbs {ver}, enums from {self.e.source}"


_pyverbs: Pyverbs | None = None


def load_pyverbs() -> Pyverbs:
    """The pyverbs modules; DeviceError with the install hint when pyverbs is missing."""
    global _pyverbs
    if _pyverbs is None:
        try:
            _pyverbs = Pyverbs()
        except ImportError as exc:
            raise DeviceError(errno.ENOENT, f"{INSTALL_HINT} ({exc})") from exc
    return _pyverbs


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def _enum(cls: Any, value: Any, default: Any) -> Any:
    try:
        return cls(int(value))
    except (ValueError, TypeError):
        return default


def _readable(fd: int) -> bool:
    try:
        r, _, _ = select.select([fd], [], [], 0)
    except (OSError, ValueError):
        return False
    return bool(r)


def _gid_str(gid: bytes) -> str:
    h = bytes(gid).hex()
    return ":".join(h[i:i + 4] for i in range(0, 32, 4))


# ----------------------------------------------------------------------------------------
# provider
# ----------------------------------------------------------------------------------------


class IbverbsProvider(Provider):
    name = "verbs"

    def _port_info(self, pctx: Any, port: int) -> PortInfo:
        pa = pctx.query_port(port)
        return PortInfo(
            port_num=port,
            state=_enum(PortState, pa.state, PortState.NOP),
            link_layer=_enum(LinkLayer, pa.link_layer, LinkLayer.UNSPECIFIED),
            active_mtu=_enum(MTU, pa.active_mtu, MTU.MTU_1024),
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
            name = _text(dev.name)
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


# ----------------------------------------------------------------------------------------
# context
# ----------------------------------------------------------------------------------------

_inline_cache: dict[str, int] = {}


class IbvContext(Context):
    provider = "verbs"

    def __init__(self, name: str) -> None:
        pv = load_pyverbs()
        self._pv = pv
        self.name = name
        before = compat.event_fds()
        try:
            self._ctx: Any = pv.device.Context(name=name)
        except pv.Error as exc:
            raise DeviceError(compat.errno_of(exc, errno.ENODEV),
                              f"cannot open RDMA device {name}: {exc}") from None
        after = compat.event_fds()
        self._closed = False
        self._children: set[object] = set()  # PDs, CQs, channels
        self._qps: dict[int, IbvQP] = {}
        self._cqs_by_token: dict[int, IbvCQ] = {}
        self._mem = compat.ProcSelfMem()
        self._attr: DeviceAttr | None = None
        try:
            self._ctx_ptr = self._find_ctx_ptr()
            self._reader: native.AsyncReader | None = None
            afd: int | None = None
            if self._ctx_ptr:
                afd = ctypes.c_int.from_address(self._ctx_ptr + compat.CTX_ASYNC_FD_OFFSET).value
                lib = native.libibverbs()
                if lib is not None:
                    self._reader = native.AsyncReader(lib, self._ctx_ptr)
            if afd is None:
                afd = compat.new_event_fd(before, after)
            if afd is None:
                raise DeviceError(errno.EIO, f"cannot find the async event fd of {name} "
                                  f"({pv.describe()})")
            compat.set_nonblocking(afd)
            self._async_fd = afd
        except BaseException:
            self._ctx.close()
            self._mem.close()
            raise
        log.debug("aiordma: opened %s (%s, context %#x, async fd %d, native events %s)", name,
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
                    ws = compat.object_words(self._ctx)
                except Exception:  # pragma: no cover - non-CPython
                    return None
            ptr = compat.find_context_pointer(ws, cmd_fd, self._mem.read, compat.is_event_fd)
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
                fw_ver=_text(a.fw_version),
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
            state=_enum(PortState, pa.state, PortState.NOP),
            active_mtu=_enum(MTU, pa.active_mtu, MTU.MTU_1024),
            max_mtu=_enum(MTU, pa.max_mtu, MTU.MTU_1024),
            lid=int(pa.lid),
            gid_tbl_len=int(pa.gid_tbl_len),
            link_layer=_enum(LinkLayer, pa.link_layer, LinkLayer.UNSPECIFIED),
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
            cq = self._cqs_by_token.get(native.cq_context_of(element)) if element else None
            if cq is not None:
                cq._overrun_detected()
            return AsyncEvent(et, cq=cq)
        if et in _QP_EVENTS:
            return AsyncEvent(et, qp_num=native.qp_num_of(element) if element else None)
        if et in _PORT_EVENTS:
            return AsyncEvent(et, port_num=native.element_port(element))
        return AsyncEvent(et)

    def _read_async(self) -> list[AsyncEvent]:
        if self._closed:
            return []
        if self._reader is not None:
            return self._reader.drain(self._convert_async)
        out: list[AsyncEvent] = []  # fallback: pyverbs, without the element
        while _readable(self._async_fd):
            try:
                ev = self._ctx.get_async_event()
            except self._pv.Error:
                break
            try:
                et = _enum(EventType, ev.event_type, None)
            finally:
                ev.ack()
            if et is not None:
                out.append(AsyncEvent(et))
        return out

    def get_async_events(self) -> list[AsyncEvent]:
        return self._read_async()

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


# ----------------------------------------------------------------------------------------
# PD and MR
# ----------------------------------------------------------------------------------------


class IbvMR(MR):
    def __init__(self, pd: IbvPD, pmr: Any, pinned: PinnedBuffer, access: Access) -> None:
        self.pd: IbvPD = pd
        self._mr = pmr
        self._pinned = pinned
        self.view = pinned.view
        self.addr = pinned.addr
        self.length = pinned.length
        self.lkey = int(pmr.lkey)
        self.rkey = int(pmr.rkey)
        self.access = access
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        try:
            self._mr.close()
        except self.pd._pv.Error as exc:
            raise RDMAError(compat.errno_of(exc), f"ibv_dereg_mr: {exc}") from None
        self._closed = True
        self.pd._mrs.discard(self)
        self._pinned.release()

    def __repr__(self) -> str:
        return (f"<IbvMR addr={self.addr:#x} length={self.length} lkey={self.lkey:#x} "
                f"rkey={self.rkey:#x} access={self.access!r}>")


class IbvPD(PD):
    def __init__(self, ctx: IbvContext) -> None:
        self.context: IbvContext = ctx
        self._pv = ctx._pv
        try:
            self._pd: Any = self._pv.pd.PD(ctx._ctx)
        except self._pv.Error as exc:
            raise ctx._error(exc, "ibv_alloc_pd") from None
        self._mrs: set[IbvMR] = set()
        self._qps: set[IbvQP] = set()
        self._closed = False
        ctx._children.add(self)

    def reg_mr(self, buffer: Any, access: Access = Access.LOCAL_WRITE) -> IbvMR:
        if self._closed:
            raise RegistrationError(errno.EINVAL, "protection domain is closed")
        access = check_mr_access(access)
        pinned = PinnedBuffer(buffer)
        if pinned.length == 0:
            pinned.release()
            raise RegistrationError(errno.EINVAL, "cannot register an empty buffer")
        try:
            pmr = self._pv.mr.MR(self._pd, pinned.length, int(access), address=pinned.addr)
        except self._pv.Error as exc:
            pinned.release()
            code = compat.errno_of(exc)
            hint = " (raise the locked-memory limit: ulimit -l)" if code in (
                errno.ENOMEM, errno.EPERM, errno.EAGAIN) else ""
            raise RegistrationError(code, f"ibv_reg_mr of {pinned.length} bytes failed: "
                                    f"{exc}{hint}") from None
        mr = IbvMR(self, pmr, pinned, access)
        self._mrs.add(mr)
        return mr

    def create_qp(self, send_cq: CQ, recv_cq: CQ, cap: QPCap) -> IbvQP:
        if not isinstance(send_cq, IbvCQ) or not isinstance(recv_cq, IbvCQ):
            raise TypeError("CQs of the verbs provider are required")
        if self._closed:
            raise RDMAError(errno.EINVAL, "protection domain is closed")
        ctx = self.context
        if send_cq.context is not ctx or recv_cq.context is not ctx:
            raise RDMAError(errno.EINVAL, "CQs of another device context")
        if send_cq._closed or recv_cq._closed:
            raise RDMAError(errno.EINVAL, "CQ is closed")
        cap = QPCap(cap.max_send_wr, cap.max_recv_wr, cap.max_send_sge, cap.max_recv_sge,
                    cap.max_inline_data)
        for field in ("max_send_wr", "max_recv_wr", "max_send_sge", "max_recv_sge",
                      "max_inline_data"):
            if getattr(cap, field) < 0:
                raise RDMAError(errno.EINVAL, f"QP {field} is negative")
        if cap.max_send_wr < 1:
            raise RDMAError(errno.EINVAL, "a QP needs max_send_wr >= 1")
        pv = self._pv
        try:
            pcap = pv.qp.QPCap(max_send_wr=cap.max_send_wr, max_recv_wr=cap.max_recv_wr,
                               max_send_sge=cap.max_send_sge, max_recv_sge=cap.max_recv_sge,
                               max_inline_data=cap.max_inline_data)
            init = pv.qp.QPInitAttr(qp_type=pv.e["IBV_QPT_RC"], scq=send_cq._cq,
                                    rcq=recv_cq._cq, cap=pcap, sq_sig_all=0)
            pqp = pv.qp.QP(self._pd, init)
        except pv.Error as exc:
            raise ctx._error(exc, f"ibv_create_qp({cap})") from None
        return IbvQP(self, send_cq, recv_cq, cap, pqp)

    def close(self) -> None:
        if self._closed:
            return
        if self._mrs or self._qps:
            raise RDMAError(errno.EBUSY,
                            f"PD still has {len(self._mrs)} MR(s) and {len(self._qps)} QP(s)")
        try:
            self._pd.close()
        except self._pv.Error as exc:
            raise self.context._error(exc, "ibv_dealloc_pd") from None
        self._closed = True
        self.context._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvPD mrs={len(self._mrs)} qps={len(self._qps)}>"


# ----------------------------------------------------------------------------------------
# completion channel and CQ
# ----------------------------------------------------------------------------------------


class IbvCompChannel(CompChannel):
    """A completion channel.

    Events are read with ``ibv_get_cq_event`` through ctypes (``native.ChannelReader``) on
    the channel's C struct, so any number of CQs may share the channel. Only if that
    struct cannot be located is pyverbs' ``get_cq_event(expected_cq)`` used, which needs
    the CQ in advance: the channel then serves one CQ.
    """

    def __init__(self, ctx: IbvContext) -> None:
        pv = ctx._pv
        self._ctx = ctx
        self._pv = pv
        before = None if pv.channel_has_fd else compat.event_fds()
        try:
            self._cc: Any = pv.cq.CompChannel(ctx._ctx)
        except pv.Error as exc:
            raise ctx._error(exc, "ibv_create_comp_channel") from None
        try:
            fd, ptr = self._locate(before)
            compat.set_nonblocking(fd)
        except BaseException:
            self._cc.close()
            raise
        lib = native.libibverbs() if ptr else None
        self._reader = native.ChannelReader(lib, ptr) if lib is not None and ptr else None
        self.fd = fd
        self._cqs: dict[int, IbvCQ] = {}  # id(cq token) -> CQ
        self._closed = False
        ctx._children.add(self)

    def _locate(self, before: dict[int, str] | None) -> tuple[int, int | None]:
        """``(fd, struct ibv_comp_channel * or None)`` (see the package docstring)."""
        known = int(self._cc.fd) if before is None else None
        new: list[int] | None = None
        if before is not None:
            after = compat.event_fds()
            new = [fd for fd, t in after.items() if before.get(fd) != t]
        ctx = self._ctx
        if ctx._ctx_ptr:
            try:
                words = compat.object_words(self._cc)
            except Exception:  # pragma: no cover - non-CPython
                words = []
            found = compat.find_channel(words, ctx._ctx_ptr, ctx._mem.read, compat.is_event_fd,
                                        fd=known, candidates=new or None)
            if found is not None:
                return found[1], found[0]
        if known is not None:
            return known, None
        if new is not None and len(new) == 1:
            return new[0], None
        raise DeviceError(errno.EIO, "cannot determine the fd of the completion channel "
                          f"({self._pv.describe()}; new event fds: {new})")

    def get_event(self) -> IbvCQ | None:
        if self._closed:
            return None
        reader = self._reader
        if reader is not None:
            while True:
                try:
                    got = reader.get()
                except OSError as exc:
                    raise RDMAError(exc.errno or errno.EIO, str(exc)) from None
                if got is None:
                    return None
                cq_ptr, token = got
                cq = self._cqs.get(token)
                if cq is None:  # not ours (cannot happen): keep libibverbs' count right
                    reader.ack(cq_ptr, 1)
                    continue
                cq._cq_ptr = cq_ptr
                cq._events_got += 1
                return cq
        if not self._cqs:
            return None
        (cq,) = self._cqs.values()
        try:
            self._cc.get_cq_event(cq._cq)
        except self._pv.Error as exc:
            code = compat.errno_of(exc, 0)
            if code in (errno.EAGAIN, errno.EWOULDBLOCK) or not _readable(self.fd):
                return None
            raise RDMAError(code or errno.EIO, f"ibv_get_cq_event: {exc}") from None
        cq._events_got += 1
        return cq

    def close(self) -> None:
        if self._closed:
            return
        if self._cqs:
            raise RDMAError(errno.EBUSY, f"completion channel still used by {len(self._cqs)} CQ(s)")
        try:
            self._cc.close()
        except self._pv.Error as exc:
            raise self._ctx._error(exc, "ibv_destroy_comp_channel") from None
        self._closed = True
        self._ctx._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvCompChannel fd={self.fd}>"


class _Token:
    """The ``cq_context`` of a CQ: maps a CQ_ERR async event back to its CQ."""

    __slots__ = ("__weakref__",)


class IbvCQ(CQ):
    def __init__(self, ctx: IbvContext, cqe: int, channel: IbvCompChannel | None) -> None:
        self.context = ctx
        self._pv = ctx._pv
        if cqe < 1:
            raise RDMAError(errno.EINVAL, f"cqe={cqe} must be at least 1")
        if channel is not None:
            if channel._ctx is not ctx:
                raise RDMAError(errno.EINVAL, "completion channel of another device context")
            if channel._closed:
                raise RDMAError(errno.EINVAL, "completion channel is closed")
            if channel._reader is None and channel._cqs:
                raise RDMAError(errno.EBUSY, "this completion channel can serve one CQ only "
                                f"(its C struct was not found; {self._pv.describe()})")
        self._token = _Token()
        try:
            self._cq: Any = self._pv.cq.CQ(ctx._ctx, cqe, self._token,
                                           channel._cc if channel is not None else None, 0)
        except self._pv.Error as exc:
            raise ctx._error(exc, f"ibv_create_cq({cqe})") from None
        self.cqe = int(getattr(self._cq, "cqe", cqe))  # the device may round up
        self.channel: IbvCompChannel | None = channel
        # struct ibv_cq *: probed now (for polling through ctypes), else learnt from the
        # first channel event
        self._cq_ptr = 0
        self._poller: native.CQPoller | None = None
        self._locate(ctx)
        self._qps: dict[IbvQP, int] = {}
        self._events_got = 0
        self._events_acked = 0
        self._overrun = False
        self._closed = False
        ctx._cqs_by_token[id(self._token)] = self
        ctx._children.add(self)
        if channel is not None:
            channel._cqs[id(self._token)] = self

    def _locate(self, ctx: IbvContext) -> None:
        """Find this CQ's C struct and poll it through ``native.CQPoller`` from now on;
        pyverbs' ``CQ.poll`` stays the fallback (no context pointer, the probe found
        nothing, or ``AIORDMA_VERBS_POLL=pyverbs``)."""
        if not ctx._ctx_ptr or os.environ.get("AIORDMA_VERBS_POLL") == "pyverbs":
            return
        try:
            words = compat.object_words(self._cq)
        except Exception:  # pragma: no cover - non-CPython
            return
        ptr = compat.find_cq_pointer(words, ctx._ctx_ptr, id(self._token), ctx._mem.read)
        if not ptr:
            log.debug("aiordma: struct ibv_cq of %r not found; polling through pyverbs", self)
            return
        self._cq_ptr = ptr
        try:
            self._poller = native.CQPoller(ctx._ctx_ptr, ptr)
        except ValueError as exc:  # pragma: no cover - a provider without poll_cq
            log.debug("aiordma: %s; polling through pyverbs", exc)

    def _overrun_detected(self) -> None:
        """Completions were lost: the CQ is in error for good, and so is every QP using it
        (rxe leaves them in RTS; hardware moves them to ERR)."""
        self._overrun = True
        for qp in list(self._qps):
            qp._to_error()

    def poll(self, n: int = 16) -> list[WC]:
        if self._overrun:
            raise CQOverrunError()
        if self._closed:
            return []
        raws: Iterable[compat.RawWC]
        poller = self._poller
        if poller is not None:
            rc, raws = poller.poll(n)
            if rc <= 0:
                if rc == 0:
                    return []
                self._overrun_detected()
                raise CQOverrunError(f"completion queue overrun (ibv_poll_cq returned {rc})")
        else:
            try:
                _, pwcs = self._cq.poll(n)
            except self._pv.Error as exc:
                self._overrun_detected()
                raise CQOverrunError(f"completion queue overrun (ibv_poll_cq: {exc})") from None
            if not pwcs:
                return []
            raws = [compat.pwc_fields(p) for p in pwcs]
        qps = self.context._qps
        out: list[WC] = []
        for raw in raws:
            qp = qps.get(raw[6])
            hint = None
            if qp is not None:
                if raw[1] == 0 and raw[2] & _WC_RECV_BIT and qp.recv_cq is self:
                    # a successful receive (WorkQueues.completed, inlined for the most
                    # frequent completion): its receive slot comes free
                    rq = qp._queues.rq
                    if rq:
                        rq.popleft()
                    hint = WCOpcode.RECV
                else:
                    ok = raw[1] == 0
                    hint = qp._queues.completed(raw[0], ok, raw[2], qp.send_cq is self,
                                                qp.recv_cq is self)
                    if not ok:  # an error completion means the QP is in ERR now
                        qp._state = QPState.ERR
            out.append(compat.wc_from_fields(raw, hint))
        return out

    def req_notify(self, solicited_only: bool = False) -> None:
        try:
            self._cq.req_notify(1 if solicited_only else 0)
        except self._pv.Error as exc:
            raise RDMAError(compat.errno_of(exc), f"ibv_req_notify_cq: {exc}") from None

    def ack_events(self, n: int) -> None:
        n = min(n, self._events_got - self._events_acked)
        if n <= 0 or self._closed:
            return
        ch = self.channel
        if ch is not None and ch._reader is not None:
            ch._reader.ack(self._cq_ptr, n)
        else:
            self._cq.ack_events(n)
        self._events_acked += n

    def close(self) -> None:
        if self._closed:
            return
        check_cq_close(len(self._qps), self._events_got, self._events_acked)
        # Events queued on the channel but not read yet do not block ibv_destroy_cq (the
        # kernel counts an event as reported when it is read, and drops unread ones).
        ch = self.channel
        try:
            self._cq.close()
        except self._pv.Error as exc:
            raise self.context._error(exc, "ibv_destroy_cq") from None
        self._closed = True
        if ch is not None:
            ch._cqs.pop(id(self._token), None)
        self.context._cqs_by_token.pop(id(self._token), None)
        self.context._children.discard(self)

    def __repr__(self) -> str:
        return f"<IbvCQ cqe={self.cqe}>"


# ----------------------------------------------------------------------------------------
# QP
# ----------------------------------------------------------------------------------------


class IbvQP(QP):
    def __init__(self, pd: IbvPD, send_cq: IbvCQ, recv_cq: IbvCQ, cap: QPCap, pqp: Any) -> None:
        self.pd: IbvPD = pd
        self.send_cq: IbvCQ = send_cq
        self.recv_cq: IbvCQ = recv_cq
        self.cap = cap
        self._qp = pqp
        self._pv = pd._pv
        self._ctx = pd.context
        self.qp_num = int(pqp.qp_num)
        self._state = QPState.RESET
        self._queues = compat.WorkQueues(cap.max_send_wr, cap.max_recv_wr)
        # (addr, length, lkey) -> pyverbs SendWR / RecvWR, see _new_send_wr
        self._send_wrs: dict[tuple[int, int, int], Any] = {}
        self._recv_wrs: dict[tuple[int, int, int], Any] = {}
        self._closed = False
        self._ctx._qps[self.qp_num] = self
        pd._qps.add(self)
        for cq in (send_cq, recv_cq):
            cq._qps[self] = cq._qps.get(self, 0) + 1

    def __repr__(self) -> str:
        return f"<IbvQP qpn={self.qp_num:#x} state={self._state.name}>"

    @property
    def state(self) -> QPState:
        if self._closed:
            return self._state
        try:
            attr, _ = self._qp.query(self._pv.e["IBV_QP_STATE"])
            st = QPState(int(attr.qp_state))
        except (self._pv.Error, ValueError):
            return self._state
        self._state = st
        return st

    # --- modify --------------------------------------------------------------------------
    def _ah_attr(self, ah: AHAttr, port: Any) -> Any:
        pv = self._pv
        ib = int(port.link_layer) == int(LinkLayer.INFINIBAND)
        dgid = bytes(ah.dgid)
        if len(dgid) != 16:
            raise RDMAError(errno.EINVAL, "ah_attr.dgid must be 16 bytes")
        if ib:
            # LID addressing; a GRH only without a LID or towards another subnet.
            need_grh = ah.dlid == 0
            if not need_grh and ah.is_global and dgid != compat.ZERO_GID:
                try:
                    local = self._ctx.query_gid(ah.port_num or 1, ah.sgid_index)
                except RDMAError:
                    local = dgid
                need_grh = local[:8] != dgid[:8]
        else:
            need_grh = True  # RoCE: every packet carries a GRH (IP header)
        if need_grh:
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(_gid_str(dgid)),
                                     sgid_index=ah.sgid_index, hop_limit=ah.hop_limit or 64)
            return pv.addr.AHAttr(dlid=ah.dlid if ib else 0, sl=ah.sl, is_global=1,
                                  port_num=ah.port_num or 1, gr=gr)
        return pv.addr.AHAttr(dlid=ah.dlid, sl=ah.sl, is_global=0, port_num=ah.port_num or 1)

    def modify(self, attr: QPAttr) -> None:
        if self._closed:
            raise RDMAError(errno.EINVAL, "QP is closed")
        pv = self._pv
        e = pv.e
        cur = self._state
        new = QPState(attr.qp_state)
        pa = pv.qp.QPAttr(qp_state=int(new))
        mask = e["IBV_QP_STATE"]
        try:
            if new == QPState.INIT and cur in (QPState.RESET, QPState.INIT):
                pa.pkey_index = attr.pkey_index
                pa.port_num = attr.port_num
                pa.qp_access_flags = int(attr.qp_access_flags)
                mask |= e["IBV_QP_PKEY_INDEX"] | e["IBV_QP_PORT"] | e["IBV_QP_ACCESS_FLAGS"]
            elif new == QPState.RTR and cur == QPState.INIT:
                ah = attr.ah_attr
                if ah is None:
                    raise RDMAError(errno.EINVAL, "INIT->RTR needs ah_attr")
                port = self._ctx._port_attr(ah.port_num or attr.port_num or 1)
                dattr = self._ctx.query_device()
                pa.path_mtu = min(int(attr.path_mtu), int(port.active_mtu))
                pa.dest_qp_num = attr.dest_qp_num & 0xFFFFFF
                pa.rq_psn = attr.rq_psn & 0xFFFFFF
                pa.max_dest_rd_atomic = max(0, min(attr.max_dest_rd_atomic, dattr.max_qp_rd_atom))
                pa.min_rnr_timer = attr.min_rnr_timer
                pa.ah_attr = self._ah_attr(ah, port)
                mask |= (e["IBV_QP_AV"] | e["IBV_QP_PATH_MTU"] | e["IBV_QP_DEST_QPN"]
                         | e["IBV_QP_RQ_PSN"] | e["IBV_QP_MAX_DEST_RD_ATOMIC"]
                         | e["IBV_QP_MIN_RNR_TIMER"])
            elif new == QPState.RTS and cur == QPState.RTR:
                dattr = self._ctx.query_device()
                pa.timeout = attr.timeout
                pa.retry_cnt = attr.retry_cnt
                pa.rnr_retry = attr.rnr_retry
                pa.sq_psn = attr.sq_psn & 0xFFFFFF
                pa.max_rd_atomic = max(0, min(attr.max_rd_atomic, dattr.max_qp_init_rd_atom))
                mask |= (e["IBV_QP_TIMEOUT"] | e["IBV_QP_RETRY_CNT"] | e["IBV_QP_RNR_RETRY"]
                         | e["IBV_QP_SQ_PSN"] | e["IBV_QP_MAX_QP_RD_ATOMIC"])
            self._qp.modify(pa, mask)
        except pv.Error as exc:
            raise RDMAError(compat.errno_of(exc),
                            f"ibv_modify_qp {cur.name}->{new.name}: {exc}") from None
        except OverflowError as exc:  # a value that does not fit its C field
            raise RDMAError(errno.EINVAL, f"ibv_modify_qp {cur.name}->{new.name}: {exc}") from None
        self._state = new
        if new == QPState.RESET:
            self._queues.reset()

    def _to_error(self) -> None:
        """Move to ERR (any state may); errors are ignored (the QP may be gone)."""
        if self._closed:
            return
        try:
            self._qp.modify(self._pv.qp.QPAttr(qp_state=int(QPState.ERR)),
                            self._pv.e["IBV_QP_STATE"])
        except self._pv.Error as exc:
            log.debug("aiordma: moving QP %#x to ERR failed: %s", self.qp_num, exc)
            return
        self._state = QPState.ERR

    def _flush_posted(self) -> None:
        """WRs posted to a QP in ERR must complete with WR_FLUSH_ERR. rxe's user-space
        provider writes receive WQEs straight into the shared queue and the kernel only
        flushes when it next looks at the QP: modifying ERR -> ERR (legal, a no-op on
        hardware) makes it look now."""
        self._to_error()

    # --- posting -------------------------------------------------------------------------
    def post_send(self, wrs: list[SendWR]) -> None:
        st = self._state
        if self._closed or st in _NO_SEND_STATES:
            raise PostError(errno.EINVAL, f"post_send on a QP in {st.name}")
        n = len(wrs)
        if not n:
            return
        q = self._queues
        sq = q.sq
        if n > q.max_send - len(sq):
            raise PostError(errno.ENOMEM, f"send queue full ({len(sq)} of {q.max_send} in "
                            f"use, {n} more posted)")
        if n == 1 and len(wrs[0].sg_list) == 1:
            # One WR with one SGE (every frame of an endpoint): through the cached pyverbs
            # WR of its SGE (_new_send_wr), no chain to build or free; inlined, as this
            # runs for every message.
            wr = wrs[0]
            op = check_send_wr(wr, self.cap)[0]
            s = wr.sg_list[0]
            key = (s.addr, s.length, s.lkey)
            wr_id = wr.wr_id & _M64
            flags = int(wr.send_flags)
            try:
                p = self._send_wrs.get(key)
                if p is None:
                    p = self._new_send_wr(key)
                p.wr_id = wr_id
                p.opcode = op
                p.send_flags = flags
                kind = _OP_KIND[op]
                if kind:  # (a plain SEND uses none of the other fields: no call)
                    _set_op_fields(p, wr, kind)
                self._qp.post_send(p)
            except self._pv.Error as exc:
                raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
            except OverflowError as exc:
                raise InvalidWorkRequest(
                    f"a work request field is out of range: {exc}") from None
            sq.append((wr_id, flags & _F_SIGNALED != 0, WC_OPCODE_FOR_WR[op]))
            if st == QPState.ERR:
                self._flush_posted()
            return
        ops = [check_send_wr(wr, self.cap)[0] for wr in wrs]
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr, op in zip(reversed(wrs), reversed(ops), strict=True):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                kw: dict[str, Any] = {
                    "wr_id": wr.wr_id & _M64, "opcode": int(op), "num_sge": len(sg), "sg": sg,
                    "send_flags": int(wr.send_flags),
                }
                if head is not None:
                    kw["next_wr"] = head
                p = pvwr.SendWR(**kw)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                kind = _OP_KIND[op]
                if kind:
                    _set_op_fields(p, wr, kind)
                head = p
            self._qp.post_send(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:  # ibv_post_send copied them; free the C memory now
                obj.close()
            for s in sges:
                s.close()
        q.posted_send((wr.wr_id & _M64, bool(int(wr.send_flags) & _F_SIGNALED),
                       WC_OPCODE_FOR_WR[op]) for wr, op in zip(wrs, ops, strict=True))
        if st == QPState.ERR:
            self._flush_posted()

    @staticmethod
    def _cache_put(cache: dict[tuple[int, int, int], Any], key: tuple[int, int, int],
                   p: Any, limit: int = _WR_CACHE) -> None:
        if len(cache) >= limit:
            cache.pop(next(iter(cache))).close()  # the oldest
        cache[key] = p

    def _new_send_wr(self, key: tuple[int, int, int]) -> Any:
        """A new pyverbs SendWR for single-WR posts with the one SGE ``key`` = (addr,
        length, lkey), cached for re-use: building one costs two pyverbs objects (each a
        logger look-up and a malloc) and their ``close``; the device copies a WR when it
        is posted, so the object is free again as soon as ``post_send`` returns. The
        caller sets ``wr_id``, ``opcode``, ``send_flags`` and what its opcode uses (a
        cached WR keeps the values of its last post: a plain SEND reads none of the
        others). A cached WR is never chained (its ``next`` stays NULL). Posting happens
        on one thread (the event loop's)."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.SendWR(wr_id=0, opcode=int(WROpcode.SEND), num_sge=1, sg=[sge],
                            send_flags=0)
        finally:
            sge.close()  # SendWR copied it
        self._cache_put(self._send_wrs, key, p)
        return p

    def _new_recv_wr(self, key: tuple[int, int, int]) -> Any:
        """A new pyverbs RecvWR for the one-SGE receive ``key`` = (addr, length, lkey),
        cached for re-use like ``_new_send_wr``'s (one per receive buffer: the cache holds
        as many as the receive queue); the caller sets its ``wr_id``."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.RecvWR(wr_id=0, num_sge=1, sg=[sge])
        finally:
            sge.close()
        self._cache_put(self._recv_wrs, key, p, max(_WR_CACHE, self._queues.max_recv))
        return p

    def _post_recv_cached(self, wrs: list[RecvWR]) -> None:
        """Post one-SGE receives through their cached pyverbs WRs, one ibv_post_recv
        each (cheaper than building a chain of new objects). Like a chained post that
        fails at ``bad_wr``, the WRs before a failing one stay posted (and are recorded).
        This runs for every re-posted buffer: the wr_ids are recorded once per call."""
        post = self._qp.post_recv
        cache = self._recv_wrs
        posted: list[int] = []
        try:
            for wr in wrs:
                s = wr.sg_list[0]
                key = (s.addr, s.length, s.lkey)
                p = cache.get(key)
                if p is None:
                    p = self._new_recv_wr(key)
                wr_id = wr.wr_id & _M64
                p.wr_id = wr_id
                post(p)
                posted.append(wr_id)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            self._queues.posted_recv(posted)

    def post_recv(self, wrs: list[RecvWR]) -> None:
        st = self._state
        if self._closed or st == QPState.RESET:
            raise PostError(errno.EINVAL, f"post_recv on a QP in {st.name}")
        n = len(wrs)
        if not n:
            return
        q = self._queues
        if n > q.recv_room():
            raise PostError(errno.ENOMEM, f"receive queue full ({len(q.rq)} of {q.max_recv} "
                            f"in use, {n} more posted)")
        if check_recv_wrs(wrs, self.cap):
            self._post_recv_cached(wrs)
        else:
            self._post_recv_chain(wrs)
        if st == QPState.ERR:
            self._flush_posted()

    def _post_recv_chain(self, wrs: list[RecvWR]) -> None:
        """Post receives with any number of SGEs as one chain of new pyverbs WRs (freed
        after the post; an empty SGE list is posted as num_sge 0)."""
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr in reversed(wrs):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                if head is None:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg)
                else:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg, next_wr=head)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                head = p
            self._qp.post_recv(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:
                obj.close()
            for s in sges:
                s.close()
        self._queues.posted_recv(wr.wr_id & _M64 for wr in wrs)

    def close(self) -> None:
        if self._closed:
            return
        ctx = self._ctx
        # ibv_destroy_qp waits for the acks of the async events *read* for the QP: they
        # are acked as they are read, and unread ones are dropped by the kernel.
        try:
            self._qp.close()
        except self._pv.Error as exc:
            raise ctx._error(exc, "ibv_destroy_qp") from None
        self._closed = True
        self._queues.reset()
        for cache in (self._send_wrs, self._recv_wrs):
            for p in cache.values():
                p.close()
            cache.clear()
        if ctx._qps.get(self.qp_num) is self:
            del ctx._qps[self.qp_num]
        self.pd._qps.discard(self)
        for cq in (self.send_cq, self.recv_cq):
            k = cq._qps.get(self, 0) - 1
            if k <= 0:
                cq._qps.pop(self, None)
            else:
                cq._qps[self] = k


__all__ = ["IbverbsProvider", "IbvContext", "IbvPD", "IbvMR", "IbvCompChannel", "IbvCQ",
           "IbvQP", "InvalidWorkRequest", "Pyverbs", "load_pyverbs", "INSTALL_HINT"]
