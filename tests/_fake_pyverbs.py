"""A fake of the pyverbs API (the parts the ``verbs`` provider calls, with the behaviour of
rdma-core 44 and 65 where they differ) and of the C structs its ctypes and compiled data
paths touch, for the provider's tests without RDMA hardware."""

from __future__ import annotations

import ctypes
import errno
import os
import struct
import types
import weakref
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from aiordma.verbs import MTU, Access, AHAttr, QPAttr, QPCap, QPState
from aiordma.verbs.ibverbs import clib, compat, loader, probe, provider
from aiordma.verbs.ibverbs import context as ibv_context


class FakePyverbsError(Exception):
    """Like pyverbs' PyverbsRDMAError: message gets 'Errno: N, text' when a code is given."""

    def __init__(self, msg: str, error_code: int = -1) -> None:
        if error_code != -1:
            msg = f"{msg}. Errno: {error_code}, {os.strerror(error_code)}"
        super().__init__(msg)
        self.error_code = error_code


def _pwc(**kw: Any) -> types.SimpleNamespace:
    base = dict(wr_id=5, status=0, opcode=128, vendor_err=0, byte_len=10, qp_num=0x11,
                src_qp=0x22, imm_data=0, wc_flags=0)
    base.update(kw)
    return types.SimpleNamespace(**base)


