"""Unit tests of the ``verbs`` provider's compatibility shims, without pyverbs.

``aiordma.verbs.ibverbs.compat`` and ``clib`` are pure Python / ctypes; the provider
objects are exercised against a small fake of the pyverbs API (the parts the provider
calls, with the behaviour of rdma-core 44 and 65 where they differ). The real thing runs
in the Soft-RoCE VM (tests/rxe/).
"""

from __future__ import annotations

import ctypes
import enum
import errno
import gc
import mmap
import os
import socket
import struct
import sys
import types
from collections import deque
from collections.abc import Iterator
from typing import Any

import pytest
from _fake_pyverbs import (
    V4GID,
    FakeContext,
    FakeDevice,
    FakePyverbsError,
    FakeVerbsABI,
    _open,
    _pwc,
    _qp_setup,
    _to_rts,
    install_abi,
    install_fake,
)

from aiordma.errors import (
    CQOverrunError,
    DeviceError,
    PostError,
    RDMAError,
    RegistrationError,
)
from aiordma.verbs import (
    SGE,
    Access,
    EventType,
    QPAttr,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WCFlags,
    WCOpcode,
    WCStatus,
    WROpcode,
)
from aiordma.verbs.ibverbs import channel as ibv_channel
from aiordma.verbs.ibverbs import clib, compat, loader, probe, provider
from aiordma.verbs.ibverbs.queues import WorkQueues


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    yield from install_fake(monkeypatch)


# ----------------------------------------------------------------------------------------
# enums, versions, errors
# ----------------------------------------------------------------------------------------


def _importer(mods: dict[str, Any]) -> Any:
    def imp(name: str) -> Any:
        if name not in mods:
            raise ImportError(f"No module named {name!r}")
        return mods[name]
    return imp


def test_enums_from_rdma_core_44_flat_module() -> None:
    old = types.ModuleType("pyverbs.enums")
    old.IBV_QPT_RC = 2  # type: ignore[attr-defined]
    old.IBV_QP_STATE = 1  # type: ignore[attr-defined]
    old.IBV_WR_SEND = 2  # type: ignore[attr-defined]
    table = compat.import_enums(_importer({"pyverbs.enums": old}))
    assert table.source == "pyverbs.enums"
    assert table["IBV_QPT_RC"] == 2 and table["IBV_WR_SEND"] == 2
    assert table["IBV_QP_DEST_QPN"] == 1 << 20  # ABI fallback fills the gap


def test_enums_from_libibverbs_enums_classes_preferred() -> None:
    new = types.ModuleType("pyverbs.libibverbs_enums")

    class ibv_qp_type(enum.IntEnum):  # noqa: N801 - pyverbs' names
        IBV_QPT_RC = 2
        IBV_QPT_UD = 4

    class ibv_qp_attr_mask(enum.IntFlag):  # noqa: N801
        IBV_QP_STATE = 1
        IBV_QP_AV = 128

    new.ibv_qp_type = ibv_qp_type  # type: ignore[attr-defined]
    new.ibv_qp_attr_mask = ibv_qp_attr_mask  # type: ignore[attr-defined]
    old = types.ModuleType("pyverbs.enums")
    old.IBV_QPT_RC = 99  # type: ignore[attr-defined]  # must not be used
    table = compat.import_enums(_importer({"pyverbs.libibverbs_enums": new,
                                           "pyverbs.enums": old}))
    assert table.source == "pyverbs.libibverbs_enums"
    assert table["IBV_QPT_RC"] == 2 and table["IBV_QPT_UD"] == 4
    assert table["IBV_QP_AV"] == 128
    assert "IBV_QPT_RC" in table and table.get("IBV_NOPE") is None


def test_enums_missing() -> None:
    with pytest.raises(ImportError, match="no pyverbs enum module"):
        compat.import_enums(_importer({}))


def test_parse_version() -> None:
    assert compat.parse_version("65.0") == (65, 0)
    assert compat.parse_version("44") == (44,)
    assert compat.parse_version(None) is None
    assert compat.parse_version("dev") is None


def test_errno_of() -> None:
    assert compat.errno_of(FakePyverbsError("x", errno.EAGAIN)) == errno.EAGAIN
    assert compat.errno_of(FakePyverbsError("x", -errno.ENOMEM)) == errno.ENOMEM
    assert compat.errno_of(FakePyverbsError("x")) == errno.EINVAL  # -1: unknown
    assert compat.errno_of(FakePyverbsError("x"), 0) == 0
    assert compat.errno_of(RuntimeError("Failed. Errno: 12, Cannot allocate memory")) == 12


# ----------------------------------------------------------------------------------------
# fd discovery
# ----------------------------------------------------------------------------------------


def _fake_proc_fd(tmp_path: Any, links: dict[int, str]) -> str:
    d = tmp_path / "fd"
    d.mkdir(exist_ok=True)
    for p in d.iterdir():
        p.unlink()
    for fd, target in links.items():
        os.symlink(target, d / str(fd))
    return str(d)


def test_event_fds_and_new_event_fd(tmp_path: Any) -> None:
    ev = "anon_inode:[infinibandevent]"
    proc = _fake_proc_fd(tmp_path, {0: "/dev/null", 3: "/dev/infiniband/uverbs0", 4: ev,
                                    5: "socket:[123]", 6: "anon_inode:[eventfd]"})
    before = probe.event_fds(proc)
    assert before == {4: ev}
    proc = _fake_proc_fd(tmp_path, {0: "/dev/null", 3: "/dev/infiniband/uverbs0", 4: ev,
                                    5: "socket:[123]", 7: ev})
    after = probe.event_fds(proc)
    assert probe.new_event_fd(before, after) == 7
    assert probe.new_event_fd(after, after) is None  # nothing new
    assert probe.new_event_fd({}, after) is None  # ambiguous: two new ones
    assert probe.event_fds(str(tmp_path / "missing")) == {}
    assert probe.is_event_fd_target(ev)
    assert not probe.is_event_fd_target("/dev/infiniband/uverbs0")


def test_set_nonblocking() -> None:
    r, w = os.pipe()
    try:
        probe.set_nonblocking(r)
        assert not os.get_blocking(r)
        with pytest.raises(BlockingIOError):
            os.read(r, 1)
    finally:
        os.close(r)
        os.close(w)


