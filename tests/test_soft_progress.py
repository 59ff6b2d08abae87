"""The soft device's manual progress (the event loop moves the bytes) keeps the one-sided
guarantee: a target whose event loop is blocked still serves READ, WRITE and atomics
(the NIC thread's watchdog takes its completion channel over)."""

from __future__ import annotations

import asyncio
import threading

import pytest

import aiordma

HOST = "127.0.0.1"


def test_blocked_target_loop_still_serves_one_sided(provider_name: str) -> None:
    if provider_name != "soft":
        pytest.skip("soft provider only")
    port_q: list[int] = []
    ready = threading.Event()
    unblock = threading.Event()
    errors: list[BaseException] = []

    async def target_main() -> None:
        async def handler(ep: aiordma.Endpoint) -> None:
            buf = bytearray(4096)
            buf[:5] = b"hello"
            mr = ep.register(buf, remote_read=True, remote_write=True, remote_atomic=True)
            await ep.send(mr.remote().pack())
            assert await ep.recv() == b"block now"
            unblock.wait(60)  # the loop is blocked: nobody polls this endpoint's CQ
            assert bytes(buf[8:13]) == b"world"
            try:
                await ep.recv()
            except aiordma.ConnectionClosed:
                pass

        listener = await aiordma.listen(handler, HOST, 0, provider="soft")
        port_q.append(listener.port)
        ready.set()
        async with listener:
            while not unblock.is_set():
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)

    def target_thread() -> None:
        try:
            asyncio.run(target_main())
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=target_thread, daemon=True)
    t.start()
    assert ready.wait(30)

    async def requester() -> None:
        ep = await aiordma.connect(HOST, port_q[0], timeout=20, provider="soft")
        try:
            desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), 20))
            local = bytearray(16)
            mr = ep.register(local)
            await ep.send(b"block now")
            await asyncio.sleep(0.1)  # the target is inside unblock.wait() now
            await asyncio.wait_for(ep.read(memoryview(local)[:5], desc.slice(0, 5)), 20)
            assert bytes(local[:5]) == b"hello"
            local[:5] = b"world"
            await asyncio.wait_for(ep.write(memoryview(local)[:5], desc.slice(8, 5)), 20)
            old = await asyncio.wait_for(ep.fetch_add(desc.slice(16, 8), 7), 20)
            assert old == 0
            assert await asyncio.wait_for(ep.fetch_add(desc.slice(16, 8), 1), 20) == 7
            mr.close()
        finally:
            unblock.set()
            await ep.close()

    try:
        asyncio.run(requester())
    finally:
        unblock.set()
        t.join(30)
    assert not errors, errors