class FakeVerbsABI:
    """The C structs the provider's ctypes and compiled data paths touch, in real memory:
    a ``struct ibv_context`` whose ``ops.poll_cq``, ``ops.req_notify_cq`` (``arms``),
    ``ops.post_send`` and ``ops.post_recv`` are C callbacks, and ``struct ibv_cq``/``ibv_qp`` that point to it
    (``new_cq``, ``new_qp``). ``poll_cq`` serves the completions queued on the fake
    pyverbs CQ of a CQ struct; the posts decode the chains they are given (``sends``,
    ``recvs``: one list of WR dicts per call) and fail at WR ``fail_at`` of a chain with
    ``fail_errno`` (setting ``*bad_wr``), as a device does."""

    def __init__(self) -> None:
        self.ctx = (ctypes.c_char * compat.CTX_PROBE_SIZE)()
        self.cqs: dict[int, Any] = {}  # struct ibv_cq * (real or not) -> FakeCQ
        self.qps: dict[int, int] = {}  # qp_num -> struct ibv_qp *
        self.calls: list[tuple[int, int]] = []
        self.sends: list[list[dict[str, Any]]] = []
        self.recvs: list[list[dict[str, Any]]] = []
        self.fail_at: int | None = None
        self.fail_errno = errno.ENOMEM
        self._mem: list[Any] = []
        self._poll_cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                         ctypes.c_void_p)(self._poll)
        post = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        self._send_cb = post(self._post_send)
        self._recv_cb = post(self._post_recv)
        self._modify_cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                           ctypes.c_int)(self._modify_qp)
        self.modifies: list[dict[str, Any]] = []  # what ibv_modify_qp was given
        self.modify_errno = 0  # what it returns
        self.qp_objects: dict[int, Any] = {}  # struct ibv_qp * -> fake pyverbs QP
        self.arms: list[tuple[int, int]] = []  # ibv_req_notify_cq's (cq, solicited_only)
        self.arm_errno = 0  # what it returns
        self._arm_cb = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int)(self._arm)
        for off, cb in ((compat.CTX_OPS_POLL_CQ_OFFSET, self._poll_cb),
                        (compat.CTX_OPS_REQ_NOTIFY_CQ_OFFSET, self._arm_cb),
                        (compat.CTX_OPS_POST_SEND_OFFSET, self._send_cb),
                        (compat.CTX_OPS_POST_RECV_OFFSET, self._recv_cb)):
            struct.pack_into("=Q", self.ctx, off, ctypes.cast(cb, ctypes.c_void_p).value)

    @property
    def ptr(self) -> int:
        return ctypes.addressof(self.ctx)

    def new_cq(self, fcq: Any, cq_context: int = 0) -> int:
        """A ``struct ibv_cq`` of this context serving ``fcq``; its address."""
        mem = (ctypes.c_char * 64)()
        struct.pack_into("=Q", mem, 0, self.ptr)
        struct.pack_into("=Q", mem, compat.CQ_CQ_CONTEXT_OFFSET, cq_context)
        self._mem.append(mem)
        addr = ctypes.addressof(mem)
        self.cqs[addr] = fcq
        return addr

    def new_qp(self, qp_num: int, send_cq: int, recv_cq: int) -> int:
        """A ``struct ibv_qp`` of this context; its address."""
        mem = (ctypes.c_char * 128)()
        struct.pack_into("=Q", mem, 0, self.ptr)
        struct.pack_into("=QQ", mem, compat.QP_SEND_CQ_OFFSET, send_cq, recv_cq)
        struct.pack_into("=I", mem, compat.QP_QP_NUM_OFFSET, qp_num)
        self._mem.append(mem)
        addr = ctypes.addressof(mem)
        self.qps[qp_num] = addr
        return addr

    @property
    def modify_qp_ptr(self) -> int:
        """The address of this fake's ``ibv_modify_qp`` (a C callback)."""
        return ctypes.cast(self._modify_cb, ctypes.c_void_p).value or 0

    def _modify_qp(self, qp: int, attr: int, mask: int) -> int:
        """Decode the ``struct ibv_qp_attr`` at the offsets of the headers the compiled
        path was built against (it alone calls this); on success the fake pyverbs QP
        takes the new state, as the kernel's would."""
        fp = loader.fastpath()
        assert fp is not None
        a = fp.abi()

        def u(field: str, fmt: str) -> int:
            off = a[f"ibv_qp_attr.{field}"]
            return int(struct.unpack_from(fmt, ctypes.string_at(attr + off, 4))[0])
        d: dict[str, Any] = {f: u(f, "=I") for f in ("qp_state", "path_mtu", "rq_psn",
                                                      "dest_qp_num")}
        d.update({f: u(f, "=B") for f in ("ah_attr.grh.sgid_index", "ah_attr.grh.hop_limit",
                                          "ah_attr.sl", "ah_attr.is_global",
                                          "ah_attr.port_num", "max_dest_rd_atomic",
                                          "min_rnr_timer")})
        d["ah_attr.dlid"] = u("ah_attr.dlid", "=H")
        d["ah_attr.grh.dgid"] = ctypes.string_at(attr + a["ibv_qp_attr.ah_attr.grh.dgid"], 16)
        d["mask"], d["qp"] = mask, qp
        self.modifies.append(d)
        if self.modify_errno:
            return self.modify_errno
        self.qp_objects[qp].state = d["qp_state"]
        return 0

    def _arm(self, cq: int, solicited_only: int) -> int:
        self.arms.append((cq, solicited_only))
        return self.arm_errno

    def _poll(self, cq: int, n: int, wc: int) -> int:
        self.calls.append((cq, n))
        fcq = self.cqs[cq]
        if fcq.fail is not None:
            return -errno.EOVERFLOW
        k = 0
        while fcq.wcs and k < n:
            out = (ctypes.c_char * compat.IBV_WC.size).from_address(wc + k * compat.IBV_WC.size)
            compat.IBV_WC.pack_into(out, 0, *compat.pwc_fields(fcq.wcs.popleft()), 0, 0, 0, 0)
            k += 1
        return k

    @staticmethod
    def _sges(addr: int, n: int) -> list[tuple[int, int, int]]:
        return [struct.unpack("=QII", ctypes.string_at(addr + 16 * i, 16)) for i in range(n)]

    def _chain(self, wr: int, decode: Callable[[int], dict[str, Any]], bad: int,
               out: list[list[dict[str, Any]]]) -> int:
        chain: list[dict[str, Any]] = []
        i = 0
        while wr:
            if i == self.fail_at:
                ctypes.c_void_p.from_address(bad).value = wr
                out.append(chain)
                return self.fail_errno
            d = decode(wr)
            chain.append(d)
            wr = d["next"]
            i += 1
        out.append(chain)
        return 0

    def _post_send(self, qp: int, wr: int, bad: int) -> int:
        def decode(a: int) -> dict[str, Any]:
            wr_id, nxt, sg, num_sge, opcode, flags, imm = struct.unpack(
                "=QQQiiII", ctypes.string_at(a, 40))
            rdma = struct.unpack("=QI", ctypes.string_at(a + 40, 12))
            atomic = struct.unpack("=QQQI", ctypes.string_at(a + 40, 28))
            return dict(wr_id=wr_id, next=nxt, sg=self._sges(sg, num_sge), num_sge=num_sge,
                        opcode=opcode, send_flags=flags, imm_data=imm, rdma=rdma,
                        atomic=(atomic[3], atomic[0], atomic[1], atomic[2]), qp=qp)
        return self._chain(wr, decode, bad, self.sends)

    def _post_recv(self, qp: int, wr: int, bad: int) -> int:
        def decode(a: int) -> dict[str, Any]:
            wr_id, nxt, sg, num_sge = struct.unpack("=QQQi", ctypes.string_at(a, 28))
            return dict(wr_id=wr_id, next=nxt, sg=self._sges(sg, num_sge), num_sge=num_sge,
                        qp=qp)
        return self._chain(wr, decode, bad, self.recvs)