def test_proc_self_mem_reads_safely() -> None:
    mem = probe.ProcSelfMem()
    try:
        buf = ctypes.create_string_buffer(b"hello world", 16)
        assert mem.read(ctypes.addressof(buf), 11) == b"hello world"
        # an address that was mapped and is not any more: no crash, just None
        m = mmap.mmap(-1, mmap.PAGESIZE)
        cbuf = (ctypes.c_char * mmap.PAGESIZE).from_buffer(m)
        addr = ctypes.addressof(cbuf)
        assert mem.read(addr, 8) == b"\0" * 8
        del cbuf
        m.close()
        assert mem.read(addr, 8) is None
        assert mem.read(8, 8) is None  # NULL page: refused without a syscall
        assert mem.read(1 << 60, 8) is None
    finally:
        mem.close()


def _fake_context_struct(cmd_fd: int, async_fd: int, ncv: int = 1) -> ctypes.Array[Any]:
    buf = (ctypes.c_char * compat.CTX_PROBE_SIZE)()
    struct.pack_into("=iii", buf, compat.CTX_CMD_FD_OFFSET, cmd_fd, async_fd, ncv)
    return buf


def test_find_context_pointer_in_real_memory() -> None:
    mem = probe.ProcSelfMem()
    good = _fake_context_struct(cmd_fd=7, async_fd=9)
    wrong_fd = _fake_context_struct(cmd_fd=8, async_fd=9)
    no_async = _fake_context_struct(cmd_fd=7, async_fd=-1)
    junk = object()
    words = [0, 12345, id(junk), ctypes.addressof(wrong_fd), ctypes.addressof(no_async),
             ctypes.addressof(good), 0xDEAD0000, 1 << 50]
    try:
        found = probe.find_context_pointer(words, 7, mem.read, lambda fd: fd == 9)
        assert found == ctypes.addressof(good)
        # the async fd must be an open verbs event file
        assert probe.find_context_pointer(words, 7, mem.read, lambda fd: False) is None
        # two qualifying words: refuse to guess
        twin = _fake_context_struct(cmd_fd=7, async_fd=9)
        assert probe.find_context_pointer(words + [ctypes.addressof(twin)], 7, mem.read,
                                           lambda fd: True) is None
    finally:
        mem.close()


def test_find_channel_in_real_memory() -> None:
    mem = probe.ProcSelfMem()
    ctx_ptr = 0x55550000
    chan = (ctypes.c_char * compat.CHANNEL_SIZE)()
    struct.pack_into("=Qii", chan, 0, ctx_ptr, 11, 0)
    other = (ctypes.c_char * compat.CHANNEL_SIZE)()
    struct.pack_into("=Qii", other, 0, ctx_ptr + 8, 12, 0)
    words = [ctypes.addressof(other), 3, ctypes.addressof(chan), ctypes.addressof(chan)]
    want = (ctypes.addressof(chan), 11)
    try:
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: True) == want
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: True, fd=11) == want
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: True, fd=12) is None
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: True,
                                   candidates=[11, 13]) == want
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: True,
                                   candidates=[13]) is None
        assert probe.find_channel(words, ctx_ptr, mem.read, lambda fd: fd != 11) is None
    finally:
        mem.close()


def test_find_cq_pointer_in_real_memory() -> None:
    mem = probe.ProcSelfMem()
    ctx_ptr, token = 0x55550000, 0x66660000
    cq = (ctypes.c_char * compat.CQ_PROBE_SIZE)()
    struct.pack_into("=QQQ", cq, 0, ctx_ptr, 0, token)
    other_ctx = (ctypes.c_char * compat.CQ_PROBE_SIZE)()
    struct.pack_into("=QQQ", other_ctx, 0, ctx_ptr + 8, 0, token)
    other_token = (ctypes.c_char * compat.CQ_PROBE_SIZE)()
    struct.pack_into("=QQQ", other_token, 0, ctx_ptr, 0, token + 8)
    words = [7, ctypes.addressof(other_ctx), ctypes.addressof(cq), ctypes.addressof(other_token),
             ctypes.addressof(cq), 1 << 50]
    try:
        assert probe.find_cq_pointer(words, ctx_ptr, token, mem.read) == ctypes.addressof(cq)
        assert probe.find_cq_pointer(words, ctx_ptr, token + 16, mem.read) is None
        twin = (ctypes.c_char * compat.CQ_PROBE_SIZE)()
        struct.pack_into("=QQQ", twin, 0, ctx_ptr, 0, token)
        assert probe.find_cq_pointer(words + [ctypes.addressof(twin)], ctx_ptr, token,
                                      mem.read) is None  # two qualify: refuse to guess
    finally:
        mem.close()


def test_object_words_sees_the_fields_of_an_object() -> None:
    class Holder:
        __slots__ = ("a", "b")

        def __init__(self) -> None:
            self.a: object = None
            self.b: object = None

    h = Holder()
    h.a = x = object()
    h.b = y = ["list"]
    words = probe.object_words(h)
    assert id(x) in words and id(y) in words
    assert probe.plausible_pointer(id(x))
    assert not probe.plausible_pointer(7)


# ----------------------------------------------------------------------------------------
# immediate data and work completions
# ----------------------------------------------------------------------------------------


def test_imm_data_is_network_order_on_the_wire() -> None:
    for v in (0, 1, 0x01020304, 0xFFFFFFFF, 0xDEADBEEF):
        raw = compat.imm_to_wire(v)
        # the C field holds the bytes of the value in big-endian order
        assert struct.pack("=I", raw) == struct.pack(">I", v)
        assert compat.imm_from_wire(raw) == v
    assert compat.imm_to_wire(-1) == 0xFFFFFFFF


def test_convert_wc() -> None:
    wc = compat.convert_wc(_pwc(wc_flags=WCFlags.WITH_IMM, imm_data=socket.htonl(0xABCD),
                                opcode=129))
    assert wc.status is WCStatus.SUCCESS and wc.opcode is WCOpcode.RECV_RDMA_WITH_IMM
    assert wc.imm_data == 0xABCD and wc.byte_len == 10 and wc.qp_num == 0x11
    assert wc.src_qp == 0x22 and wc.wc_flags == WCFlags.WITH_IMM
    # imm_data is ignored without the flag
    assert compat.convert_wc(_pwc(imm_data=7)).imm_data == 0
    # error: the opcode is undefined, the provider's knowledge wins
    err = compat.convert_wc(_pwc(status=10, opcode=0, vendor_err=0x99),
                            opcode_hint=WCOpcode.RDMA_READ)
    assert err.status is WCStatus.REM_ACCESS_ERR and err.opcode is WCOpcode.RDMA_READ
    assert err.vendor_err == 0x99
    # unknown values
    assert compat.convert_wc(_pwc(status=77)).status is WCStatus.GENERAL_ERR
    assert compat.convert_wc(_pwc(opcode=6)).opcode is WCOpcode.SEND  # e.g. LOCAL_INV
    assert compat.convert_wc(_pwc(opcode=0x83)).opcode is WCOpcode.RECV
    # the struct ibv_wc layout that CQPoller unpacks: 48 bytes, fields at their offsets
    assert compat.IBV_WC.size == 48
    raw = compat.IBV_WC.pack(*compat.pwc_fields(_pwc(wr_id=1 << 63, byte_len=9)), 0xFFFF,
                             1, 2, 3)
    assert struct.unpack_from("=Q", raw, 0)[0] == 1 << 63
    assert struct.unpack_from("=I", raw, 20)[0] == 9  # byte_len
    assert struct.unpack_from("=I", raw, 28)[0] == 0x11 and raw[44:46] == b"\x02\x03"
    assert compat.wc_from_fields(compat.IBV_WC.unpack(raw)).wr_id == 1 << 63


