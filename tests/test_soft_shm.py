"""Same-host READs into shared memory (``buffers.SharedMemory``, the soft device's
``cma.PeerMaps`` and wire FLAG_SHM): the responder copies into its own mapping of the
requester's buffer with ``memmove`` instead of ``process_vm_writev``; everything it
cannot map safely falls back to the CMA copy, with the same verbs semantics."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import mmap
import os
import pathlib
import time
from collections.abc import Iterator

import pytest
import test_soft_cma
import test_verbs_provider
from test_soft_cma import MiB, _pattern, child_qp
from test_verbs_provider import (
    ACC_ALL,
    WAIT_S,
    Pair,
    Resources,
    poll_n,
    send,
    sge,
    statuses,
    wait_state,
)

import aiordma
from aiordma.memory import StagingCache
from aiordma.verbs import MR, PD, Access, Context, QPState, WROpcode, buffers
from aiordma.verbs import WCStatus as S
from aiordma.verbs.buffers import SharedMemory
from aiordma.verbs.soft import cma


def _memfd_ok() -> bool:
    sm = SharedMemory.create(4096)
    if sm is None:
        return False
    sm.close()
    return True


pytestmark = pytest.mark.skipif(
    os.environ.get("AIORDMA_PROVIDER", "soft") != "soft" or not cma.enabled()
    or not _memfd_ok(), reason="the soft provider's CMA and memfd (Linux)")

res = test_verbs_provider.res  # the fixture
_cma_on = test_soft_cma._cma_on  # the autouse fixture: CMA on, default threshold


@contextlib.contextmanager
def shared_mr(pd: PD, size: int) -> Iterator[tuple[MR, SharedMemory]]:
    sm = SharedMemory.create(size)
    assert sm is not None
    mr = pd.reg_mr(sm.map, ACC_ALL)
    try:
        yield mr, sm
    finally:
        mr.close()
        sm.close()


def _fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


# --- SharedMemory ---------------------------------------------------------------------------

def test_shared_memory_is_sealed_and_found_by_address() -> None:
    sm = SharedMemory.create(3 * 4096)
    assert sm is not None
    try:
        seals = fcntl.fcntl(sm.fd, fcntl.F_GET_SEALS)
        assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW
        with pytest.raises(OSError):
            os.ftruncate(sm.fd, 4096)
        assert os.fstat(sm.fd).st_ino == sm.ino
        assert SharedMemory.backing(sm.addr, sm.size) == (sm, 0)
        assert SharedMemory.backing(sm.addr + 4096, 100) == (sm, 4096)
        assert SharedMemory.backing(sm.addr + 1, sm.size) is None  # runs past the end
        before = SharedMemory.backing(sm.addr - 1, 2)
        assert before is None or before[0] is not sm
    finally:
        sm.close()
    assert not _fd_open(sm.fd) or os.fstat(sm.fd).st_ino != sm.ino
    assert SharedMemory.backing(sm.addr, 1) is None
    sm.close()  # idempotent


def test_shared_memory_count_is_capped(monkeypatch: pytest.MonkeyPatch) -> None:
    live = len(SharedMemory._live)
    monkeypatch.setattr(buffers, "SHARED_MAX_BUFFERS", live + 2)
    a, b = SharedMemory.create(4096), SharedMemory.create(4096)
    try:
        assert a is not None and b is not None
        assert SharedMemory.create(4096) is None
    finally:
        for sm in (a, b):
            if sm is not None:
                sm.close()
    c = SharedMemory.create(4096)
    assert c is not None
    c.close()


# --- PeerMaps (this process as its own peer: the same /proc path) -------------------------

def test_peer_maps_drop_the_buffers_the_peer_closed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A miss sweeps (at most every PEER_SWEEP_S) the mappings of closed buffers: they
    would keep the peer's freed memory alive."""
    a, b, c = (SharedMemory.create(4096) for _ in range(3))
    assert a is not None and b is not None and c is not None
    try:
        maps = cma.PeerMaps(os.getpid())
        assert maps.target(a.fd, a.ino, 0, 8) is not None
        assert maps.target(b.fd, b.ino, 0, 8) is not None
        a.close()
        monkeypatch.setattr(cma, "PEER_SWEEP_S", 3600.0)
        assert maps.target(c.fd, c.ino, 0, 8) is not None  # swept recently: kept
        assert list(maps._maps) == [a.ino, b.ino, c.ino]
        monkeypatch.setattr(cma, "PEER_SWEEP_S", 0.0)
        d = SharedMemory.create(4096)
        assert d is not None
        try:
            assert maps.target(d.fd, d.ino, 0, 8) is not None
            assert list(maps._maps) == [b.ino, c.ino, d.ino]
            assert maps._bytes == 3 * 4096
        finally:
            d.close()
    finally:
        for sm in (a, b, c):
            sm.close()