V4GID = "0000:0000:0000:0000:0000:ffff:0a00:020f"  # 10.0.2.15


class FakeDevice:
    def __init__(self, name: bytes) -> None:
        self.name = name  # bytes, as pyverbs returns it


class FakeContext:
    ports = {1: dict(state=4, active_mtu=3, max_mtu=5, lid=0, gid_tbl_len=8, link_layer=2,
                     max_msg_sz=1 << 31)}

    def __init__(self, name: str) -> None:
        self.name = name
        self.cmd_fd = 3
        self.closed = False
        self.async_events: deque[int] = deque()

    def query_device(self) -> Any:
        return types.SimpleNamespace(
            phys_port_cnt=1, max_qp_wr=16384, max_sge=32, max_cqe=65536, max_mr_size=1 << 40,
            max_qp_rd_atom=8, max_qp_init_rd_atom=4, atomic_caps=1, vendor_id=0x1234,
            vendor_part_id=1, fw_version=b"1.0")

    def query_port(self, port: int) -> Any:
        if port not in self.ports:
            raise FakePyverbsError("Failed to query port", errno.EINVAL)
        return types.SimpleNamespace(**self.ports[port])

    def query_gid(self, port: int, index: int) -> str:
        return V4GID if index == 1 else "0000:0000:0000:0000:0000:0000:0000:0000"

    def get_async_event(self) -> Any:
        et = self.async_events.popleft()
        ev = types.SimpleNamespace(event_type=et, acked=False)
        ev.ack = lambda: setattr(ev, "acked", True)
        return ev

    def close(self) -> None:
        self.closed = True


class FakePD:
    def __init__(self, ctx: FakeContext) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeMR:
    next_key = 0x100

    def __init__(self, pd: FakePD, length: int, access: int, address: int | None = None) -> None:
        if access & 0x2 and not access & 0x1:
            raise FakePyverbsError("Failed to register a MR", errno.EINVAL)
        self.length, self.access, self.address = length, access, address
        FakeMR.next_key += 1
        self.lkey = self.rkey = FakeMR.next_key
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeCompChannel:
    """rdma-core 57+: has ``fd``; get_cq_event raises EAGAIN when nothing is queued."""

    def __init__(self, ctx: FakeContext) -> None:
        self._r, self._w = os.pipe()
        self.queued = 0
        self.closed = False

    @property
    def fd(self) -> int:
        return self._r

    def push(self) -> None:
        self.queued += 1
        os.write(self._w, b"x")

    def get_cq_event(self, cq: FakeCQ) -> None:
        if not self.queued:
            raise FakePyverbsError("Failed to get CQ event", errno.EAGAIN)
        self.queued -= 1
        os.read(self._r, 1)
        cq.num_events += 1

    def close(self) -> None:
        self.closed = True
        os.close(self._r)
        os.close(self._w)


class FakeCQ:
    def __init__(self, ctx: FakeContext, cqe: int, cq_context: Any, channel: Any,
                 comp_vector: int) -> None:
        self.cqe, self.cq_context, self.channel = cqe, cq_context, channel
        self.wcs: deque[Any] = deque()
        self.num_events = 0
        self.armed = 0
        self.closed = False
        self.fail: Exception | None = None

    def poll(self, n: int = 1) -> tuple[int, list[Any]]:
        if self.fail is not None:
            raise self.fail
        out = [self.wcs.popleft() for _ in range(min(n, len(self.wcs)))]
        return len(out), out

    def req_notify(self, solicited_only: int = 0) -> None:
        self.armed += 1

    def ack_events(self, n: int) -> None:
        self.num_events -= n

    def close(self) -> None:
        assert self.num_events == 0, "ibv_destroy_cq would block"
        self.closed = True