def test_cq_poller_calls_ops_poll_cq() -> None:
    c = FakeVerbsABI()
    fcq = types.SimpleNamespace(wcs=deque(_pwc(wr_id=i) for i in range(5)), fail=None)
    c.cqs[0x4000] = fcq
    poller = clib.CQPoller(c.ptr, 0x4000, entries=2)
    n, raws = poller.poll(16)  # capped at the buffer's entries
    assert n == 2 and [r[0] for r in raws] == [0, 1] and c.calls == [(0x4000, 2)]
    n, raws = poller.poll(1)
    assert n == 1 and [compat.wc_from_fields(r).wr_id for r in raws] == [2]
    fcq.fail = True
    assert poller.poll(4)[0] < 0
    fcq.fail = None
    fcq.wcs.clear()
    n, raws = poller.poll(4)
    assert n == 0 and list(raws) == []
    with pytest.raises(ValueError):  # no ops.poll_cq
        clib.CQPoller(ctypes.addressof((ctypes.c_char * compat.CTX_PROBE_SIZE)()), 0x4000)


# ----------------------------------------------------------------------------------------
# GID selection from sysfs
# ----------------------------------------------------------------------------------------


def _sysfs(tmp_path: Any, gids: dict[int, tuple[str, str | None]], dev: str = "rxe0",
           port: int = 1) -> str:
    root = tmp_path / "infiniband"
    base = root / dev / "ports" / str(port)
    (base / "gids").mkdir(parents=True)
    (base / "gid_attrs" / "types").mkdir(parents=True)
    for i in range(8):
        gid, gtype = gids.get(i, ("0000:0000:0000:0000:0000:0000:0000:0000", None))
        (base / "gids" / str(i)).write_text(gid + "\n")
        if gtype is not None:
            (base / "gid_attrs" / "types" / str(i)).write_text(gtype + "\n")
    return str(root)


LINK_LOCAL = "fe80:0000:0000:0000:5054:00ff:fe12:3456"


def test_sysfs_gids_prefer_roce_v2(tmp_path: Any) -> None:
    root = _sysfs(tmp_path, {0: (LINK_LOCAL, "IB/RoCE v1"), 1: (LINK_LOCAL, "RoCE v2"),
                             2: (V4GID, "IB/RoCE v1"), 3: (V4GID, "RoCE v2")})
    entries = compat.read_sysfs_gids("rxe0", 1, root)
    assert entries is not None
    assert [e.index for e in entries] == [0, 1, 2, 3]  # zero GIDs are left out
    assert entries[3] == compat.GidEntry(3, compat.gid_from_str(V4GID), "RoCE v2")
    assert compat.select_gid_index(entries, "10.0.2.15", dev="rxe0", env={}) == 3
    assert compat.select_gid_index(entries, "fe80::5054:ff:fe12:3456", env={}) == 1
    # the peer on this host: the RoCE v2 IPv4 GID
    assert compat.select_gid_index(entries, "127.0.0.1", env={}) == 3
    assert compat.select_gid_index(entries, "0.0.0.0", env={}) == 3
    assert compat.select_gid_index(entries, "10.0.2.15", env={"AIORDMA_GID_INDEX": "2"}) == 2


def test_sysfs_gid_types_unknown(tmp_path: Any) -> None:
    root = _sysfs(tmp_path, {1: (V4GID, None)})
    entries = compat.read_sysfs_gids("rxe0", 1, root)
    assert entries == [compat.GidEntry(1, compat.gid_from_str(V4GID), None)]
    assert compat.select_gid_index(entries, "10.0.2.15", env={}) == 1
    assert compat.read_sysfs_gids("mlx5_0", 1, root) is None


def test_no_matching_gid_is_a_clear_error(tmp_path: Any) -> None:
    root = _sysfs(tmp_path, {0: (LINK_LOCAL, "RoCE v2"), 1: (V4GID, "RoCE v2")})
    entries = compat.read_sysfs_gids("rxe0", 1, root)
    assert entries is not None
    with pytest.raises(DeviceError) as ei:
        compat.select_gid_index(entries, "10.9.9.9", dev="rxe0", port=1, env={})
    msg = str(ei.value)
    assert "no GID on rxe0 port 1 matches 10.9.9.9" in msg
    assert "1=10.0.2.15 (RoCE v2)" in msg and "fe80::5054:ff:fe12:3456" in msg
    assert ei.value.errno == errno.ENODEV
    with pytest.raises(DeviceError, match="not an IP address"):
        compat.select_gid_index(entries, "rxe0", env={})
    with pytest.raises(DeviceError, match="AIORDMA_GID_INDEX"):
        compat.select_gid_index(entries, "10.0.2.15", env={"AIORDMA_GID_INDEX": "x"})
    with pytest.raises(DeviceError, match="no GID"):
        compat.select_gid_index([], "127.0.0.1", env={})


def test_gid_helpers() -> None:
    assert compat.gid_for_ip("10.0.2.15") == compat.gid_from_str(V4GID)
    assert compat.gid_for_ip("::1") == b"\0" * 15 + b"\1"
    assert compat.format_gid(compat.gid_from_str(V4GID)) == "10.0.2.15"
    with pytest.raises(ValueError):
        compat.gid_from_str("00:11")


# ----------------------------------------------------------------------------------------
# queue accounting
# ----------------------------------------------------------------------------------------


def test_unsignaled_slots_come_free_with_a_later_signaled_completion() -> None:
    q = WorkQueues(max_send=4, max_recv=2)
    q.posted_send([(1, False, WCOpcode.SEND), (2, False, WCOpcode.RDMA_WRITE),
                   (3, True, WCOpcode.SEND)])
    assert q.send_room() == 1
    assert q.completed(3, True, 0, True, False) is WCOpcode.SEND
    assert q.send_room() == 4


