"""``Endpoint.send_eof()``: the half-close under ``RDMATransport.write_eof()``."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator

import pytest
from _pairs import T
from _pairs import pair as endpoint_pair

import aiordma
from aiordma import native
from aiordma.resources import Resources
from aiordma.verbs import QPAttr, QPState, SendWR


@contextlib.asynccontextmanager
async def pair(provider: str, **extra: object) -> AsyncIterator[tuple[aiordma.Endpoint,
                                                                      aiordma.Endpoint]]:
    """(client endpoint, server endpoint): ``_pairs.pair`` with the server's end."""
    async with endpoint_pair({"provider": provider}, **extra) as (ep, q):
        yield ep, await asyncio.wait_for(q.get(), T)


async def test_send_eof_after_pending_sends_then_peer_still_sends_back(provider_name: str) -> None:
    async with pair(provider_name, recv_depth=4) as (ep, srv):
        big = os.urandom(3 << 20)
        sends = [asyncio.ensure_future(ep.send(m)) for m in (b"a", big, b"b" * 100)]
        await asyncio.sleep(0)
        eof = asyncio.ensure_future(ep.send_eof())
        await asyncio.sleep(0)  # send_eof has started: later sends are refused
        with pytest.raises(aiordma.ConnectionClosed, match="send_eof"):
            await ep.send(b"late")
        assert await asyncio.wait_for(srv.recv(), T) == b"a"
        assert await asyncio.wait_for(srv.recv(), T) == big
        assert await asyncio.wait_for(srv.recv(), T) == b"b" * 100
        for _ in range(2):  # EOF is sticky
            with pytest.raises(aiordma.ConnectionClosed):
                await asyncio.wait_for(srv.recv(), T)
        await asyncio.wait_for(asyncio.gather(*sends, eof), T)
        await ep.send_eof()  # idempotent
        assert not ep.closed and not srv.closed
        # The other direction is open, credits included: many times recv_depth.
        for i in range(40):
            await asyncio.wait_for(srv.send(i.to_bytes(2, "little")), T)
            assert await asyncio.wait_for(ep.recv(), T) == i.to_bytes(2, "little")
        await asyncio.wait_for(srv.close(), T)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(ep.recv(), T)
        await asyncio.wait_for(ep.close(), T)  # no second CLOSE frame; no hang
        assert ep.closed


async def test_close_right_after_send_eof_sends_one_eof(provider_name: str) -> None:
    async with pair(provider_name) as (ep, srv):
        await ep.send(b"x")
        eof = asyncio.ensure_future(ep.send_eof())
        await asyncio.sleep(0)  # send_eof has started (3.12+ wait_for runs close() first)
        await asyncio.wait_for(ep.close(), T)
        await asyncio.wait_for(eof, T)
        assert await asyncio.wait_for(srv.recv(), T) == b"x"
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


async def test_close_with_a_paused_reader_loses_nothing(provider_name: str) -> None:
    """The peer reads nothing while we fill its window and close: our CLOSE has a credit
    of its own (it does not wait for the reader, like TCP's FIN), so close() finishes
    gracefully well within close_timeout, and the reader later gets every message, then
    EOF. (Without that credit close() would give up after close_timeout and abort, and
    the peer would lose what it had not read yet.)"""
    async with pair(provider_name, recv_depth=4, close_timeout=2.0) as (ep, srv):
        msgs = [bytes([i]) * 9000 for i in range(8)]  # one per frame (no two fit a BATCH)
        sends = [asyncio.ensure_future(ep.send(m)) for m in msgs]
        done, _ = await asyncio.wait(sends, timeout=0.3)
        assert 0 < len(done) < len(msgs)  # the window is full, the reader sleeps
        for f in sends:  # give up on what could not go yet
            if not f.done():
                f.cancel()
        await asyncio.gather(*sends, return_exceptions=True)
        went = [m for m, f in zip(msgs, sends, strict=True) if not f.cancelled()]
        assert all(f.exception() is None for f in sends if not f.cancelled())
        t0 = asyncio.get_running_loop().time()
        await asyncio.wait_for(ep.close(), T)
        assert asyncio.get_running_loop().time() - t0 < 1.5  # did not sit out close_timeout
        got = [await asyncio.wait_for(srv.recv(), T) for _ in went]
        assert got == went
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


async def test_close_answering_the_peers_close_does_not_wait_out_close_timeout(
        provider_name: str) -> None:
    """The peer closes (CLOSE, then it destroys its QP); we read to EOF and close at
    once, so our CLOSE may be posted towards a QP that no longer exists. No ACK will
    ever come for it (rxe retransmits into the void): our close() must finish when
    the peer is known gone, not after close_timeout."""
    async with pair(provider_name, close_timeout=5.0) as (ep, srv):
        await ep.send(b"bye")
        closing = asyncio.ensure_future(ep.close())
        assert await asyncio.wait_for(srv.recv(), T) == b"bye"
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await asyncio.wait_for(srv.close(), T)
        assert loop.time() - t0 < 4.0  # well under close_timeout
        await asyncio.wait_for(closing, T)