class _Rec:
    """A pyverbs-like record object: keyword fields, settable attributes, close()."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        self.args = args
        self.__dict__.update(kw)
        self.closed = False

    def close(self) -> None:
        self.closed = True


class FakeSGE(_Rec):
    def __init__(self, addr: int, length: int, lkey: int) -> None:
        super().__init__(addr=addr, length=length, lkey=lkey)


class FakeSendWR(_Rec):
    def __init__(self, wr_id: int = 0, opcode: int = 2, num_sge: int = 0, imm_data: int = 0,
                 sg: Any = None, send_flags: int = 2, next_wr: Any = None) -> None:
        if num_sge < 1 or sg is None:  # as pyverbs 44 and 65
            raise FakePyverbsError("A WR needs at least one SGE")
        if not 0 <= imm_data <= 0xFFFFFFFF:
            raise OverflowError("imm_data")
        super().__init__(wr_id=wr_id, opcode=opcode, num_sge=num_sge, imm_data=imm_data,
                         sg=[(s.addr, s.length, s.lkey) for s in sg], send_flags=send_flags,
                         next_wr=next_wr, rdma=None, atomic=None)

    def set_wr_rdma(self, rkey: int, addr: int) -> None:
        self.rdma = (rkey, addr)

    def set_wr_atomic(self, rkey: int, addr: int, compare_add: int, swap: int = 0) -> None:
        self.atomic = (rkey, addr, compare_add, swap)


class FakeRecvWR(_Rec):
    def __init__(self, wr_id: int = 0, num_sge: int = 0, sg: Any = None,
                 next_wr: Any = None) -> None:
        if num_sge < 1 or sg is None:  # pyverbs 44
            raise FakePyverbsError("A WR needs at least one SGE")
        super().__init__(wr_id=wr_id, num_sge=num_sge,
                         sg=[(s.addr, s.length, s.lkey) for s in sg], next_wr=next_wr)


class FakeQP:
    def __init__(self, pd: FakePD, init: _Rec) -> None:
        self.init = init
        self.qp_num = 0x11
        self.state = 0
        self.sends: list[list[FakeSendWR]] = []
        self.recvs: list[list[FakeRecvWR]] = []
        self.modified: list[tuple[FakeQPAttr, int]] = []
        self.refuse: Exception | None = None
        self.closed = False

    @staticmethod
    def _chain(head: Any) -> list[Any]:
        out = []
        while head is not None:
            assert not head.closed, "posted after close()"
            out.append(head)
            head = head.next_wr
        return out

    def post_send(self, head: FakeSendWR) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.sends.append(self._chain(head))

    def post_recv(self, head: FakeRecvWR) -> None:
        if self.refuse is not None:
            raise self.refuse
        self.recvs.append(self._chain(head))

    def modify(self, attr: FakeQPAttr, mask: int) -> None:
        if attr.qp_state == 3 and self.state != 2:
            raise FakePyverbsError("Failed to modify QP", errno.EINVAL)
        self.modified.append((attr, mask))
        self.state = attr.qp_state

    def query(self, mask: int) -> tuple[Any, Any]:
        return types.SimpleNamespace(qp_state=self.state), None

    def close(self) -> None:
        self.closed = True


class FakeQPAttr(_Rec):
    def __init__(self, qp_state: int = 1) -> None:
        super().__init__()
        self.qp_state = qp_state


def fake_pyverbs(devices: list[bytes] | None = None) -> Any:
    pv = types.SimpleNamespace()
    pv.device = types.SimpleNamespace(
        Context=lambda name: FakeContext(name),
        get_device_list=lambda: [FakeDevice(n) for n in (devices or [b"rxe0"])])
    pv.pd = types.SimpleNamespace(PD=FakePD)
    pv.mr = types.SimpleNamespace(MR=FakeMR)
    pv.cq = types.SimpleNamespace(CQ=FakeCQ, CompChannel=FakeCompChannel)
    pv.qp = types.SimpleNamespace(QP=FakeQP, QPCap=_Rec, QPInitAttr=_Rec, QPAttr=FakeQPAttr)
    pv.wr = types.SimpleNamespace(SGE=FakeSGE, SendWR=FakeSendWR, RecvWR=FakeRecvWR)
    pv.addr = types.SimpleNamespace(GID=lambda s: ("GID", s), GlobalRoute=_Rec, AHAttr=_Rec)
    pv.Error = FakePyverbsError
    pv.version = (44,)
    pv.e = compat.EnumTable(None)
    pv.channel_has_fd = True
    pv.context_ptr_property = False
    pv.describe = lambda: "fake pyverbs"
    return pv


def install_fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fake pyverbs installed in the provider; the async fd is a pipe (a test module's
    ``fake`` fixture yields from this). At teardown every context opened meanwhile and
    left open is released (``IbvContext._release_all``) while the fake, its pipe and
    any ``FakeVerbsABI`` memory still exist: a context dropped open would otherwise be
    released by its finalizer whenever the GC collects it, through C pointers and fds
    that are gone by then."""
    pv = fake_pyverbs()
    monkeypatch.setattr(loader, "_pyverbs", pv)
    monkeypatch.setitem(ibv_context._inline_cache, "rxe0", 256)
    r, w = os.pipe()
    calls = iter([{}, {r: "anon_inode:[infinibandevent]"}])
    # the first call is before ibv_open_device, the second after it
    monkeypatch.setattr(probe, "event_fds", lambda proc_fd=None: next(calls, {}))
    pv.async_pipe = (r, w)
    # (weak references: a test may drop a context for the GC to finalize)
    opened: list[weakref.ref[ibv_context.IbvContext]] = []
    init = ibv_context.IbvContext.__init__

    def tracked_init(self: ibv_context.IbvContext, name: str) -> None:
        opened.append(weakref.ref(self))
        init(self, name)

    monkeypatch.setattr(ibv_context.IbvContext, "__init__", tracked_init)
    yield pv
    for ref in opened:
        ctx = ref()
        if ctx is not None and not getattr(ctx, "_closed", True):
            ctx._release_all()
    for fd in (r, w):
        try:
            os.close(fd)
        except OSError:
            pass


