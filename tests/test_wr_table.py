"""Who receives a completion: the reactor's engines by QP (``EngineTable``), and the
completions of several connections sharing one CQ, each routed to its own engine."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from _engine_sim import Port, make_engine
from _pairs import HOST, T

import aiordma
from aiordma.protocol.engine import EngineTable


def test_the_engine_table_attaches_finds_and_forgets() -> None:
    a, b = make_engine(Port())[0], make_engine(Port())[0]
    table = EngineTable()
    assert len(table) == 0 and table.get(7) is None
    table.attach(7, a)
    table.attach(0xFFFFFF, b)  # the largest QP number
    assert table.get(7) is a and table.get(0xFFFFFF) is b and len(table) == 2
    table.attach(7, b)  # a QP number used again names its new engine
    assert table.get(7) is b
    table.detach(7)
    table.detach(7)  # twice: nothing happens
    assert table.get(7) is None and table.get(0xFFFFFF) is b and len(table) == 1
    with pytest.raises(TypeError):
        table.attach(8, None)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        table.attach(8, object())  # type: ignore[arg-type]
    assert len(table) == 1


async def test_connections_sharing_a_cq_each_get_their_own_completions(
        provider_name: str) -> None:
    """Three connections in one process: the six QPs share the reactor's CQ, so one
    poll takes completions of different QPs one after another. Every message reaches
    its own connection, in order; after one connection is aborted (its engine
    detached) the others go on."""
    n_conns, rounds = 3, 40
    got: dict[int, list[bytes]] = {}
    servers: list[aiordma.Endpoint] = []

    async def echo(ep: aiordma.Endpoint) -> None:
        servers.append(ep)
        with contextlib.suppress(aiordma.ConnectionClosed):
            while True:
                data = await ep.recv()
                await ep.send(data)

    listener = await aiordma.listen(echo, HOST, 0, provider=provider_name)
    eps: list[aiordma.Endpoint] = []
    try:
        for _ in range(n_conns):
            eps.append(await aiordma.connect(HOST, listener.port, timeout=T,
                                             provider=provider_name))
        reactor = eps[0]._reactor
        assert all(ep._reactor is reactor for ep in eps)
        c_path = eps[0].statistics()["c_path"]  # (else no engine is attached)
        engines = len(reactor.wrs.engines)
        assert engines == (2 * n_conns if c_path else 0)

        async def talk(i: int, ep: aiordma.Endpoint, count: int) -> None:
            mine = got.setdefault(i, [])
            for r in range(count):
                msg = f"conn {i} message {r}".encode()
                await ep.send(msg)
                mine.append(await ep.recv())

        # every send of a round is posted in one loop iteration: their completions
        # and the echoes' interleave in the CQ
        await asyncio.wait_for(asyncio.gather(*(talk(i, ep, rounds)
                                                for i, ep in enumerate(eps))), T)
        for i in range(n_conns):
            assert got[i] == [f"conn {i} message {r}".encode() for r in range(rounds)]

        eps[0].abort()
        await asyncio.wait_for(eps[0].wait_closed(), T)
        assert len(reactor.wrs.engines) == (engines - 1 if c_path else 0)
        got.clear()
        await asyncio.wait_for(asyncio.gather(*(talk(i, ep, rounds)
                                                for i, ep in enumerate(eps) if i)), T)
        for i in range(1, n_conns):
            assert got[i] == [f"conn {i} message {r}".encode() for r in range(rounds)]
    finally:
        for ep in eps:
            ep.abort()
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)
