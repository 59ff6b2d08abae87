"""``aiordma.bench.common.exchange_server``/``exchange_lines``: the one-line JSON swap
by which the pyverbs-async and UCXX baselines connect."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from aiordma.bench.common import exchange_lines, exchange_server

T = 10.0


async def test_each_side_gets_the_others_line_then_after_runs() -> None:
    loop = asyncio.get_running_loop()
    connected: asyncio.Future[None] = loop.create_future()
    seen: list[dict[str, Any]] = []
    order: list[str] = []

    async def answer(peer: dict[str, Any]) -> dict[str, Any]:
        seen.append(peer)
        order.append("answer")
        return {"qpn": 2}

    server, where = await exchange_server(answer, connected, after=lambda: order.append("after"))
    try:
        assert where["host"] == "127.0.0.1" and where["port"] > 0
        peer = await asyncio.wait_for(
            exchange_lines(where["host"], where["port"], {"qpn": 1}, "test"), T)
        await asyncio.wait_for(connected, T)
    finally:
        server.close()
    assert peer == {"qpn": 2} and seen == [{"qpn": 1}] and order == ["answer", "after"]


async def test_a_server_that_closes_without_answering_is_named() -> None:
    async def close_at_once(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readline()  # (the client's line read: closing sends a FIN, not a reset)
        w.close()

    server = await asyncio.start_server(close_at_once, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(ConnectionError, match="ucxx: the exchange connection closed"):
            await asyncio.wait_for(exchange_lines("127.0.0.1", port, {}, "ucxx"), T)
    finally:
        server.close()