async def test_send_eof_on_closed_endpoint_raises(provider_name: str) -> None:
    async with pair(provider_name) as (ep, _srv):
        ep.abort()
        with pytest.raises(aiordma.ConnectionClosed):
            await ep.send_eof()


async def test_peer_closed_with_our_sends_short_of_credits_fails_them(provider_name: str) -> None:
    """The peer closes without reading: our sends waiting for credits can never go.
    They fail (like writing to a TCP peer that closed) instead of hanging; what the
    peer sent before its CLOSE stays readable."""
    async with pair(provider_name, recv_depth=4) as (ep, srv):
        await srv.send(b"before close")
        # over half the eager size: no two share a BATCH frame, so 20 need 20 credits
        sends = [asyncio.ensure_future(ep.send(b"x" * 9000)) for _ in range(20)]
        await asyncio.sleep(0.1)
        await asyncio.wait_for(srv.close(), T)
        results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), T)
        assert any(isinstance(r, aiordma.ConnectionClosed) for r in results)
        assert not ep.closed  # CLOSE_WAIT: still readable
        assert await asyncio.wait_for(ep.recv(), T) == b"before close"
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(ep.recv(), T)
        with pytest.raises(aiordma.ConnectionClosed, match="peer closed"):
            await ep.send(b"late")
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(ep.send_eof(), T)
        await asyncio.wait_for(ep.close(), T)  # no CLOSE frame to a dead peer, no wait


async def test_peer_closed_fails_the_posted_sends_it_never_acknowledged(
        provider_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The peer sent CLOSE and tore down while a send of ours was posted and never
    acknowledged (rxe retransmits such a send into the void for longer than any close
    waits): after the grace period the sender gets ConnectionClosed instead of hanging."""
    if "aiordma.endpoint" in native.compiled_modules():
        pytest.skip("replaces the endpoint's QP with a stand-in (a compiled class refuses)")
    # the engine posts through the port (where the stand-in stands), not in C
    monkeypatch.setattr(Resources, "attach", lambda self, engine: None)
    async with pair(provider_name) as (ep, srv):
        real = ep._qp
        held: list[SendWR] = []

        class Void:
            """The QP, except that sends are accepted and held (never complete)."""

            def __getattr__(self, name: str) -> object:
                return getattr(real, name)

            def post_send(self, wrs: list[SendWR]) -> None:
                held.extend(wrs)

        ep._qp = Void()  # type: ignore[assignment]
        try:
            send = asyncio.ensure_future(ep.send(b"into the void"))
            await asyncio.sleep(0.1)
            assert not send.done()
            await asyncio.wait_for(srv.close(), T)
            with pytest.raises(aiordma.ConnectionClosed, match="peer closed"):
                await asyncio.wait_for(send, T)
            assert not ep.closed  # CLOSE_WAIT: the endpoint itself is still open
        finally:
            ep._qp = real
            # what a device does with them once the QP is in ERR: flush them (the
            # teardown waits for that)
            real.modify(QPAttr(QPState.ERR))
            real.post_send(held)


async def test_peer_closed_we_read_everything_later(provider_name: str) -> None:
    """Reading what a closed peer sent returns no credits to it (nothing may be posted
    to its dead QP), so every message is delivered, then EOF."""
    async with pair(provider_name, recv_depth=16) as (ep, srv):
        for i in range(14):
            await ep.send(bytes([i]) * 100)
        await asyncio.wait_for(ep.close(), T)
        await asyncio.sleep(0.2)  # the peer is gone before we read
        for i in range(14):
            assert await asyncio.wait_for(srv.recv(), T) == bytes([i]) * 100
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(srv.recv(), T)


async def test_a_receiver_whose_peer_aborted_after_its_credit_frame_tears_down_at_once(
        provider_name: str) -> None:
    """The receiver's last frame was a CREDIT nobody waits for (posted unsignaled: it
    may finish without a completion); then the peer aborts. The receiver's abort must
    not wait for that frame (``close_timeout`` here far above the test's bound): its
    teardown flushes what can complete and destroys."""
    async with pair(provider_name, recv_depth=4, close_timeout=3 * T) as (ep, srv):
        for i in range(3):  # enough consumed receives that the receiver returns credits
            await asyncio.wait_for(ep.send(b"%d" % i), T)
            assert await asyncio.wait_for(srv.recv(), T) == b"%d" % i
        ep.abort()
        await asyncio.wait_for(ep.wait_closed(), T)
        srv.abort()
        await asyncio.wait_for(srv.wait_closed(), T)