def test_error_completion_of_an_unsignaled_wr_and_flushes() -> None:
    q = WorkQueues(max_send=8, max_recv=8)
    q.posted_send([(1, False, WCOpcode.SEND), (2, False, WCOpcode.RDMA_READ),
                   (3, True, WCOpcode.SEND)])
    q.posted_recv([10, 11])
    # shared CQ: the failed unsignaled READ (opcode undefined) is found by wr_id
    assert q.completed(2, False, 0, True, True) is WCOpcode.RDMA_READ
    assert len(q.sq) == 1
    assert q.completed(3, False, 0, True, True) is WCOpcode.SEND  # flushed
    assert q.completed(10, False, 0, True, True) is WCOpcode.RECV  # flushed receive
    assert q.completed(11, False, 0, True, True) is WCOpcode.RECV
    assert q.send_room() == 8 and q.recv_room() == 8
    assert q.completed(99, False, 0, True, True) is None  # unknown: nothing released


def test_successful_completions_on_separate_and_shared_cqs() -> None:
    q = WorkQueues(max_send=8, max_recv=8)
    q.posted_send([(7, True, WCOpcode.SEND)])
    q.posted_recv([7])  # the same wr_id on both queues
    assert q.completed(7, True, 128, True, True) is WCOpcode.RECV
    assert len(q.rq) == 0 and len(q.sq) == 1
    assert q.completed(7, True, 0, True, False) is WCOpcode.SEND
    q.posted_send([(1, True, WCOpcode.SEND)])
    q.reset()
    assert q.send_room() == 8


def test_the_queues_are_rings_that_wrap_at_their_depth() -> None:
    """Posting and completing past the depth many times over: the oldest entry is
    always the one released, a full queue refuses one more, the tuples read back in
    order."""
    q = WorkQueues(max_send=3, max_recv=2)
    for i in range(10):
        q.posted_send([(100 + i, i % 2 == 0, WCOpcode.SEND), (200 + i, True, WCOpcode.RDMA_READ)])
        assert q.sq == ((100 + i, i % 2 == 0, WCOpcode.SEND), (200 + i, True, WCOpcode.RDMA_READ))
        with pytest.raises(OverflowError):
            q.posted_send([(1, True, WCOpcode.SEND)] * 2)
        assert q.completed(200 + i, True, 2, True, False) is WCOpcode.RDMA_READ
        assert q.send_room() == 3
        q.posted_recv([300 + i, 400 + i])
        assert q.rq == (300 + i, 400 + i) and q.recv_room() == 0
        q.recv_completed()
        assert q.rq == (400 + i,)
        assert q.completed(400 + i, True, 128, False, True) is WCOpcode.RECV
    assert q.completed(1, True, 0, True, False) is None and q.recv_room() == 2
    with pytest.raises(ValueError):
        WorkQueues(-1, 1)
    assert "send 0/3" in repr(q)


# ----------------------------------------------------------------------------------------
# native async events (ctypes) with a fake libibverbs
# ----------------------------------------------------------------------------------------


class FakeLib:
    def __init__(self, events: list[tuple[int, int]], fail_errno: int = errno.EAGAIN) -> None:
        self.events = deque(events)
        self.acked: list[tuple[int, int]] = []
        self.fail_errno = fail_errno
        self.cq_events: deque[tuple[int, int]] = deque()  # (struct ibv_cq *, cq_context)
        self.cq_acked: list[tuple[int, int]] = []

    def ibv_get_cq_event(self, ch: Any, cq_ref: Any, ctx_ref: Any) -> int:
        if not self.cq_events:
            ctypes.set_errno(self.fail_errno)
            return -1
        cq_ref._obj.value, ctx_ref._obj.value = self.cq_events.popleft()
        return 0

    def ibv_ack_cq_events(self, cq: Any, n: int) -> None:
        self.cq_acked.append((cq.value, n))

    def ibv_get_async_event(self, ctx: Any, ref: Any) -> int:
        if not self.events:
            ctypes.set_errno(self.fail_errno)
            return -1
        etype, element = self.events.popleft()
        ref._obj.event_type = etype
        ref._obj.element = element
        return 0

    def ibv_ack_async_event(self, ref: Any) -> None:
        self.acked.append((ref._obj.event_type, ref._obj.element or 0))


def test_native_async_reader_converts_then_acks_everything() -> None:
    qp = (ctypes.c_char * 64)()
    struct.pack_into("=I", qp, compat.QP_QP_NUM_OFFSET, 0x1234)
    cq = (ctypes.c_char * 32)()
    struct.pack_into("=Q", cq, compat.CQ_CQ_CONTEXT_OFFSET, 0xC0FFEE)
    qp_addr, cq_addr = ctypes.addressof(qp), ctypes.addressof(cq)
    lib = FakeLib([(1, qp_addr), (0, cq_addr), (10, 1), (99, 0)])
    seen: list[tuple[int, Any]] = []

    def convert(etype: int, element: int) -> tuple[int, Any] | None:
        if etype == 99:
            return None  # unknown type: acked, not reported
        if etype == 1:
            return (etype, clib.qp_num_of(element))
        if etype == 0:
            return (etype, clib.cq_context_of(element))
        return (etype, clib.element_port(element))

    reader = clib.AsyncReader(lib, 0x1000)
    seen = reader.drain(convert)
    assert seen == [(1, 0x1234), (0, 0xC0FFEE), (10, 1)]
    assert len(lib.acked) == 4  # every event is acked, the unknown one too
    assert reader.drain(convert) == []


def test_native_channel_reader() -> None:
    lib = FakeLib([])
    lib.cq_events.extend([(0x1000, 0xAA), (0x2000, 0xBB)])
    r = clib.ChannelReader(lib, 0x500)
    assert r.get() == (0x1000, 0xAA) and r.get() == (0x2000, 0xBB) and r.get() is None
    r.ack(0x1000, 2)
    assert lib.cq_acked == [(0x1000, 2)]
    lib.fail_errno = errno.EBADF
    with pytest.raises(OSError) as ei:
        r.get()
    assert ei.value.errno == errno.EBADF


def test_native_async_reader_stops_on_other_errors(caplog: Any) -> None:
    lib = FakeLib([], fail_errno=errno.EIO)
    assert clib.AsyncReader(lib, 0x1000).drain(lambda t, e: (t, e)) == []
    assert "ibv_get_async_event failed" in caplog.text