def _open(fake: Any) -> ibv_context.IbvContext:
    ctx = provider.IbverbsProvider().open()
    assert isinstance(ctx, ibv_context.IbvContext)
    return ctx


def _qp_setup(fake: Any, cap: QPCap | None = None, shared: bool = True) -> tuple[Any, ...]:
    ctx = _open(fake)
    pd = ctx.alloc_pd()
    ch = ctx.create_comp_channel()
    cq = ctx.create_cq(64, ch)
    rcq = cq if shared else ctx.create_cq(64)
    qp = pd.create_qp(cq, rcq, cap or QPCap(max_send_wr=4, max_recv_wr=4, max_send_sge=2,
                                            max_recv_sge=2, max_inline_data=64))
    return ctx, pd, ch, cq, rcq, qp


def _to_rts(qp: Any) -> None:
    qp.modify(QPAttr(QPState.INIT, qp_access_flags=Access.LOCAL_WRITE | Access.REMOTE_WRITE))
    qp.modify(QPAttr(QPState.RTR, path_mtu=MTU.MTU_4096, dest_qp_num=0x22, rq_psn=7,
                     max_dest_rd_atomic=16,
                     ah_attr=AHAttr(dgid=compat.gid_from_str(V4GID), sgid_index=1)))
    qp.modify(QPAttr(QPState.RTS, sq_psn=9, max_rd_atomic=16))


def install_abi(fake: Any, monkeypatch: pytest.MonkeyPatch, qps: bool = False) -> FakeVerbsABI:
    """Make the provider find a ``FakeVerbsABI`` context as the fake pyverbs context's C
    struct, a real ``struct ibv_cq`` for each CQ (served by its fake pyverbs CQ) and, with
    ``qps``, a ``struct ibv_qp`` for each QP: then it polls (and, with ``qps``, posts)
    through the ctypes or the compiled data path instead of pyverbs."""
    c = FakeVerbsABI()
    created: list[Any] = []
    real = fake.cq.CQ

    def make_cq(*args: Any) -> Any:
        fcq = real(*args)
        created.append(fcq)
        return fcq

    def find_cq(words: Any, ctx_ptr: int, token: int, read: Any) -> int:
        assert ctx_ptr == c.ptr
        (fcq,) = [f for f in created if id(f.cq_context) == token]
        return c.new_cq(fcq, token)

    qps_made: list[Any] = []
    real_qp = fake.qp.QP

    def make_qp(*args: Any, **kw: Any) -> Any:
        fqp = real_qp(*args, **kw)
        qps_made.append(fqp)
        return fqp

    def find_qp(words: Any, ctx_ptr: int, qp_num: int, send_cq: int, recv_cq: int,
                read: Any) -> int:
        assert ctx_ptr == c.ptr and send_cq in c.cqs and recv_cq in c.cqs
        ptr = c.new_qp(qp_num, send_cq, recv_cq)
        c.qp_objects[ptr] = qps_made[-1]  # IbvQP looks for it right after creating it
        return ptr

    monkeypatch.setattr(fake.cq, "CQ", make_cq)
    monkeypatch.setattr(probe, "find_cq_pointer", find_cq)
    if qps:
        monkeypatch.setattr(fake.qp, "QP", make_qp)
        monkeypatch.setattr(probe, "find_qp_pointer", find_qp)
        monkeypatch.setattr(clib, "modify_qp_address", lambda: c.modify_qp_ptr)
    monkeypatch.setattr(ibv_context.IbvContext, "_find_ctx_ptr", lambda self: c.ptr)
    # the async fd is read from the (fake) context struct: make it the fake's pipe
    struct.pack_into("=i", c.ctx, compat.CTX_ASYNC_FD_OFFSET, fake.async_pipe[0])
    return c
