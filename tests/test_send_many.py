"""``Endpoint.send_many``: many messages, one wait, on the provider under test and on both
loops -- boundaries and order kept, every item checked before anything is sent, a
cancellation delivering a prefix, rendezvous messages among eager ones, a failure
reported once."""

from __future__ import annotations

import array
import asyncio
import gc
import random

import pytest
from _pairs import T, pair

import aiordma

pytestmark = pytest.mark.usefixtures("soft_cma")  # soft: with and without CMA

KiB = 1024


@pytest.fixture
def opts(provider_name: str) -> dict:
    return {"provider": provider_name}


def payload(n: int, seed: int = 0) -> bytes:
    return random.Random(seed * 1000003 + n).randbytes(n)


async def receive(srv: aiordma.Endpoint, count: int) -> list[bytes]:
    return [await asyncio.wait_for(srv.recv(), T) for _ in range(count)]


async def test_messages_arrive_one_by_one_in_order_with_their_boundaries(opts: dict) -> None:
    """Sizes from 0 B to past the eager size (rendezvous), of every bytes-like type,
    from any iterable; the counters count each message."""
    sizes = [0, 1, 64, 16 * KiB - 9, 16 * KiB, 3, 200 * KiB, 7, 1 << 20, 5]
    msgs = [payload(n, i) for i, n in enumerate(sizes)]
    async with pair(opts) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        items: list[object] = [m if i % 3 == 0 else bytearray(m) if i % 3 == 1
                               else memoryview(m) for i, m in enumerate(msgs)]
        await asyncio.wait_for(ep.send_many(items), T)
        assert await receive(srv, len(msgs)) == msgs
        assert ep.messages_sent == len(msgs) and ep.bytes_sent == sum(sizes)
        # buffers the engine's eager path does not take: cast to bytes on the way
        grid = memoryview(bytearray(range(12))).cast("B", (3, 4))
        words = array.array("I", [1, 2, 3])
        await asyncio.wait_for(ep.send_many([b"x", grid, words, b"y"]), T)
        assert await receive(srv, 4) == [b"x", bytes(range(12)), words.tobytes(), b"y"]
        await asyncio.wait_for(ep.send_many(m for m in msgs[:3]), T)  # a generator
        await asyncio.wait_for(ep.send_many([]), T)  # nothing: returns at once
        await asyncio.wait_for(ep.send(b"after"), T)
        assert await receive(srv, 4) == [*msgs[:3], b"after"]


async def test_thousands_of_small_messages_share_frames_and_credits(opts: dict) -> None:
    """More messages than the peer has receive buffers (credits) and than one frame
    holds: they go in BATCH frames as credits come back, every one exactly once."""
    msgs = [b"%d" % i for i in range(5000)]
    async with pair(opts, recv_depth=8) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        got = asyncio.ensure_future(receive(srv, len(msgs)))
        await asyncio.wait_for(ep.send_many(msgs), T)
        assert await asyncio.wait_for(got, T) == msgs
        st = ep.statistics()
        assert st["messages_batched"] > 0 and st["work_requests_posted"] < len(msgs)


async def test_a_bad_item_raises_before_anything_is_sent(opts: dict) -> None:
    async with pair(opts, max_message_size=64 * KiB) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        with pytest.raises(TypeError, match="bytes-like"):
            await ep.send_many([b"a", b"b", "text"])
        for one in (b"one message", bytearray(b"one"), memoryview(b"one"), "text"):
            with pytest.raises(TypeError, match="iterable of messages"):
                await ep.send_many(one)
        with pytest.raises(TypeError, match="C-contiguous"):
            await ep.send_many([b"a", memoryview(bytearray(8))[::2]])
        with pytest.raises(aiordma.MessageTooLarge, match="message 2 of 65537 bytes") as ei:
            await ep.send_many([b"a", b"b", bytes(64 * KiB + 1)])
        assert ei.value.size == 64 * KiB + 1
        await asyncio.wait_for(ep.send(b"only this"), T)
        assert await asyncio.wait_for(srv.recv(), T) == b"only this"
        assert ep.messages_sent == 1
        await asyncio.wait_for(ep.close(), T)
        with pytest.raises(aiordma.ConnectionClosed):
            await ep.send_many([b"x"])


async def test_a_cancelled_send_many_delivers_a_prefix_each_message_whole(opts: dict) -> None:
    """Cancelled while most of its messages wait for credits: those handed to the
    device arrive whole and in order, the rest never do (their staging copies go
    back), and the connection goes on."""
    msgs = [payload(100 if i % 5 else 40 * KiB, i) for i in range(400)]
    async with pair(opts, recv_depth=4) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        task = asyncio.ensure_future(ep.send_many(msgs))
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert not task.done()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, T)
        await asyncio.wait_for(ep.send(b"end"), T)
        received = []
        while (m := await asyncio.wait_for(srv.recv(), T)) != b"end":
            received.append(m)
        assert received == msgs[:len(received)]  # a prefix, each message whole
        assert len(received) < len(msgs)  # the cancellation dropped queued messages
        await asyncio.wait_for(srv.send(b"ack"), T)  # after every RNDV_DONE of the prefix
        assert await asyncio.wait_for(ep.recv(), T) == b"ack"
        assert ep.statistics()["queued"] == 0 and ep.messages_sent == 1
        staging = ep._res.staging_out  # every staging copy made is back in the cache
        assert staging.registrations == sum(len(lst) for lst in staging._free.values()) > 0
        await asyncio.wait_for(ep.send_many([b"still", b"works"]), T)
        assert await receive(srv, 2) == [b"still", b"works"]


async def test_a_failed_connection_fails_the_call_once(opts: dict) -> None:
    """The peer goes away while messages wait for credits: the call raises
    ConnectionClosed, and no waiter's exception is left unretrieved."""
    loop = asyncio.get_running_loop()
    unretrieved: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: unretrieved.append(ctx))
    try:
        async with pair(opts, recv_depth=4) as (ep, q):
            srv = await asyncio.wait_for(q.get(), T)
            msgs = [bytes(100)] * 50 + [bytes(64 * KiB)] * 3 + [bytes(10)]
            task = asyncio.ensure_future(ep.send_many(msgs))
            await asyncio.sleep(0)
            srv.abort()
            with pytest.raises(aiordma.ConnectionClosed):
                await asyncio.wait_for(task, T)
        del task
        gc.collect()
        await asyncio.sleep(0)
        assert not [c for c in unretrieved if "never retrieved" in str(c.get("message"))]
    finally:
        loop.set_exception_handler(old)


async def test_send_many_and_send_from_other_tasks_interleave_whole(opts: dict) -> None:
    """Other tasks' sends land between calls, never inside a message."""
    async with pair(opts) as (ep, q):
        srv = await asyncio.wait_for(q.get(), T)
        a = [b"a%d" % i for i in range(300)]
        b = [b"b%d" % i for i in range(300)]
        singles = [asyncio.ensure_future(ep.send(b"s%d" % i)) for i in range(50)]
        await asyncio.wait_for(asyncio.gather(ep.send_many(a), ep.send_many(b), *singles), T)
        got = await receive(srv, 650)
        assert sorted(got) == sorted([*a, *b, *(b"s%d" % i for i in range(50))])
        assert [m for m in got if m[:1] == b"a"] == a
        assert [m for m in got if m[:1] == b"b"] == b
        assert [m for m in got if m[:1] == b"s"] == [b"s%d" % i for i in range(50)]