# ----------------------------------------------------------------------------------------
# the provider objects against a fake pyverbs
# ----------------------------------------------------------------------------------------


def test_provider_without_pyverbs_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loader, "_pyverbs", None)
    monkeypatch.setitem(sys.modules, "pyverbs", None)  # import pyverbs -> ImportError
    from aiordma.verbs import get_provider

    prov = get_provider("verbs")
    assert prov.name == "verbs"
    with pytest.raises(DeviceError, match="python3-pyverbs"):
        prov.list_devices()
    with pytest.raises(DeviceError, match="pip install pyverbs"):
        prov.open()


def test_list_devices_and_open(fake: Any) -> None:
    devs = provider.IbverbsProvider().list_devices()
    assert [d.name for d in devs] == ["rxe0"] and devs[0].active
    port = devs[0].ports[0]
    assert port.state.name == "ACTIVE" and port.link_layer.name == "ETHERNET"
    assert port.active_mtu.name == "MTU_1024"
    with pytest.raises(DeviceError, match="no RDMA device 'mlx5_0'; devices: rxe0"):
        provider.IbverbsProvider().open("mlx5_0")
    ctx = _open(fake)
    r, w = fake.async_pipe
    assert ctx.async_fd == r and not os.get_blocking(r)
    a = ctx.query_device()
    assert (a.max_qp_rd_atom, a.max_qp_init_rd_atom, a.max_inline_data) == (8, 4, 256)
    assert a.fw_ver == "1.0"
    p = ctx.query_port(1)
    assert p.active_mtu.name == "MTU_1024" and p.max_mtu.name == "MTU_4096"
    with pytest.raises(RDMAError) as ei:
        ctx.query_port(2)
    assert ei.value.errno == errno.EINVAL
    assert ctx.query_gid(1, 1) == compat.gid_from_str(V4GID)
    ctx.close()
    ctx.close()


def test_open_picks_the_first_active_device(monkeypatch: pytest.MonkeyPatch, fake: Any) -> None:
    fake.device.get_device_list = lambda: [FakeDevice(b"down0"), FakeDevice(b"rxe0")]

    class Ctx(FakeContext):
        def query_port(self, port: int) -> Any:
            p = super().query_port(port)
            if self.name == "down0":
                p.state = 1
            return p

    fake.device.Context = lambda name: Ctx(name)
    ctx = _open(fake)
    assert ctx.name == "rxe0"
    fake.device.get_device_list = lambda: [FakeDevice(b"down0")]
    with pytest.raises(DeviceError, match="no RDMA device with an ACTIVE port; devices: down0"):
        provider.IbverbsProvider().open()
    ctx.close()


def test_gid_index_for_uses_sysfs_then_the_device(monkeypatch: pytest.MonkeyPatch, fake: Any,
                                                  tmp_path: Any) -> None:
    ctx = _open(fake)
    root = _sysfs(tmp_path, {0: (LINK_LOCAL, "RoCE v2"), 1: (V4GID, "IB/RoCE v1"),
                             2: (V4GID, "RoCE v2")})
    real = compat.read_sysfs_gids
    monkeypatch.setattr(compat, "read_sysfs_gids",
                        lambda dev, port, root_=root: real(dev, port, root_))
    monkeypatch.delenv("AIORDMA_GID_INDEX", raising=False)
    assert ctx.gid_index_for("10.0.2.15") == 2
    monkeypatch.setattr(compat, "read_sysfs_gids", lambda dev, port: None)
    assert ctx.gid_index_for("10.0.2.15") == 1  # from ibv_query_gid
    with pytest.raises(DeviceError, match="no GID on rxe0 port 1 matches 10.1.1.1"):
        ctx.gid_index_for("10.1.1.1")
    FakeContext.ports = {1: dict(FakeContext.ports[1], link_layer=1, lid=5)}
    try:
        assert ctx.gid_index_for("10.1.1.1") == 0  # InfiniBand: LID addressing
        monkeypatch.setenv("AIORDMA_GID_INDEX", "3")
        assert ctx.gid_index_for("10.1.1.1") == 3
    finally:
        FakeContext.ports = {1: dict(FakeContext.ports[1], link_layer=2, lid=0)}
    ctx.close()


def test_reg_mr(fake: Any) -> None:
    ctx = _open(fake)
    pd = ctx.alloc_pd()
    buf = bytearray(b"abcdefgh")
    mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_READ)
    assert mr._mr.address == mr.addr and mr._mr.length == 8 == mr.length
    assert mr.view[:3] == b"abc" and mr.lkey == mr._mr.lkey
    with pytest.raises(BufferError):
        buf.extend(b"x")  # pinned while registered
    with pytest.raises(RegistrationError, match="LOCAL_WRITE"):
        pd.reg_mr(bytearray(8), Access.REMOTE_WRITE)
    with pytest.raises(RegistrationError, match="LOCAL_WRITE"):
        pd.reg_mr(bytearray(8), Access.REMOTE_ATOMIC | Access.REMOTE_READ)
    with pytest.raises(TypeError):
        pd.reg_mr(b"read-only")
    with pytest.raises(RegistrationError, match="empty"):
        pd.reg_mr(bytearray())
    with pytest.raises(RDMAError) as ei:
        pd.close()
    assert ei.value.errno == errno.EBUSY
    with pytest.raises(RDMAError):
        ctx.close()
    mr.close()
    mr.close()
    buf.extend(b"x")
    pd.close()
    ctx.close()


def test_modify_translates_attributes(fake: Any) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    init = qp._qp.init
    assert init.sq_sig_all == 0 and init.qp_type == 2
    _to_rts(qp)
    (a_init, m_init), (a_rtr, m_rtr), (a_rts, m_rts) = qp._qp.modified
    e = compat.ABI_ENUMS
    assert m_init == e["IBV_QP_STATE"] | e["IBV_QP_PKEY_INDEX"] | e["IBV_QP_PORT"] \
        | e["IBV_QP_ACCESS_FLAGS"]
    assert a_init.qp_access_flags == 3
    assert m_rtr & e["IBV_QP_AV"] and m_rtr & e["IBV_QP_DEST_QPN"]
    assert a_rtr.path_mtu == 3  # clamped to the port's active MTU
    assert a_rtr.max_dest_rd_atomic == 8  # clamped to max_qp_rd_atom
    assert a_rtr.dest_qp_num == 0x22 and a_rtr.rq_psn == 7
    ah = a_rtr.ah_attr
    assert ah.is_global == 1 and ah.dlid == 0  # RoCE: always a GRH
    assert ah.gr.dgid == ("GID", V4GID) and ah.gr.sgid_index == 1
    assert m_rts & e["IBV_QP_SQ_PSN"] and a_rts.max_rd_atomic == 4 and a_rts.sq_psn == 9
    assert qp.state is QPState.RTS
    with pytest.raises(RDMAError) as ei:  # illegal: RESET -> RTS
        qp.modify(QPAttr(QPState.RESET))
        qp.modify(QPAttr(QPState.RTS))
    assert ei.value.errno == errno.EINVAL
    qp.modify(QPAttr(QPState.ERR))
    assert qp.state is QPState.ERR