def test_peer_maps_keep_one_mapping_larger_than_the_limit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma, "PEER_MAP_BYTES", 4096)
    sm = SharedMemory.create(3 * 4096)
    assert sm is not None
    try:
        maps = cma.PeerMaps(os.getpid())
        assert maps.target(sm.fd, sm.ino, 0, 3 * 4096) is not None
        assert list(maps._maps) == [sm.ino]
    finally:
        sm.close()


def test_peer_maps_map_the_same_pages_and_check_bounds() -> None:
    sm = SharedMemory.create(2 * 4096)
    assert sm is not None
    try:
        maps = cma.PeerMaps(os.getpid())
        hit = maps.target(sm.fd, sm.ino, 4096, 4096)
        assert hit is not None
        import ctypes

        ctypes.memmove(hit[1], b"shared!", 7)
        assert sm.map[4096:4103] == b"shared!"
        assert maps.target(sm.fd, sm.ino, 4096, 4097) is None  # past the end
        assert maps.target(sm.fd, sm.ino, -1, 10) is None
    finally:
        sm.close()


def test_peer_maps_refuse_wrong_inode_unsealed_and_plain_files(
        monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    sm = SharedMemory.create(4096)
    assert sm is not None
    unsealed = os.memfd_create("plain", os.MFD_CLOEXEC)
    os.ftruncate(unsealed, 4096)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"\0" * 4096)
    regular = os.open(path, os.O_RDWR)
    opened: list[str] = []  # /proc look-ups (stat before open)
    real_stat = os.stat

    def counting_stat(p: str, *a: object, **k: object) -> os.stat_result:
        if str(p).startswith("/proc/"):
            opened.append(p)
        return real_stat(p, *a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "stat", counting_stat)
    try:
        maps = cma.PeerMaps(os.getpid())
        assert maps.target(sm.fd, sm.ino + 1, 0, 16) is None  # another buffer's inode
        assert maps.target(unsealed, os.fstat(unsealed).st_ino, 0, 16) is None
        assert maps.target(regular, os.fstat(regular).st_ino, 0, 16) is None
        rfd, wfd = os.pipe()  # not a regular file: refused without being opened
        try:
            real_open = os.open
            monkeypatch.setattr(os, "open", lambda *a, **k: pytest.fail("opened a pipe"))
            assert maps.target(rfd, os.fstat(rfd).st_ino, 0, 16) is None
            monkeypatch.setattr(os, "open", real_open)
        finally:
            os.close(rfd)
            os.close(wfd)
        n = len(opened)
        assert maps.target(sm.fd, sm.ino + 1, 0, 16) is None  # refusals are remembered
        assert len(opened) == n
        assert cma.PeerMaps(0).target(sm.fd, sm.ino, 0, 16) is None  # unknown peer
    finally:
        os.close(unsealed)
        os.close(regular)
        sm.close()


@pytest.mark.parametrize("limit", ["count", "bytes"])
def test_peer_maps_keep_the_most_recent(monkeypatch: pytest.MonkeyPatch, limit: str) -> None:
    if limit == "count":
        monkeypatch.setattr(cma, "PEER_MAPS", 2)
    else:
        monkeypatch.setattr(cma, "PEER_MAP_BYTES", 2 * 4096)
    bufs = [SharedMemory.create(4096) for _ in range(3)]
    try:
        maps = cma.PeerMaps(os.getpid())
        for sm in bufs:
            assert sm is not None and maps.target(sm.fd, sm.ino, 0, 8) is not None
        assert list(maps._maps) == [bufs[1].ino, bufs[2].ino]  # type: ignore[union-attr]
        assert maps._bytes == 2 * 4096
        hit = maps.target(bufs[1].fd, bufs[1].ino, 0, 8)  # type: ignore[union-attr]
        keep = hit[0] if hit is not None else None
        maps.clear()
        assert maps._bytes == 0
        assert keep is not None and len(keep) == 4096  # a copy's mapping outlives eviction
    finally:
        for sm in bufs:
            if sm is not None:
                sm.close()


# --- the soft device ---------------------------------------------------------------------

