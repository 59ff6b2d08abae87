"""The Endpoint API end to end, on the provider under test and on both loops.

Each test runs a listener and a client in one process (the device progresses on its
own); the multi-process cases live in test_multiprocess.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket

import pytest
from _pairs import HOST, T, pair

import aiordma
from aiordma import native
from aiordma.options import EndpointOptions
from aiordma.resources import Resources
from aiordma.verbs import SendFlags, WROpcode

pytestmark = pytest.mark.usefixtures("soft_cma")  # soft: with and without CMA


@pytest.fixture
def opts(provider_name: str) -> dict:
    return {"provider": provider_name}


async def server_ep(q: asyncio.Queue) -> aiordma.Endpoint:
    return await asyncio.wait_for(q.get(), T)


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1000003 + n).randbytes(n)


async def test_send_recv_sizes(opts: dict) -> None:
    sizes = [0, 1, 100, 16 * 1024 - 9, 16 * 1024 - 8, 16 * 1024, 1 << 20, 16 << 20]
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        for i, n in enumerate(sizes):
            data = payload(n, i)
            await asyncio.wait_for(ep.send(data), T)
            got = await asyncio.wait_for(srv.recv(), T)
            assert got == data, n
            await asyncio.wait_for(srv.send(got), T)
            assert await asyncio.wait_for(ep.recv(), T) == data


async def test_the_engine_takes_its_c_path_where_the_provider_offers_it(opts: dict) -> None:
    """``statistics()["c_path"]``: the engine posts and polls through C-level operations
    on ``soft`` always, on ``verbs`` where its compiled data path runs (which the VM
    tier requires), on both sides of a connection, and messages flow."""
    want = opts["provider"] == "soft" or native.build().compiled("verbs")
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        assert ep.statistics()["c_path"] is want and srv.statistics()["c_path"] is want
        for i in range(3):
            await asyncio.wait_for(ep.send(payload(64, i)), T)
            assert await asyncio.wait_for(srv.recv(), T) == payload(64, i)


@pytest.mark.parametrize("mode", ["blocking", "hybrid", "polling"])
async def test_every_poll_mode_end_to_end(opts: dict, mode: str) -> None:
    """Eager, BATCH, rendezvous both ways, one-sided ops, atomics and a graceful close
    under each poll policy of the reactor."""
    async with pair(opts, poll_mode=mode, spin_us=50) as (ep, q):
        srv = await server_ep(q)
        assert ep._reactor.mode == mode
        msgs = [payload(n, n) for n in (0, 64, 17000, 1 << 20)]
        for m in msgs:
            await asyncio.wait_for(asyncio.gather(ep.send(m), srv.send(m)), T)
        for m in msgs:
            assert await asyncio.wait_for(srv.recv(), T) == m
            assert await asyncio.wait_for(ep.recv(), T) == m
        await asyncio.wait_for(asyncio.gather(*(ep.send(b"%d" % i) for i in range(20))), T)
        for i in range(20):
            assert await asyncio.wait_for(srv.recv(), T) == b"%d" % i
        region = srv.register(bytearray(4096), remote_read=True, remote_write=True,
                              remote_atomic=True)
        local = ep.register(bytearray(4096))
        local.view[:] = payload(4096, 3)
        await asyncio.wait_for(ep.write(local, region.remote()), T)
        assert bytes(region.view) == payload(4096, 3)
        out = ep.register(bytearray(4096))
        await asyncio.wait_for(ep.read(out, region.remote()), T)
        assert bytes(out.view) == payload(4096, 3)
        old = await asyncio.wait_for(ep.fetch_add(region.remote().slice(0, 8), 5), T)
        assert old == int.from_bytes(payload(4096, 3)[:8], "little")
        await asyncio.wait_for(ep.close(), T)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


async def test_polling_waits_in_place(opts: dict) -> None:
    """``polling`` polls in place in the waiting task (cq_reactor.wait_in_place; the
    ``soft`` device's bytes are moved there too): messages, one-sided operations and
    atomics complete there, in order and intact, even with the peer on this loop (its
    answers then wait for the loop: those waits miss)."""
    async with pair(opts, poll_mode="polling", spin_us=2000) as (ep, q):
        srv = await server_ep(q)
        region = srv.register(bytearray(64), remote_read=True, remote_write=True,
                              remote_atomic=True)
        local = ep.register(bytearray(64))
        for i in range(20):
            await asyncio.wait_for(ep.send(payload(64, i)), T)
            assert await asyncio.wait_for(srv.recv(), T) == payload(64, i)
            await asyncio.wait_for(srv.send(payload(100, i)), T)
            assert await asyncio.wait_for(ep.recv(), T) == payload(100, i)
            local.view[:] = payload(64, i)
            await asyncio.wait_for(ep.write(local, region.remote()), T)
            assert bytes(region.view) == payload(64, i)
            old = await asyncio.wait_for(ep.fetch_add(region.remote().slice(0, 8), 1), T)
            assert old == int.from_bytes(payload(64, i)[:8], "little")
        st = ep.statistics()["reactor"]
        assert ep._reactor.in_place
        assert st["in_place_waits"] > 0 and st["in_place_hits"] > 0, st
        # a receive whose message comes only after its in-place wait ran out (the sender
        # is this task) falls back to the waiter path and still gets it, and the sender
        # does not wait in place while that receiver is suspended
        for recv in (srv.recv, lambda: srv.recv_into(bytearray(64))):
            waiting = asyncio.ensure_future(recv())
            await asyncio.sleep(0.01)
            assert not waiting.done() and ep._reactor.schedule.suspended == 1
            waits = ep._reactor.schedule.in_place_waits
            await asyncio.wait_for(ep.send(b"late"), T)
            assert ep._reactor.schedule.in_place_waits == waits
            assert await asyncio.wait_for(waiting, T) in (b"late", 4)
            assert ep._reactor.schedule.suspended == 0
        # a buffer recv_into cannot take raises at once, without waiting in place first
        waits = srv._reactor.schedule.in_place_waits
        for bad in (b"readonly", "text", memoryview(bytearray(8)).toreadonly()):
            with pytest.raises(TypeError):
                await srv.recv_into(bad)
        assert srv._reactor.schedule.in_place_waits == waits
        await asyncio.wait_for(ep.close(), T)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


@pytest.mark.parametrize("how", ["recv", "recv_into"])
async def test_polling_in_place_budget_follows_a_late_message(opts: dict, how: str) -> None:
    """A receive whose in-place wait ran out and whose message came long after (the
    peer sends 5 ms later) raises the in-place budget to the cap, 10x ``spin_us``
    (poll_schedule.py): both receive paths report the turnaround. Under load an
    in-place wait may not run out (the spin went quiet after a preemption, or a
    preemption longer than the peer's delay let it catch the message): such a try
    proves nothing and is made again, four tries at most."""
    async with pair(opts, poll_mode="polling", spin_us=300) as (ep, q):
        srv = await server_ep(q)
        assert ep.statistics()["reactor"]["in_place_budget_us"] == 300
        sched = ep._reactor.schedule
        for _try in range(4):
            sent: list[asyncio.Future[None]] = []
            asyncio.get_running_loop().call_later(
                0.005, lambda sent=sent: sent.append(asyncio.ensure_future(srv.send(b"late"))))
            misses = sched.in_place_missed
            if how == "recv":
                assert await asyncio.wait_for(ep.recv(), T) == b"late"
            else:
                assert await asyncio.wait_for(ep.recv_into(bytearray(8)), T) == 4
            await asyncio.wait_for(sent[0], T)
            st = ep.statistics()["reactor"]
            if st["in_place_missed"] == misses + 1:
                assert st["in_place_budget_us"] == 3000, st
                break
        else:
            pytest.fail(f"no in-place wait ran out in four tries: {ep.statistics()['reactor']}")


async def test_a_second_poll_mode_on_the_same_loop_is_refused(opts: dict) -> None:
    """The poll policy belongs to the device's reactor on this loop: a connection that
    asks for another one gets a clear ValueError (not silently the first one's policy),
    and nothing leaks -- the first connection keeps working."""
    async with pair(opts, poll_mode="hybrid", spin_us=30) as (ep, q):
        srv = await server_ep(q)
        port = (ep.peer_address or ("", 0))[1]
        device = ep._device
        refs = device._refs
        for bad in ({"poll_mode": "polling"}, {"poll_mode": "hybrid", "spin_us": 5},
                    {"poll_mode": "blocking"}):
            with pytest.raises(ValueError, match="already polls in mode 'hybrid' spin_us=30"):
                await aiordma.connect(HOST, port, timeout=T, **opts, **bad)
        assert device._refs == refs
        # asking for the same policy, or for none, is fine
        for same in ({"poll_mode": "hybrid"}, {"spin_us": 30}, {}):
            ep2 = await aiordma.connect(HOST, port, timeout=T, **opts, **same)
            srv2 = await server_ep(q)
            await asyncio.wait_for(ep2.send(b"x"), T)
            assert await asyncio.wait_for(srv2.recv(), T) == b"x"
            rst = ep2.statistics()["reactor"]
            assert (rst["mode"], rst["spin_us"]) == ("hybrid", 30)
            assert rst == ep.statistics()["reactor"] | {"outstanding": rst["outstanding"]}
            await asyncio.wait_for(ep2.close(), T)
        await asyncio.wait_for(ep.send(b"still"), T)
        assert await asyncio.wait_for(srv.recv(), T) == b"still"


async def test_send_accepts_any_bytes_like(opts: dict) -> None:
    import array

    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        for obj in (bytearray(b"ab"), memoryview(b"cd"), array.array("I", [1, 2])):
            await asyncio.wait_for(ep.send(obj), T)
            assert await asyncio.wait_for(srv.recv(), T) == bytes(memoryview(obj).cast("B"))
        with pytest.raises(TypeError):
            await ep.send("text")  # type: ignore[arg-type]


async def test_memoryview_sends_of_every_shape(opts: dict) -> None:
    """A memoryview goes as its bytes whatever its shape: a flat byte slice (the eager
    path), another format, two dimensions, a strided view (not C-contiguous: refused
    with TypeError, nothing sent); a released view raises ValueError."""
    import array

    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        buf = bytearray(payload(100, 3))
        grid = memoryview(bytearray(range(12))).cast("B", (3, 4))
        for view in (memoryview(buf)[10:74], memoryview(buf)[:0],
                     memoryview(array.array("H", [1, 2, 3])), grid,
                     memoryview(bytes(buf)).cast("c")):
            await asyncio.wait_for(ep.send(view), T)
            assert await asyncio.wait_for(srv.recv(), T) == view.tobytes()
        with pytest.raises(TypeError, match="C-contiguous"):
            await ep.send(memoryview(buf)[::2])
        gone = memoryview(buf)
        gone.release()
        with pytest.raises(ValueError):
            await ep.send(gone)
        await asyncio.wait_for(ep.send(b"after"), T)
        assert await asyncio.wait_for(srv.recv(), T) == b"after"


async def test_a_memoryview_send_short_of_credits_keeps_its_bytes(opts: dict) -> None:
    """Sends of views waiting for credits hold the buffer under the view (it cannot be
    resized until the send is done, even once the caller released its view) and
    deliver the bytes it had."""
    n = 24
    async with pair(opts, recv_depth=8) as (ep, q):
        srv = await server_ep(q)
        # over half the eager size: no two share a BATCH frame, so each needs a credit
        bufs = [bytearray(payload(9000, i)) for i in range(n)]
        views = [memoryview(b) for b in bufs]
        sends = [asyncio.ensure_future(ep.send(v)) for v in views]
        await asyncio.sleep(0.05)  # the sender runs out of credits: the last ones wait
        assert not sends[-1].done()
        views[-1].release()
        with pytest.raises(BufferError):
            bufs[-1].append(0)
        got = [await asyncio.wait_for(srv.recv(), T) for _ in range(n)]
        await asyncio.wait_for(asyncio.gather(*sends), T)
        assert got == [bytes(b) for b in bufs]
        bufs[-1].append(0)  # done: the engine let go of it
        # an answer, so that the server's last frames (credits) are acknowledged before
        # the client goes
        await asyncio.wait_for(srv.send(b"end"), T)
        assert await asyncio.wait_for(ep.recv(), T) == b"end"


async def test_concurrent_sends_keep_order_and_credits_hold(opts: dict) -> None:
    n = 600  # many times the receive depth: credits must hold the sender back
    async with pair(opts, recv_depth=8) as (ep, q):
        srv = await server_ep(q)
        sends = asyncio.gather(*(ep.send(i.to_bytes(4, "little")) for i in range(n)))
        await asyncio.sleep(0.05)  # let the sender run out of credits
        got = [int.from_bytes(await asyncio.wait_for(srv.recv(), T), "little") for _ in range(n)]
        await asyncio.wait_for(sends, T)
        assert got == list(range(n))
        st = srv.statistics()
        assert st["messages_received"] == n


async def test_bidirectional_streams_do_not_deadlock(opts: dict) -> None:
    n = 300
    async with pair(opts, recv_depth=4, send_depth=8) as (ep, q):
        srv = await server_ep(q)

        async def pump(a: aiordma.Endpoint, b: aiordma.Endpoint) -> None:
            async def tx() -> None:
                for i in range(n):
                    await a.send(payload(i % 50, i))

            async def rx() -> None:
                for i in range(n):
                    assert await b.recv() == payload(i % 50, i)

            await asyncio.gather(tx(), rx())

        await asyncio.wait_for(asyncio.gather(pump(ep, srv), pump(srv, ep)), T)


async def test_recv_into(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        await ep.send(b"hello")
        small = bytearray(3)
        with pytest.raises(aiordma.MessageTooLarge) as ei:
            await asyncio.wait_for(srv.recv_into(small), T)
        assert ei.value.size == 5
        buf = bytearray(10)
        assert await asyncio.wait_for(srv.recv_into(buf), T) == 5  # the message was kept
        assert bytes(buf[:5]) == b"hello"
        with pytest.raises(TypeError):
            await srv.recv_into(b"readonly")


async def test_small_sends_of_one_iteration_share_a_batch_keeping_boundaries(opts: dict) -> None:
    """Sends queued in one loop iteration go as BATCH frames; the receiver still gets
    each message whole, in order, and a too-small ``recv_into`` keeps it.

    In ``hybrid`` (the default) whatever ``AIORDMA_POLL_MODE`` says: in ``polling`` the
    first sends of a burst each wait in place for their own completion (the tasks not
    started yet are not seen, poll_schedule.py), so they go one frame each, and with
    nobody receiving their frames hold the peer's 8 receive credits: the sends block,
    as flow control wants."""
    msgs = [payload(i % 70, i) for i in range(300)]
    async with pair(opts, recv_depth=8, poll_mode="hybrid") as (ep, q):
        srv = await server_ep(q)
        await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in msgs)), T)
        assert ep.statistics()["messages_batched"] > len(msgs) // 2
        got = [await asyncio.wait_for(srv.recv(), T)]  # msgs[0] is empty
        with pytest.raises(aiordma.MessageTooLarge):
            await asyncio.wait_for(srv.recv_into(bytearray(0)), T)  # msgs[1]: 1 byte
        buf = bytearray(100)
        for _ in msgs[1:]:
            n = await asyncio.wait_for(srv.recv_into(buf), T)
            got.append(bytes(buf[:n]))
        assert got == msgs
        st = srv.statistics()
        assert st["messages_received"] == len(msgs) and st["rx_queued"] == 0
        # every receive buffer went back to the sender: it can send a full window again
        await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in msgs)), T)
        assert [await asyncio.wait_for(srv.recv(), T) for _ in msgs] == msgs


async def test_recv_into_registered_buffer_is_zero_copy(opts: dict) -> None:
    big = payload(4 << 20, 7)
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        target = bytearray(len(big) + 100)
        srv.register(target)
        before = srv.statistics()["staging_registrations"]
        # the receive waits before the message comes (else the message may arrive
        # first and be read ahead into staging, as test_rendezvous_read_ahead shows)
        recv = asyncio.ensure_future(srv.recv_into(target))
        await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.gather(ep.send(big), recv), T)
        assert bytes(target[: len(big)]) == big
        assert srv.statistics()["staging_registrations"] == before  # no staging used
        # a large message too big for the buffer is kept
        small = bytearray(1 << 20)
        send = asyncio.ensure_future(ep.send(big))
        with pytest.raises(aiordma.MessageTooLarge):
            await asyncio.wait_for(srv.recv_into(small), T)
        assert await asyncio.wait_for(srv.recv(), T) == big
        await asyncio.wait_for(send, T)


async def test_rendezvous_read_ahead(opts: dict) -> None:
    """Large messages are read ahead into staging while the application does not
    receive (the sender's send completes, up to ``rndv_prefetch`` bytes); while it
    receives, the waiting receiver's message is READ straight into its buffer and at
    most ``min(rndv_prefetch, 4 MiB)`` of the ones behind it are read ahead meanwhile
    on RDMA hardware; on ``soft`` (READs are CPU copies) none are while the receiver
    READs straight into its own buffer.
    With ``rndv_prefetch=0`` nothing is staged: every READ lands in the caller's buffer."""
    big = [payload(300_000, i) for i in range(8)]
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        await asyncio.wait_for(asyncio.gather(*(ep.send(m) for m in big[:3])), T)
        assert srv.statistics()["rndv_staged"] == 3
        buf = bytearray(300_000)
        srv.register(buf)
        for m in big[:3]:
            assert await asyncio.wait_for(srv.recv_into(buf), T) == len(m) and buf == m
        assert await asyncio.wait_for(_receive_while_sent(ep, srv, buf, big), T) == big
        if srv.provider == "soft":
            assert srv.statistics()["rndv_staged"] == 3  # none while receiving

    async with pair(opts, rndv_prefetch=0) as (ep, q):
        srv = await server_ep(q)
        buf = bytearray(300_000)
        srv.register(buf)
        assert await asyncio.wait_for(_receive_while_sent(ep, srv, buf, big), T) == big
        assert srv.statistics()["rndv_staged"] == 0


async def _receive_while_sent(ep: aiordma.Endpoint, srv: aiordma.Endpoint, buf: bytearray,
                              msgs: list[bytes]) -> list[bytes]:
    async def receive() -> list[bytes]:
        out = []
        for _ in msgs:
            n = await srv.recv_into(buf)
            out.append(bytes(buf[:n]))
        return out

    receiver = asyncio.ensure_future(receive())
    await asyncio.sleep(0.01)  # the receiver waits
    await asyncio.gather(*(ep.send(m) for m in msgs))
    return await receiver


async def test_max_message_size(opts: dict) -> None:
    async with pair(opts, max_message_size=1 << 20) as (ep, q):
        await server_ep(q)
        assert ep.max_message_size == 1 << 20
        with pytest.raises(aiordma.MessageTooLarge):
            await ep.send(bytes((1 << 20) + 1))


async def test_one_sided_write_read_while_target_idles(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        region_buf = bytearray(1 << 20)
        region = srv.register(region_buf, remote_read=True, remote_write=True)
        await srv.send(region.remote().pack())
        desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
        assert desc == region.remote()
        local = bytearray(payload(1 << 20, 3))
        mr = ep.register(local)
        await asyncio.wait_for(ep.write(mr, desc), T)
        assert region_buf == local
        region_buf[:5] = b"XXXXX"
        back = bytearray(1 << 20)
        ep.register(back)
        await asyncio.wait_for(ep.read(back, desc), T)
        assert back[:5] == b"XXXXX" and back[5:] == local[5:]
        # slices of registered buffers work; the remote sub-range too
        await asyncio.wait_for(ep.write(memoryview(local)[100:200], desc.slice(1000, 100)), T)
        assert region_buf[1000:1100] == local[100:200]


@pytest.mark.parametrize(("signal_bytes", "want"), [(64 * 1024, [True, True, True]),
                                                   (1 << 20, [False, False, True])])
async def test_a_batch_of_large_writes_signals_each(opts: dict, signal_bytes: int,
                                                    want: list[bool],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Writes posted together as one batch: each of at least ``signal_bytes`` is
    signaled (its task resumes when it is done, not when the whole batch is), and with
    a larger ``signal_bytes`` only the batch's last one is (aiordma.protocol.engine)."""
    if "aiordma.resources" in native.compiled_modules():
        pytest.skip("stands a recording QP in (a compiled class refuses)")
    # the engine posts through the port (where the recording QP stands), not in C
    monkeypatch.setattr(Resources, "attach", lambda self, engine: None)
    size = 64 * 1024
    async with pair(opts, signal_bytes=signal_bytes) as (ep, q):
        srv = await server_ep(q)
        target = bytearray(4 * size)
        region = srv.register(target, remote_write=True)
        await srv.send(region.remote().pack())
        desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
        local = bytearray(payload(4 * size, 5))
        ep.register(local)
        real = ep._qp
        posted: list[list[bool]] = []

        class Recording:
            """The QP, recording which WRITEs of each post are signaled."""

            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            def post_send(self, wrs: list) -> None:
                posted.append([bool(int(w.send_flags) & int(SendFlags.SIGNALED))
                               for w in wrs if w.opcode == WROpcode.RDMA_WRITE])
                real.post_send(wrs)

        monkeypatch.setattr(ep, "_qp", Recording())
        # the first is posted at once, the other three together at the end of this loop
        # iteration
        await asyncio.wait_for(asyncio.gather(*(
            ep.write(memoryview(local)[i * size:(i + 1) * size], desc.slice(i * size, size))
            for i in range(4))), T)
        monkeypatch.undo()
        assert posted == [[True], want]
        assert target == local


async def test_write_with_imm(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        region_buf = bytearray(64)
        region = srv.register(region_buf, remote_write=True)
        local = bytearray(b"x" * 64)
        ep.register(local)
        for imm in (0, 1, 0xFFFFFFFF):
            await asyncio.wait_for(ep.write_with_imm(local, region.remote(), imm), T)
            assert await asyncio.wait_for(srv.recv_imm(), T) == imm
        assert region_buf == local
        with pytest.raises(ValueError):
            await ep.write_with_imm(local, region.remote(), 1 << 32)


async def test_long_transfers_are_posted_in_max_wr_size_pieces(opts: dict) -> None:
    """One work request moves at most the port's max_msg_sz (``max_wr_size`` lowers it):
    longer WRITE, READ, WRITE_WITH_IMM and rendezvous READs go in order, in pieces,
    and arrive whole."""
    n = 64 * 1024 + 123  # 17 pieces of 4 KiB, the last one short
    async with pair(opts, max_wr_size=4096) as (ep, q):
        srv = await server_ep(q)
        region_buf = bytearray(n)
        region = srv.register(region_buf, remote_read=True, remote_write=True)
        local = bytearray(payload(n, 7))
        ep.register(local)
        posted = ep.statistics()["work_requests_posted"]
        await asyncio.wait_for(ep.write(local, region.remote()), T)
        assert region_buf == local
        assert ep.statistics()["work_requests_posted"] - posted == 17
        region_buf[:] = payload(n, 8)
        back = bytearray(n)
        ep.register(back)
        await asyncio.wait_for(ep.read(back, region.remote()), T)
        assert back == region_buf
        local[:] = payload(n, 9)
        await asyncio.wait_for(ep.write_with_imm(local, region.remote(), 77), T)
        assert await asyncio.wait_for(srv.recv_imm(), T) == 77
        assert region_buf == local  # the immediate came after the last byte
        big = payload(1 << 20, 10)  # rendezvous: the receiver READs 256 pieces
        got_before = srv.statistics()["work_requests_posted"]
        sent = asyncio.ensure_future(ep.send(big))
        assert await asyncio.wait_for(srv.recv(), T) == big
        await asyncio.wait_for(sent, T)
        assert srv.statistics()["work_requests_posted"] - got_before >= 256


def test_max_wr_size_is_validated() -> None:
    with pytest.raises(ValueError, match="max_wr_size must be >= 4 KiB"):
        EndpointOptions.from_kwargs({"max_wr_size": 100})


def test_ack_timeout_and_retry_cnt_options() -> None:
    from aiordma.verbs.soft._core import local_ack_timeout_s

    o = EndpointOptions()
    assert (o.qp_timeout("soft"), o.qp_timeout("verbs"), o.retry_cnt) == (18, 14, 7)
    assert EndpointOptions.from_kwargs({"ack_timeout": 0}).qp_timeout("soft") == 0
    for bad in ({"ack_timeout": 32}, {"ack_timeout": -1}, {"retry_cnt": 8}, {"retry_cnt": -1}):
        with pytest.raises(ValueError):
            EndpointOptions.from_kwargs(bad)
    # soft: one try is 4.096 us * 2**timeout, at least 2**15 of them; 0 waits forever
    assert local_ack_timeout_s(0) is None
    assert local_ack_timeout_s(18) == pytest.approx(1.073741824)
    assert local_ack_timeout_s(3) == local_ack_timeout_s(15) == pytest.approx(0.134217728)


async def test_atomics(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        word = bytearray(16)
        region = srv.register(word, remote_atomic=True, remote_read=True)
        d = region.remote(0, 8)
        assert await asyncio.wait_for(ep.fetch_add(d, 5), T) == 0
        assert await asyncio.wait_for(ep.fetch_add(d, -1), T) == 5
        assert int.from_bytes(word[:8], "little") == 4
        assert await asyncio.wait_for(ep.compare_swap(d, 3, 99), T) == 4  # no swap
        assert await asyncio.wait_for(ep.compare_swap(d, 4, 99), T) == 4  # swapped
        assert int.from_bytes(word[:8], "little") == 99
        results = await asyncio.wait_for(asyncio.gather(*(ep.fetch_add(d, 1) for _ in range(200))), T)
        assert sorted(results) == list(range(99, 299))
        with pytest.raises(ValueError):
            await ep.fetch_add(region.remote(4, 8), 1)  # misaligned
        with pytest.raises(ValueError):
            await ep.fetch_add(region.remote(8, 4), 1)  # too short


async def test_atomics_from_two_connections_are_atomic(opts: dict) -> None:
    word = bytearray(8)
    got: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()
    done = asyncio.Event()

    async def handler(ep: aiordma.Endpoint) -> None:
        region = ep.register(word, remote_atomic=True)
        await ep.send(region.remote().pack())
        await got.put(ep)
        await done.wait()

    listener = await aiordma.listen(handler, HOST, 0, **opts)
    eps = [await aiordma.connect(HOST, listener.port, **opts) for _ in range(2)]
    try:
        descs = [aiordma.RemoteBuffer.unpack(await asyncio.wait_for(e.recv(), T)) for e in eps]

        async def adder(e: aiordma.Endpoint, d: aiordma.RemoteBuffer) -> None:
            for _ in range(5):
                await asyncio.gather(*(e.fetch_add(d, 1) for _ in range(50)))

        await asyncio.wait_for(asyncio.gather(*(adder(e, d) for e, d in zip(eps, descs, strict=True))), T)
        assert int.from_bytes(word, "little") == 500
    finally:
        done.set()
        for e in eps:
            await e.close()
        listener.close()
        await listener.wait_closed()


async def test_bad_arguments_refused_before_posting(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        region = srv.register(bytearray(64), remote_write=True)
        d = region.remote()
        with pytest.raises(ValueError, match="not registered"):
            await ep.write(bytearray(8), d)
        local = bytearray(128)
        ep.register(local)
        with pytest.raises(ValueError, match="larger than the remote"):
            await ep.write(local, d)
        with pytest.raises(TypeError):
            await ep.write(local, (1, 2, 3))  # type: ignore[arg-type]
        with pytest.raises(ValueError):
            region.remote(60, 8)
        with pytest.raises(TypeError):
            ep.register(b"read-only")
        with pytest.raises(ValueError):
            aiordma.RemoteBuffer.unpack(b"short")
        # nothing was posted: the connection still works
        await ep.send(b"still fine")
        assert await asyncio.wait_for(srv.recv(), T) == b"still fine"


@pytest.mark.parametrize("case", ["bad_rkey", "no_right", "out_of_range", "revoked"])
async def test_remote_access_errors(opts: dict, case: str) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        region = srv.register(bytearray(4096), remote_read=True,
                              remote_write=case != "no_right")
        d = region.remote()
        if case == "bad_rkey":
            d = aiordma.RemoteBuffer(d.addr, d.rkey ^ 0x5A5A00, d.length)
        elif case == "out_of_range":
            d = aiordma.RemoteBuffer(d.addr + 4000, d.rkey, 4096)  # forged past the end
        elif case == "revoked":
            region.close()
        local = bytearray(4096)
        ep.register(local)
        pending = asyncio.ensure_future(ep.recv())
        with pytest.raises(aiordma.RemoteAccessError) as ei:
            await asyncio.wait_for(ep.write(local, d), T)
        assert str(ei.value.status) == "IBV_WC_REM_ACCESS_ERR"
        # the connection is dead now: pending and later operations fail with ConnectionClosed
        with pytest.raises(aiordma.ConnectionClosed) as ci:
            await asyncio.wait_for(pending, T)
        assert isinstance(ci.value.__cause__, aiordma.RemoteAccessError)
        assert ep.closed
        with pytest.raises(aiordma.ConnectionClosed):
            await ep.send(b"x")


async def test_one_broken_connection_does_not_harm_another(opts: dict) -> None:
    async with pair(opts) as (ep1, q):
        srv1 = await server_ep(q)
        ep2 = await aiordma.connect(HOST, (ep1.peer_address or ("", 0))[1], **opts)
        try:
            srv2 = await server_ep(q)
            region = srv1.register(bytearray(64), remote_write=True)
            good = region.remote()
            local = bytearray(64)
            ep1.register(local)
            bad = aiordma.RemoteBuffer(region.addr, region.rkey ^ 0x100, 64)
            with pytest.raises(aiordma.RemoteAccessError):
                await asyncio.wait_for(ep1.write(local, bad), T)
            # a key handed to connection 1 is useless on connection 2 (one PD each)
            local2 = bytearray(64)
            ep2.register(local2)
            with pytest.raises(aiordma.RemoteAccessError):
                await asyncio.wait_for(ep2.write(local2, good), T)
            ep3 = await aiordma.connect(HOST, (ep1.peer_address or ("", 0))[1], **opts)
            srv3 = await server_ep(q)
            await ep3.send(b"alive")
            assert await asyncio.wait_for(srv3.recv(), T) == b"alive"
            await ep3.close()
            del srv2
        finally:
            ep2.abort()


async def test_cancelled_recv_does_not_lose_the_next_message(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        for size in (10, 2 << 20):  # eager and rendezvous
            r = asyncio.ensure_future(srv.recv())
            await asyncio.sleep(0.01)
            r.cancel()
            with pytest.raises(asyncio.CancelledError):
                await r
            data = payload(size, 1)
            await asyncio.wait_for(ep.send(data), T)
            assert await asyncio.wait_for(srv.recv(), T) == data


async def test_recv_cancelled_during_rendezvous_read(opts: dict) -> None:
    big = payload(8 << 20, 2)
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        send = asyncio.ensure_future(ep.send(big))
        for _ in range(200):  # until the rendezvous descriptor has arrived
            if srv.statistics()["rx_queued"]:
                break
            await asyncio.sleep(0.005)
        r = asyncio.ensure_future(srv.recv())
        await asyncio.sleep(0)  # the READ is posted
        r.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await r
        got = await asyncio.wait_for(srv.recv(), T) if not r.done() or r.cancelled() else r.result()
        assert got == big
        await asyncio.wait_for(send, T)
        await ep.send(b"next")
        assert await asyncio.wait_for(srv.recv(), T) == b"next"


async def test_cancelled_send_is_all_or_nothing(opts: dict) -> None:
    async with pair(opts, recv_depth=4) as (ep, q):
        srv = await server_ep(q)
        tasks = [asyncio.ensure_future(ep.send(payload(100 + 3000 * (i % 2), i))) for i in range(40)]
        await asyncio.sleep(0)
        for t in tasks[10::3]:  # most of these still wait for credits
            t.cancel()

        async def receive_until_end() -> list[bytes]:
            out = []
            while (m := await srv.recv()) != b"end":
                out.append(m)
            return out

        receiver = asyncio.ensure_future(receive_until_end())
        await asyncio.wait_for(asyncio.wait(tasks), T)
        await ep.send(b"end")
        received = await asyncio.wait_for(receiver, T)
        allowed = [payload(100 + 3000 * (i % 2), i) for i in range(40)]
        sent_ok = [m for m, t in zip(allowed, tasks, strict=True) if not t.cancelled()]
        # every completed send arrived whole, in order; cancelled ones whole or not at all
        assert all(m in allowed for m in received)
        assert [m for m in received if m in sent_ok] == sent_ok
        assert received == sorted(received, key=allowed.index)
        assert len(received) < 40  # the cancellations did drop queued messages


async def test_a_send_cancelled_before_it_was_posted_gives_its_staging_copy_back(
        opts: dict) -> None:
    """A rendezvous send from unregistered memory leases a staging copy when queued;
    cancelled while it waits for credits, it is not sent and the copy goes back to
    the cache (every copy ever made is there once the posted ones completed)."""
    async with pair(opts, recv_depth=4) as (ep, q):
        srv = await server_ep(q)
        tasks = [asyncio.ensure_future(ep.send(payload(40 * 1024, i))) for i in range(12)]
        await asyncio.sleep(0)
        for t in tasks[4:]:
            t.cancel()
        await asyncio.wait_for(asyncio.wait(tasks), T)
        sent = [t for t in tasks if not t.cancelled()]
        for _ in sent:
            await asyncio.wait_for(srv.recv(), T)
        await asyncio.wait_for(srv.send(b"ack"), T)  # after every RNDV_DONE
        assert await asyncio.wait_for(ep.recv(), T) == b"ack"
        staging = ep._res.staging_out
        assert len(sent) < 12
        assert staging.registrations == sum(len(lst) for lst in staging._free.values()) > 0


async def test_graceful_close_delivers_everything_then_eof(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        sends = [ep.send(payload(n, n)) for n in (10, 3 << 20, 20)]
        await asyncio.wait_for(asyncio.gather(*sends, ep.close()), T)
        assert ep.closed
        for n in (10, 3 << 20, 20):
            assert await asyncio.wait_for(srv.recv(), T) == payload(n, n)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)
        await ep.close()  # idempotent
        with pytest.raises(aiordma.ConnectionClosed):
            await ep.send(b"x")


async def test_frames_nobody_waits_for_are_unsignaled_and_never_hold_up_close(
        opts: dict) -> None:
    """A rendezvous send's RNDV frame (its sender waits for RNDV_DONE) and the RNDV_DONE
    (nobody waits) are posted unsignaled, so each stays on its send queue until a later
    signaled WR retires it. Neither close() nor the teardown after abort() may wait
    for a completion that will never come."""
    async with pair({**opts, "close_timeout": 5.0}) as (ep, q):
        srv = await server_ep(q)
        loop = asyncio.get_running_loop()
        big = payload(1 << 20, 5)
        recv = asyncio.ensure_future(srv.recv())
        await asyncio.wait_for(ep.send(big), T)
        assert await asyncio.wait_for(recv, T) == big
        assert ep.statistics()["send_queue_used"] == 1  # the RNDV frame
        assert srv.statistics()["send_queue_used"] == 1  # the RNDV_DONE frame
        await asyncio.wait_for(ep.send(b"small"), T)  # signaled: retires the RNDV
        assert ep.statistics()["send_queue_used"] == 0
        assert await asyncio.wait_for(srv.recv(), T) == b"small"
        await asyncio.wait_for(ep.send(big), T)
        assert await asyncio.wait_for(srv.recv(), T) == big
        t0 = loop.time()
        posted = ep.statistics()["work_requests_posted"]
        await asyncio.wait_for(ep.close(), T)  # after an unsignaled RNDV
        assert ep.statistics()["work_requests_posted"] == posted + 1  # CLOSE retired it
        posted = srv.statistics()["work_requests_posted"]
        regs = srv.statistics()["staging_registrations"]
        srv.abort()  # after an unsignaled RNDV_DONE
        await asyncio.wait_for(srv.wait_closed(), T)
        assert loop.time() - t0 < 4.0  # well under close_timeout
        # the teardown posted a flush marker, whose completion retired the RNDV_DONE
        assert srv.statistics()["work_requests_posted"] == posted + 1
        # (statistics stay readable after close, with their last values)
        assert regs >= 1 and srv.statistics()["staging_registrations"] == regs
        assert ep.statistics()["bytes_sent"] == 2 * len(big) + 5


async def test_abort_fails_pending_now_and_peer_notices(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        pending_local = asyncio.ensure_future(ep.recv())
        pending_peer = asyncio.ensure_future(srv.recv())
        await asyncio.sleep(0.01)
        ep.abort()
        ep.abort()  # idempotent
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(pending_local, T)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(pending_peer, T)
        await asyncio.wait_for(ep.wait_closed(), T)


async def test_async_context_manager_closes(opts: dict) -> None:
    async with pair(opts) as (ep, q):
        srv = await server_ep(q)
        async with ep:
            await ep.send(b"a")
        assert ep.closed
        assert await asyncio.wait_for(srv.recv(), T) == b"a"
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


async def _raw(port: int, data: bytes | None, wait: float = 0.0) -> None:
    r, w = await asyncio.open_connection(HOST, port)
    if data is not None:
        w.write(data)
        await w.drain()
    if wait:
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            await asyncio.wait_for(r.read(), wait)
    w.close()


@pytest.mark.parametrize("garbage", [
    b"GET / HTTP/1.1\r\n\r\n",
    b"AIOR\x00\x09\x01\x00\x00\x00\x00\x00",  # wrong version
    b"AIOR\x00\x01\x01\x00\xff\xff\xff\xff",  # oversize body length
    b"AIOR\x00\x01",  # truncated, then EOF
])
async def test_handshake_garbage_listener_keeps_serving(opts: dict, garbage: bytes) -> None:
    served = asyncio.Event()

    async def handler(ep: aiordma.Endpoint) -> None:
        served.set()
        await ep.send(await ep.recv())

    listener = await aiordma.listen(handler, HOST, 0, handshake_timeout=2.0, **opts)
    try:
        await _raw(listener.port, garbage, wait=3.0)
        ep = await aiordma.connect(HOST, listener.port, timeout=T, **opts)
        async with ep:
            await ep.send(b"ping")
            assert await asyncio.wait_for(ep.recv(), T) == b"ping"
        assert listener.handshake_errors == 1
    finally:
        listener.close()
        await listener.wait_closed()


async def test_silent_client_times_out_server_side(opts: dict) -> None:
    listener = await aiordma.listen(lambda ep: asyncio.sleep(0), HOST, 0, handshake_timeout=0.5,
                                    **opts)
    try:
        r, w = await asyncio.open_connection(HOST, listener.port)
        assert await asyncio.wait_for(r.read(), 5) is not None  # closed by the server
        w.close()
        assert listener.handshake_errors == 1
    finally:
        listener.close()
        await listener.wait_closed()


async def test_silent_server_gives_handshake_error(opts: dict) -> None:
    held: list[asyncio.StreamWriter] = []  # 3.12+ closes a connection whose writer is dropped
    srv = await asyncio.start_server(lambda r, w: held.append(w), HOST, 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(aiordma.HandshakeTimeout, match="no aiordma GREETING") as ei:
            await aiordma.connect(HOST, port, handshake_timeout=0.5, **opts)
        assert isinstance(ei.value, TimeoutError) and isinstance(ei.value, aiordma.HandshakeError)
    finally:
        for w in held:  # 3.12+: Server.wait_closed() waits for every connection to close
            w.close()
        srv.close()
        await srv.wait_closed()


async def test_garbage_server_gives_handshake_error(opts: dict) -> None:
    async def garbage(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(b"SSH-2.0-OpenSSH\r\n" * 4)

    srv = await asyncio.start_server(garbage, HOST, 0)
    port = srv.sockets[0].getsockname()[1]
    try:
        with pytest.raises(aiordma.HandshakeError, match="is not an aiordma listener: it "
                           "answered b'SSH-2.0"):
            await aiordma.connect(HOST, port, **opts)
    finally:
        srv.close()
        await srv.wait_closed()


async def test_connect_refused(opts: dict) -> None:
    s = socket.socket()
    s.bind((HOST, 0))
    port = s.getsockname()[1]
    s.close()
    with pytest.raises(aiordma.ConnectionRefused) as ei:
        await aiordma.connect(HOST, port, **opts)
    assert isinstance(ei.value, ConnectionRefusedError)


async def test_bad_options(opts: dict) -> None:
    with pytest.raises(TypeError, match="unknown option"):
        await aiordma.connect(HOST, 1, bogus=1, **opts)
    with pytest.raises(ValueError):
        await aiordma.listen(lambda ep: asyncio.sleep(0), HOST, 0, recv_depth=1, **opts)


async def test_handler_exception_keeps_listener_serving(opts: dict) -> None:
    calls = 0

    async def handler(ep: aiordma.Endpoint) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("handler bug")
        await ep.send(b"ok")

    listener = await aiordma.listen(handler, HOST, 0, **opts)
    try:
        ep1 = await aiordma.connect(HOST, listener.port, **opts)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(ep1.recv(), T)
        ep1.abort()
        ep2 = await aiordma.connect(HOST, listener.port, **opts)
        assert await asyncio.wait_for(ep2.recv(), T) == b"ok"
        await ep2.close()
    finally:
        listener.close()
        await listener.wait_closed()


async def test_cancelled_handler_destroys_its_endpoint_before_it_ends(opts: dict) -> None:
    """A handler cancelled (as asyncio.run() cancels what is left at exit) leaves nothing
    to a teardown task that may never run: its endpoint is destroyed by the time the
    handler's task has finished, and the client sees the connection drop."""
    got: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()

    async def handler(ep: aiordma.Endpoint) -> None:
        got.put_nowait(ep)
        await asyncio.Event().wait()

    listener = await aiordma.listen(handler, HOST, 0, **opts)
    try:
        ep = await aiordma.connect(HOST, listener.port, **opts)
        srv = await server_ep(got)
        await ep.send(b"in flight")  # a receive consumed, the server's others still posted
        tasks = set(listener._tasks)
        assert len(tasks) == 1
        for t in tasks:
            t.cancel()
        await asyncio.wait(tasks, timeout=T)
        assert all(t.cancelled() for t in tasks)
        assert srv.closed
        assert srv._life.done.done(), "the endpoint was left to a teardown task"
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(ep.recv(), T)
        ep.abort()
        await asyncio.wait_for(ep.wait_closed(), T)
    finally:
        listener.close()
        await listener.wait_closed()


async def test_soak_random_sizes_and_cancellations(opts: dict) -> None:
    """Random sizes, random receive cancellations: totals match exactly."""
    rng = random.Random(1234)
    sizes = [rng.choice([0, 1, 64, 1000, 16000, 17000, 200_000]) for _ in range(150)]
    async with pair(opts, recv_depth=8) as (ep, q):
        srv = await server_ep(q)

        async def receiver() -> list[bytes]:
            out: list[bytes] = []
            while len(out) < len(sizes):
                t = asyncio.ensure_future(srv.recv())
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
                    t.cancel()
                try:
                    out.append(await t)
                except asyncio.CancelledError:
                    continue
            return out

        async def sender() -> None:
            for i, n in enumerate(sizes):
                await ep.send(payload(n, i))

        got, _ = await asyncio.wait_for(asyncio.gather(receiver(), sender()), 60)
        assert got == [payload(n, i) for i, n in enumerate(sizes)]
        assert srv.statistics()["messages_received"] == len(sizes)
        assert ep.statistics()["messages_sent"] == len(sizes)


async def test_soak_parallel_connections_send_cancellations_and_aborts(opts: dict) -> None:
    """docs/reliability.md's soak: four connections at once, random sizes (eager, BATCH,
    rendezvous), random send cancellations, two connections aborted midway (one by each
    side). On every connection the receiver gets, in order and once each, a subsequence
    of what was attempted that holds every send that returned; the survivors get their
    end marker; the aborts touch no other connection; every future resolves."""
    rng = random.Random(4321)
    n, count = 4, 60
    abort_at = {1: ("client", 25), 3: ("server", 40)}  # connection -> (side, after sends)
    eps: asyncio.Queue[aiordma.Endpoint] = asyncio.Queue()

    async def handler(ep: aiordma.Endpoint) -> None:
        await eps.put(ep)
        await ep.wait_closed()

    listener = await aiordma.listen(handler, HOST, 0, recv_depth=8, **opts)
    pairs = []
    try:
        for _ in range(n):
            ep = await aiordma.connect(HOST, listener.port, timeout=T, recv_depth=8, **opts)
            pairs.append((ep, await asyncio.wait_for(eps.get(), T)))

        def msg(i: int, k: int) -> bytes:
            size = rng.choice([0, 1, 64, 1000, 16000, 17000, 200_000])
            return bytes([i, k % 251]) + payload(size, i * 1000 + k)

        async def sender(i: int) -> tuple[list[bytes], list[bytes], str]:
            ep, srv = pairs[i]
            attempted, completed = [], []
            for k in range(count):
                if i in abort_at and k == abort_at[i][1]:
                    (ep if abort_at[i][0] == "client" else srv).abort()
                m = msg(i, k)
                attempted.append(m)
                t = asyncio.ensure_future(ep.send(m))
                if rng.random() < 0.2:
                    await asyncio.sleep(0)
                    t.cancel()
                try:
                    await t
                    completed.append(m)
                except asyncio.CancelledError:
                    pass
                except aiordma.ConnectionClosed:
                    return attempted, completed, "closed"
            await ep.send(b"END")
            return attempted, completed, "end"

        async def receiver(i: int) -> tuple[list[bytes], str]:
            got: list[bytes] = []
            while True:
                try:
                    m = await pairs[i][1].recv()
                except aiordma.ConnectionClosed:
                    return got, "closed"
                if m == b"END":
                    return got, "end"
                got.append(m)

        results = await asyncio.wait_for(asyncio.gather(
            *(sender(i) for i in range(n)), *(receiver(i) for i in range(n))), 90)
        for i in range(n):
            attempted, completed, send_end = results[i]
            got, recv_end = results[n + i]
            assert (send_end, recv_end) == (("closed", "closed") if i in abort_at
                                             else ("end", "end")), i
            it = iter(attempted)
            assert all(any(m is a or m == a for a in it) for m in got), i  # in order, once
            if i not in abort_at:
                assert set(completed) <= set(got) and len(got) <= len(attempted)
                assert len(completed) >= count // 2  # (cancellation is the exception)
            else:
                assert pairs[i][0].closed
    finally:
        for ep, srv in pairs:
            ep.abort()
            srv.abort()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)


@pytest.mark.parametrize("event", ["QP_FATAL", "PORT_ERR"])
async def test_device_async_events_fail_the_right_connections(opts: dict, event: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from aiordma.verbs import AsyncEvent, EventType

    async with pair(opts) as (ep1, q):
        srv1 = await server_ep(q)
        ep2 = await aiordma.connect(HOST, (ep1.peer_address or ("", 0))[1], **opts)
        try:
            srv2 = await server_ep(q)
            device = ep1._device
            ev = (AsyncEvent(EventType.QP_FATAL, qp_num=ep1.qp_num) if event == "QP_FATAL"
                  else AsyncEvent(EventType.PORT_ERR, port_num=1))
            monkeypatch.setattr(device.ctx, "get_async_events", lambda: [ev])
            pending = asyncio.ensure_future(ep1.recv())
            await asyncio.sleep(0)
            device._on_async_events()
            monkeypatch.undo()
            with pytest.raises(aiordma.ConnectionClosed, match=event):
                await asyncio.wait_for(pending, T)
            if event == "QP_FATAL":  # only that connection died
                await ep2.send(b"fine")
                assert await asyncio.wait_for(srv2.recv(), T) == b"fine"
            else:  # the port went down: every connection on the device failed
                assert ep2.closed and srv1.closed
        finally:
            ep2.abort()