def test_post_send_builds_one_chain(fake: Any) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    with pytest.raises(PostError) as ei:
        qp.post_send([SendWR(1, WROpcode.SEND, [SGE(0x1000, 8, 5)])])
    assert ei.value.errno == errno.EINVAL  # QP in RESET: refused before pyverbs
    with pytest.raises(PostError):
        qp.post_recv([RecvWR(50, [SGE(0x3000, 64, 5)])])
    qp.modify(QPAttr(QPState.INIT))
    qp.post_recv([RecvWR(50, [SGE(0x3000, 64, 5)]), RecvWR(51, [])])
    (r1, r2), = qp._qp.recvs
    assert (r1.wr_id, r1.num_sge, r2.wr_id, r2.num_sge) == (50, 1, 51, 0)
    qp.modify(QPAttr(QPState.RESET))
    _to_rts(qp)
    wrs = [
        SendWR(1, WROpcode.SEND_WITH_IMM, [SGE(0x1000, 8, 5), SGE(0x2000, 4, 6)],
               imm_data=0x01020304, send_flags=0),
        SendWR(2, WROpcode.RDMA_WRITE, [], rkey=0x77, remote_addr=0x9000),
        SendWR(3, WROpcode.ATOMIC_FETCH_AND_ADD, [SGE(0x4000, 8, 5)], rkey=0x78,
               remote_addr=0xA008, compare_add=-1),
    ]
    qp.post_send(wrs)
    (w1, w2, w3), = qp._qp.sends
    assert [w.wr_id for w in (w1, w2, w3)] == [1, 2, 3]
    assert w1.opcode == 3 and w1.num_sge == 2 and w1.send_flags == 0
    assert w1.sg == [(0x1000, 8, 5), (0x2000, 4, 6)]
    assert w1.imm_data == socket.htonl(0x01020304)
    assert w2.num_sge == 0 and w2.rdma == (0x77, 0x9000) and w2.imm_data == 0
    assert w3.atomic == (0x78, 0xA008, 0xFFFFFFFFFFFFFFFF, 0)
    assert all(w.closed for w in (w1, w2, w3))  # C memory freed after posting
    assert len(qp._queues.sq) == 3


def test_single_sends_reuse_one_cached_wr_per_sge(fake: Any) -> None:
    """One-WR, one-SGE posts (every endpoint frame) go through one cached pyverbs WR per
    SGE, whose fields each post sets for its opcode; the queue records each post."""
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    _to_rts(qp)
    seen: list[tuple[Any, ...]] = []
    real_post = qp._qp.post_send

    def snapshot(head: Any) -> None:  # the cached object changes with the next post
        seen.append((id(head), head.wr_id, head.opcode, head.send_flags, head.imm_data,
                     head.rdma, head.atomic, head.sg, head.next_wr))
        real_post(head)

    qp._qp.post_send = snapshot
    sge = SGE(0x1000, 8, 5)
    qp.post_send([SendWR(1, WROpcode.SEND_WITH_IMM, [sge], imm_data=0x01020304)])
    qp.post_send([SendWR(2, WROpcode.RDMA_WRITE, [sge], send_flags=0, rkey=0x77,
                         remote_addr=0x9000)])
    qp.post_send([SendWR(3, WROpcode.ATOMIC_FETCH_AND_ADD, [sge], rkey=0x78,
                         remote_addr=0xA008, compare_add=-1)])
    qp.post_send([SendWR(4, WROpcode.SEND, [SGE(0x2000, 4, 5)], send_flags=SendFlags.INLINE)])
    assert list(qp._queues.sq) == [(1, True, WCOpcode.SEND), (2, False, WCOpcode.RDMA_WRITE),
                                   (3, True, WCOpcode.FETCH_ADD), (4, False, WCOpcode.SEND)]
    qp._queues.reset()  # (their completions: max_send_wr is 4)
    qp.post_send([SendWR(5, WROpcode.RDMA_WRITE_WITH_IMM, [sge], rkey=0x79,
                         remote_addr=0xB000, imm_data=7)])
    ids = [x[0] for x in seen]
    assert ids[0] == ids[1] == ids[2] == ids[4] != ids[3]  # one WR per SGE
    assert seen[0][1:5] == (1, int(WROpcode.SEND_WITH_IMM), 2, socket.htonl(0x01020304))
    assert seen[1][1:4] == (2, int(WROpcode.RDMA_WRITE), 0) and seen[1][5] == (0x77, 0x9000)
    assert seen[2][1:3] == (3, int(WROpcode.ATOMIC_FETCH_AND_ADD))
    assert seen[2][6] == (0x78, 0xA008, 0xFFFFFFFFFFFFFFFF, 0)
    assert seen[3][1:4] == (4, int(WROpcode.SEND), int(SendFlags.INLINE))
    assert seen[3][7] == [(0x2000, 4, 5)]
    assert seen[4][1:5] == (5, int(WROpcode.RDMA_WRITE_WITH_IMM), 2, socket.htonl(7))
    assert seen[4][5] == (0x79, 0xB000)
    assert all(x[8] is None for x in seen)  # never chained
    assert list(qp._queues.sq) == [(5, True, WCOpcode.RDMA_WRITE)]


def test_one_sge_receives_are_posted_through_cached_wrs(fake: Any) -> None:
    """A batch of one-SGE receives (the endpoint re-posts its buffers in batches) costs
    no new pyverbs objects once each buffer has its WR: one post per cached WR."""
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    _to_rts(qp)
    bufs = [SGE(0x3000 + 64 * i, 64, 5) for i in range(3)]
    qp.post_recv([RecvWR(10 + i, [b]) for i, b in enumerate(bufs)])
    assert [[(w.wr_id, w.sg) for w in chain] for chain in qp._qp.recvs] == [
        [(10 + i, [(b.addr, 64, 5)])] for i, b in enumerate(bufs)]
    first = [chain[0] for chain in qp._qp.recvs]
    assert len(set(map(id, first))) == 3 and list(qp._queues.rq) == [10, 11, 12]
    qp._queues.reset()  # (their completions)
    qp._qp.recvs.clear()
    seen: list[int] = []
    real_post = qp._qp.post_recv

    def post_then_refuse(head: Any) -> None:
        if len(seen) == 2:
            raise FakePyverbsError("Failed to post recv", errno.ENOMEM)
        seen.append(head.wr_id)
        real_post(head)

    qp._qp.post_recv = post_then_refuse
    with pytest.raises(PostError) as ei:
        qp.post_recv([RecvWR(20 + i, [b]) for i, b in enumerate(reversed(bufs))])
    assert ei.value.errno == errno.ENOMEM
    # the same objects again, and the two posted before the refusal are recorded
    assert [chain[0] for chain in qp._qp.recvs] == first[::-1][:2]
    assert seen == [20, 21] and list(qp._queues.rq) == [20, 21]