def _warm(p: Pair) -> None:
    """One CMA-sized WRITE+READ: the connection probes, later requests use CMA."""
    ma, _ = p.mr("a", 2 * MiB)
    mb, _ = p.mr("b", MiB)
    p.a.post_send([send(1, [sge(ma, 0, MiB)], WROpcode.RDMA_WRITE, remote_addr=mb.addr,
                        rkey=mb.rkey),
                   send(2, [sge(ma, MiB, MiB)], WROpcode.RDMA_READ, remote_addr=mb.addr,
                        rkey=mb.rkey)])
    assert statuses(poll_n(p.cq_a, 2)) == [S.SUCCESS, S.SUCCESS]


@pytest.mark.parametrize("size", [cma.SHM_MIN, 64 * 1024, MiB, 3 * MiB + 4096])
def test_read_into_shared_memory_uses_memmove(ctx: Context, res: Resources, size: int) -> None:
    """From ``SHM_MIN`` on, below the CMA threshold (256 KiB) too."""
    p = Pair(ctx, res)
    _warm(p)
    mb, bb = p.mr("b", size)
    bb[:] = _pattern(size, 3)
    with shared_mr(p.pd_a, size + 8192) as (ma, sm):
        copies, shm = cma.copies, cma.shm_copies
        p.a.post_send([send(1, [sge(ma, 4096, size)], WROpcode.RDMA_READ,
                            remote_addr=mb.addr, rkey=mb.rkey)])
        (wc,) = poll_n(p.cq_a, 1)
        assert wc.status == S.SUCCESS and wc.byte_len == size
        assert sm.map[4096:4096 + size] == bb
        assert sm.map[:4096] == bytes(4096)  # nothing outside the SGE
        assert (cma.copies, cma.shm_copies) == (copies, shm + 1)