def test_refusals_leave_nothing_posted(fake: Any) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    _to_rts(qp)
    ok = SendWR(1, WROpcode.SEND, [SGE(0x1000, 8, 5)])
    bad_chains = [
        [ok, SendWR(2, WROpcode.ATOMIC_CMP_AND_SWP, [SGE(0x1000, 8, 5)], remote_addr=0x1004)],
        [ok, SendWR(2, WROpcode.ATOMIC_CMP_AND_SWP, [SGE(0x1000, 4, 5)])],
        [ok, SendWR(2, WROpcode.SEND, [SGE(0, 1, 1)] * 3)],
        [ok, SendWR(2, WROpcode.SEND, [SGE(0x1000, 65, 5)], send_flags=SendFlags.INLINE)],
        [ok, SendWR(2, WROpcode.RDMA_READ, [SGE(0x1000, 8, 5)], send_flags=SendFlags.INLINE)],
    ]
    for chain in bad_chains:
        with pytest.raises(PostError) as ei:
            qp.post_send(chain)
        assert isinstance(ei.value, ValueError) and ei.value.errno == errno.EINVAL
    with pytest.raises(PostError) as ei:
        qp.post_send([ok] * 5)  # max_send_wr=4
    assert ei.value.errno == errno.ENOMEM
    with pytest.raises(PostError) as ei:
        qp.post_recv([RecvWR(i, [SGE(0, 1, 1)]) for i in range(5)])
    assert ei.value.errno == errno.ENOMEM
    with pytest.raises(ValueError):
        qp.post_recv([RecvWR(1, [SGE(0, 1, 1)] * 3)])
    assert qp._qp.sends == [] and qp._qp.recvs == [] and not qp._queues.sq
    qp._qp.refuse = FakePyverbsError("Failed to post send", errno.ENOMEM)
    with pytest.raises(PostError) as ei:
        qp.post_send([ok])
    assert ei.value.errno == errno.ENOMEM and not qp._queues.sq


@pytest.fixture(params=["pyverbs", "ctypes", "compiled"])
def poll_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch,
              fake: Any) -> FakeVerbsABI | None:
    """Every way IbvCQ polls: pyverbs' CQ.poll, ops.poll_cq through ctypes, or
    ibv_poll_cq of the compiled data path (the C structs faked by FakeVerbsABI)."""
    if request.param == "pyverbs":
        return None
    if request.param == "compiled":
        if loader.fastpath() is None:
            pytest.skip(f"the compiled data path is not built ({loader.fastpath_error()})")
        monkeypatch.delenv("AIORDMA_VERBS_POLL", raising=False)
    else:
        monkeypatch.setenv("AIORDMA_VERBS_POLL", "ctypes")
    return install_abi(fake, monkeypatch)


def test_poll_converts_and_frees_send_slots(fake: Any, poll_path: FakeVerbsABI | None) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    assert (cq._poller is None) == (poll_path is None)
    assert cq.data_path == "pyverbs" if poll_path is None else cq.data_path in repr(cq)
    _to_rts(qp)
    qp.post_send([SendWR(1, WROpcode.RDMA_WRITE, [], send_flags=0),
                  SendWR(2, WROpcode.RDMA_WRITE, [], send_flags=0),
                  SendWR(3, WROpcode.RDMA_READ, [SGE(0x1000, 8, 5)])])
    qp.post_recv([RecvWR(9, [SGE(0x3000, 64, 5)])])
    with pytest.raises(PostError):  # 3 of 4 in use
        qp.post_send([SendWR(4, WROpcode.SEND, []), SendWR(5, WROpcode.SEND, [])])
    pcq = cq._cq
    pcq.wcs.extend([_pwc(wr_id=3, opcode=2, byte_len=8),
                    _pwc(wr_id=9, opcode=129, wc_flags=2, imm_data=socket.htonl(42),
                         byte_len=0)])
    wcs = cq.poll(16)
    assert [(w.wr_id, w.opcode, w.status) for w in wcs] == [
        (3, WCOpcode.RDMA_READ, WCStatus.SUCCESS),
        (9, WCOpcode.RECV_RDMA_WITH_IMM, WCStatus.SUCCESS)]
    assert wcs[1].imm_data == 42
    assert qp._queues.send_room() == 4 and qp._queues.recv_room() == 4
    # an error of a later unsignaled WR, then its flush; opcode from what was posted
    qp.post_send([SendWR(4, WROpcode.RDMA_READ, [SGE(0x1000, 8, 5)], send_flags=0),
                  SendWR(5, WROpcode.SEND, [])])
    pcq.wcs.extend([_pwc(wr_id=4, status=10, opcode=0), _pwc(wr_id=5, status=5, opcode=0)])
    wcs = cq.poll()
    assert [(w.wr_id, w.opcode, w.status) for w in wcs] == [
        (4, WCOpcode.RDMA_READ, WCStatus.REM_ACCESS_ERR),
        (5, WCOpcode.SEND, WCStatus.WR_FLUSH_ERR)]
    assert qp._queues.send_room() == 4
    pcq.fail = FakePyverbsError("Failed to poll CQ", errno.EOVERFLOW)
    with pytest.raises(CQOverrunError):
        cq.poll()
    assert qp.state is QPState.ERR  # its QPs are in error for good
    pcq.fail = None
    with pytest.raises(CQOverrunError):  # forever
        cq.poll()
    if poll_path is not None:
        assert poll_path.calls and all(n == 16 for _, n in poll_path.calls[:1])


def test_a_context_dropped_open_destroys_its_objects_children_first(fake: Any) -> None:
    """A program that drops an open context in a reference cycle (endpoints never
    closed): the GC would destroy the pyverbs objects in any order; the context's
    finalizer destroys them children first, acking the CQ events it got, so none is
    destroyed after the device context (pyverbs: EBADF) or blocks (unacked events)."""
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake, shared=False)
    mr = pd.reg_mr(bytearray(64))
    order: list[str] = []
    for name, obj in (("qp", qp._qp), ("mr", mr._mr), ("cq", cq._cq), ("rcq", rcq._cq),
                      ("channel", ch._cc), ("pd", pd._pd), ("context", ctx._ctx)):
        obj.close = lambda name=name, close=obj.close: (order.append(name), close())[1]
    fcq = cq._cq
    ch._cc.push()
    assert ch.get_event() is cq and fcq.num_events == 1  # got, never acknowledged
    garbage: list[Any] = [ctx, pd, ch, cq, rcq, qp, mr]
    garbage.append(garbage)
    del ctx, pd, ch, cq, rcq, qp, mr, garbage
    gc.collect()
    assert sorted(order) == sorted(["qp", "mr", "cq", "rcq", "channel", "pd", "context"])
    assert order[-1] == "context" and order.index("qp") < min(order.index("cq"),
                                                              order.index("rcq"))
    assert order.index("mr") < order.index("pd") and order.index("cq") < order.index("channel")
    assert fcq.num_events == 0 and fcq.closed


@pytest.fixture(params=["compiled", "python"])
def event_record(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type:
    """The type of a CQ's channel-event counts: ``fastpath.CQEvents`` where the compiled
    data path is built, ``cq._CQEvents`` where it is not (``loader.fastpath()`` None)."""
    from aiordma.verbs.ibverbs import cq as ibv_cq

    if request.param == "python":
        monkeypatch.setattr(loader, "_fastpath", None)
        monkeypatch.setattr(loader, "_fastpath_error", "not built (test)")
        return ibv_cq._CQEvents
    fp = loader.fastpath()
    if fp is None:
        pytest.skip(f"the compiled data path is not built ({loader.fastpath_error()})")
    return fp.CQEvents  # type: ignore[no-any-return]


def test_completion_channel_events(fake: Any, event_record: type) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake, shared=False)
    assert type(cq._events) is event_record
    assert not os.get_blocking(ch.fd)
    assert ch.get_event() is None  # EAGAIN
    cq.req_notify()
    assert cq._cq.armed == 1
    ch._cc.push()
    ch._cc.push()
    assert ch.get_event() is cq and ch.get_event() is cq and ch.get_event() is None
    with pytest.raises(RDMAError) as ei:  # one CQ per channel
        ctx.create_cq(8, ch)
    assert ei.value.errno == errno.EBUSY
    qp.close()
    qp.close()
    with pytest.raises(RDMAError, match="unacknowledged"):
        cq.close()
    cq.ack_events(1)
    with pytest.raises(RDMAError, match="unacknowledged"):
        cq.close()
    cq.ack_events(5)  # clamped to what was obtained
    ch._cc.push()  # queued but never read: the close reads and acks it
    with pytest.raises(RDMAError) as ei:
        ch.close()
    assert ei.value.errno == errno.EBUSY
    cq.close()
    rcq.close()
    ch.close()
    pd.close()
    ctx.close()


def test_shared_channel_through_libibverbs(monkeypatch: pytest.MonkeyPatch, fake: Any,
                                          event_record: type) -> None:
    """With the channel's C struct found, events of several CQs share one channel and are
    acked through libibverbs (pyverbs' own per-CQ counter is never touched)."""
    ctx = _open(fake)
    lib = FakeLib([])
    monkeypatch.setattr(clib, "libibverbs", lambda: lib)
    orig_locate = ibv_channel.IbvCompChannel._locate
    monkeypatch.setattr(ibv_channel.IbvCompChannel, "_locate",
                        lambda self, before: (orig_locate(self, before)[0], 0x7000))
    ch = ctx.create_comp_channel()
    assert ch._reader is not None
    cq1 = ctx.create_cq(8, ch)
    cq2 = ctx.create_cq(8, ch)
    assert type(cq1._events) is event_record and type(cq2._events) is event_record
    lib.cq_events.extend([(0x100, id(cq2._token)), (0x200, id(cq1._token)),
                          (0x100, id(cq2._token))])
    assert ch.get_event() is cq2 and ch.get_event() is cq1 and ch.get_event() is cq2
    assert cq2._cq_ptr == 0x100 and cq1._cq_ptr == 0x200  # the events told them
    assert ch.get_event() is None
    with pytest.raises(RDMAError, match="unacknowledged"):
        cq2.close()
    cq2.ack_events(2)
    cq1.ack_events(1)
    assert sorted(lib.cq_acked) == [(0x100, 2), (0x200, 1)]
    assert cq1._cq.num_events == 0 and cq2._cq.num_events == 0
    cq1.close()
    cq2.close()
    ch.close()
    ctx.close()


def test_async_events_fallback_path(fake: Any) -> None:
    ctx = _open(fake)
    assert ctx._reader is None  # the fake has no struct ibv_context
    r, w = fake.async_pipe
    assert ctx.get_async_events() == []
    pctx = ctx._ctx
    pctx.async_events.extend([int(EventType.PORT_ACTIVE), 77])
    os.write(w, b"xx")

    orig = pctx.get_async_event

    def get_one() -> Any:
        ev = orig()
        os.read(r, 1)
        return ev

    pctx.get_async_event = get_one
    evs = ctx.get_async_events()
    assert [e.event_type for e in evs] == [EventType.PORT_ACTIVE]  # 77 is unknown: acked
    ctx.close()


def test_convert_async_event_elements(fake: Any) -> None:
    ctx, pd, ch, cq, rcq, qp = _qp_setup(fake)
    qpbuf = (ctypes.c_char * 64)()
    struct.pack_into("=I", qpbuf, compat.QP_QP_NUM_OFFSET, qp.qp_num)
    cqbuf = (ctypes.c_char * 32)()
    struct.pack_into("=Q", cqbuf, compat.CQ_CQ_CONTEXT_OFFSET, id(cq._token))
    ev = ctx._convert_async(int(EventType.QP_FATAL), ctypes.addressof(qpbuf))
    assert ev is not None and ev.qp_num == qp.qp_num
    ev = ctx._convert_async(int(EventType.CQ_ERR), ctypes.addressof(cqbuf))
    assert ev is not None and ev.cq is cq
    with pytest.raises(CQOverrunError):
        cq.poll()
    ev = ctx._convert_async(int(EventType.PORT_ERR), 1)
    assert ev is not None and ev.port_num == 1
    assert ctx._convert_async(19, 0) is None  # IBV_EVENT_WQ_FATAL: not ours