def test_small_reads_into_shared_memory_use_the_socket(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    _warm(p)
    mb, bb = p.mr("b", 4096)
    bb[:] = _pattern(4096, 8)
    with shared_mr(p.pd_a, 4096) as (ma, sm):
        copies, shm = cma.copies, cma.shm_copies
        p.a.post_send([send(1, [sge(ma, 0, cma.SHM_MIN - 1)], WROpcode.RDMA_READ,
                            remote_addr=mb.addr, rkey=mb.rkey)])
        assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
        assert sm.map[:cma.SHM_MIN - 1] == bb[:cma.SHM_MIN - 1]
        assert (cma.copies, cma.shm_copies) == (copies, shm)


def test_private_or_scattered_destinations_use_cma(ctx: Context, res: Resources) -> None:
    p = Pair(ctx, res)
    _warm(p)
    mb, bb = p.mr("b", 2 * MiB)
    bb[:] = _pattern(2 * MiB, 9)
    ma, ba = p.mr("a", MiB)
    with shared_mr(p.pd_a, MiB) as (ms, sm):
        copies, shm = cma.copies, cma.shm_copies
        p.a.post_send([
            send(1, [sge(ma)], WROpcode.RDMA_READ, remote_addr=mb.addr, rkey=mb.rkey),
            send(2, [sge(ms, 0, MiB // 2), sge(ma, 0, MiB // 2)], WROpcode.RDMA_READ,
                 remote_addr=mb.addr + MiB, rkey=mb.rkey),
        ])
        assert statuses(poll_n(p.cq_a, 2)) == [S.SUCCESS, S.SUCCESS]
        assert (cma.copies, cma.shm_copies) == (copies + 2, shm)
        assert sm.map[:MiB // 2] == bb[MiB:MiB + MiB // 2]
        assert ba[:MiB // 2] == bb[MiB + MiB // 2:]


def test_refused_mapping_falls_back_to_cma(ctx: Context, res: Resources,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cma.PeerMaps, "_open", lambda self, fd, ino: None)
    p = Pair(ctx, res)
    _warm(p)
    mb, bb = p.mr("b", MiB)
    bb[:] = _pattern(MiB, 4)
    with shared_mr(p.pd_a, MiB) as (ma, sm):
        copies, shm = cma.copies, cma.shm_copies
        p.a.post_send([send(1, [sge(ma)], WROpcode.RDMA_READ, remote_addr=mb.addr,
                            rkey=mb.rkey)])
        assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
        assert sm.map[:] == bb
        assert (cma.copies, cma.shm_copies) == (copies + 1, shm)


def test_a_lying_requester_only_gets_the_cma_copy(ctx: Context, res: Resources,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """FLAG_SHM naming a buffer that is not the SGE's (another fd, a bad offset): the
    responder maps nothing it cannot check, and the data lands where the SGE says."""
    p = Pair(ctx, res)
    _warm(p)
    mb, bb = p.mr("b", MiB)
    bb[:] = _pattern(MiB, 6)
    with shared_mr(p.pd_a, MiB) as (ma, sm):
        other = SharedMemory.create(4096)
        assert other is not None
        try:
            # the requester claims the 4 KiB buffer (offset 0): 1 MiB does not fit in it
            monkeypatch.setattr(SharedMemory, "backing",
                                classmethod(lambda cls, addr, n: (other, 0)))
            shm = cma.shm_copies
            p.a.post_send([send(1, [sge(ma)], WROpcode.RDMA_READ, remote_addr=mb.addr,
                                rkey=mb.rkey)])
            assert statuses(poll_n(p.cq_a, 1)) == [S.SUCCESS]
            assert sm.map[:] == bb and other.map[:] == bytes(4096)
            assert cma.shm_copies == shm
        finally:
            other.close()


@pytest.mark.parametrize("case", ["bad_rkey", "outside_mr"])
def test_remote_access_errors_copy_nothing(ctx: Context, res: Resources, case: str) -> None:
    p = Pair(ctx, res)
    _warm(p)
    mb, _ = p.mr("b", MiB)
    raddr, rkey = mb.addr, mb.rkey
    if case == "bad_rkey":
        rkey ^= 0x777700
    else:
        raddr += 4096
    with shared_mr(p.pd_a, MiB) as (ma, _sm):
        copies, shm = cma.copies, cma.shm_copies
        p.a.post_send([send(1, [sge(ma)], WROpcode.RDMA_READ, remote_addr=raddr,
                            rkey=rkey)])
        assert statuses(poll_n(p.cq_a, 1)) == [S.REM_ACCESS_ERR]
        wait_state(p.a, QPState.ERR)
        assert (cma.copies, cma.shm_copies) == (copies, shm)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_multiprocess_read_into_shared_memory(ctx: Context, res: Resources,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Across processes: the peer maps our buffer through /proc/<pid>/fd."""
    size = 4 * MiB
    with child_qp(ctx, res, monkeypatch, size) as (child, pd, cq, qp), \
            shared_mr(pd, size) as (ms, sm):
        buf = bytearray(size)
        m = res.add(pd.reg_mr(buf, ACC_ALL))
        raddr, rkey = child.info["addr"], child.info["rkey"]
        for seed in range(3):
            buf[:] = _pattern(size, seed)
            qp.post_send([
                send(1, [sge(m)], WROpcode.RDMA_WRITE, remote_addr=raddr, rkey=rkey),
                send(2, [sge(ms)], WROpcode.RDMA_READ, remote_addr=raddr, rkey=rkey),
            ])
            assert statuses(poll_n(cq, 2, WAIT_S * 3)) == [S.SUCCESS, S.SUCCESS]
            assert sm.map[:] == buf
        # the copy ran in the child: it mapped our buffer (one mapping, reused)
        with open(f"/proc/{child.proc.pid}/maps") as f:
            maps = [line for line in f if "aiordma-shared" in line]
        assert len(maps) == 1, maps


# --- rendezvous staging ------------------------------------------------------------------

def test_staging_cache_shares_while_it_may(ctx: Context, res: Resources,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    pd = res.add(ctx.alloc_pd())
    shared = StagingCache(pd, Access.LOCAL_WRITE, shared=True)
    private = StagingCache(pd, Access.LOCAL_WRITE)
    try:
        big, small = shared.lease(MiB), shared.lease(64 * 1024)
        assert big.shared is not None and big.map is big.shared.map
        assert small.shared is not None and small.shared.size == 64 * 1024
        kept = private.lease(MiB)
        assert kept.shared is None
        kept.release()
        with monkeypatch.context() as m:
            m.setattr(buffers, "SHARED_MAX_BUFFERS", len(SharedMemory._live))
            over = shared.lease(MiB)  # the process's limit: private memory, as ever
            assert over.shared is None and isinstance(over.map, mmap.mmap)
            over.release()
        sm = big.shared
        big.release()
        small.release()
        again = shared.lease(MiB)
        assert again.shared is sm  # reused (LIFO)
        again.release()
    finally:
        shared.close()
        private.close()
    assert SharedMemory.backing(sm.addr, 1) is None  # closed: unmapped, fd closed
    assert not _fd_open(sm.fd) or os.fstat(sm.fd).st_ino != sm.ino


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_endpoint_rendezvous_lands_in_shared_staging() -> None:
    """Large messages between two processes: read ahead into shared staging, filled by
    the sender's memmove; every byte arrives in order."""
    import multiprocessing as mp

    sizes = [MiB, 3 * MiB + 17, 64 * 1024 + 3, 256 * 1024, 5 * MiB]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_rndv_sender, args=(q, sizes))

    async def main() -> list[bytes]:
        got: list[bytes] = []
        done = asyncio.get_running_loop().create_future()

        async def handler(ep: aiordma.Endpoint) -> None:
            for _ in sizes:
                got.append(await ep.recv())
            staged = ep.statistics()["rndv_staged"]
            await ep.send(str(staged).encode())
            with contextlib.suppress(aiordma.ConnectionClosed):
                await ep.recv()
            done.set_result(None)

        lst = await aiordma.listen(handler, "127.0.0.1", 0, provider="soft")
        proc.start()
        q.put(lst.port)
        await asyncio.wait_for(done, 60)
        lst.close()
        return got

    got = asyncio.run(main())
    proc.join(30)
    assert proc.exitcode == 0
    assert [len(m) for m in got] == sizes
    for i, m in enumerate(got):
        assert m == _pattern(len(m) // 256 * 256, i) + bytes(len(m) % 256)
    shm = q.get(timeout=10)
    assert shm >= 1  # at least the read-ahead messages were copied by memmove


def _rndv_sender(q: object, sizes: list[int]) -> None:
    async def main() -> None:
        port = q.get(timeout=30)  # type: ignore[attr-defined]
        ep = await aiordma.connect("127.0.0.1", port, provider="soft")
        msgs = [_pattern(n // 256 * 256, i) + bytes(n % 256) for i, n in enumerate(sizes)]
        await asyncio.gather(*(ep.send(m) for m in msgs))
        await ep.recv()
        await ep.close()
        q.put(cma.shm_copies)  # type: ignore[attr-defined]

    asyncio.run(main())


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_deep_read_ahead_maps_each_staging_buffer_once() -> None:
    """A receiver that falls behind reads ahead into ~96 staging buffers at once and
    then cycles through them: the sender maps each once (a mapping cache smaller than
    the working set would map one per message, at a third of the speed)."""
    import multiprocessing as mp

    n = 100
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_wave_sender, args=(q, n))

    async def main() -> int:
        done = asyncio.get_running_loop().create_future()

        async def handler(ep: aiordma.Endpoint) -> None:
            for wave in range(2):
                # let the wave pile up: read ahead into ~96 staging buffers (bounded wait)
                deadline = time.monotonic() + 30
                while (ep.statistics()["rndv_staged"] < wave * n + 90
                       and time.monotonic() < deadline):
                    await asyncio.sleep(0.01)
                for i in range(n):
                    m = await ep.recv()
                    assert len(m) == MiB and m[:4] == i.to_bytes(4, "little")
                await ep.send(b"next")
            regs = ep.statistics()["staging_registrations"]
            await ep.send(str(regs).encode())
            with contextlib.suppress(aiordma.ConnectionClosed):
                await ep.recv()
            done.set_result(regs)

        lst = await aiordma.listen(handler, "127.0.0.1", 0, provider="soft",
                                   rndv_prefetch=96 * MiB)
        proc.start()
        q.put(lst.port)
        regs: int = await asyncio.wait_for(done, 90)
        lst.close()
        return regs

    regs = asyncio.run(main())
    proc.join(30)
    assert proc.exitcode == 0
    maps, copies = q.get(timeout=10)
    assert regs >= 90  # the read-ahead did go deep
    assert copies >= n  # the shared path carried the waves
    assert maps <= regs  # one mapping per staging buffer, not one per message


def _wave_sender(q: object, n: int) -> None:
    async def main() -> None:
        port = q.get(timeout=30)  # type: ignore[attr-defined]
        ep = await aiordma.connect("127.0.0.1", port, provider="soft")
        data = bytearray(MiB)
        mr = ep.register(data, remote_read=True)
        for _wave in range(2):
            # distinct message contents: each send holds its own copy
            msgs = [i.to_bytes(4, "little") + bytes(MiB - 4) for i in range(n)]
            await asyncio.gather(*(ep.send(m) for m in msgs))
            assert await ep.recv() == b"next"
        await ep.recv()
        mr.close()
        await ep.close()
        q.put((cma.shm_maps, cma.shm_copies))  # type: ignore[attr-defined]

    asyncio.run(main())
