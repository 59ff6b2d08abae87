"""asyncio streams over aiordma (``aiordma.open_connection``/``start_server``): every
test body also runs against ``asyncio.open_connection``/``start_server`` over TCP, the
reference, on both loops."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from _stacks import HOST, Stack, T, backlog_bytes, eventually, loop_errors, pattern, port_of

import aiordma

KiB, MiB = 1024, 1024 * 1024

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@pytest.fixture(params=["tcp", "rdma"])
def stack(request: pytest.FixtureRequest) -> Stack:
    if request.param == "rdma":
        return Stack("rdma", request.getfixturevalue("provider_name"))
    return Stack("tcp")


@contextlib.asynccontextmanager
async def served(stack: Stack, handler: Handler, **kw: object
                 ) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter,
                                          list[BaseException]]]:
    """A server running ``handler`` per connection and one client connection. Yields
    (reader, writer, exceptions raised by handlers); fails on loop errors."""
    failures: list[BaseException] = []

    async def guarded(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await handler(r, w)
        except Exception as exc:
            failures.append(exc)
            raise

    with loop_errors() as errors:
        server = await stack.start_server(guarded, **kw)
        try:
            reader, writer = await asyncio.wait_for(
                stack.open_connection(port_of(server), **kw), T)
            try:
                yield reader, writer, failures
            finally:
                writer.close()
                with contextlib.suppress(ConnectionError):
                    await asyncio.wait_for(writer.wait_closed(), T)
        finally:
            server.close()
            await asyncio.wait_for(server.wait_closed(), T)
        assert not errors or failures, errors


async def upper_lines(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
    while line := await r.readline():
        w.write(line.upper())
        await w.drain()
    w.close()
    await w.wait_closed()


async def test_lines_echo_and_close(stack: Stack) -> None:
    async with served(stack, upper_lines) as (r, w, failures):
        lines = [f"line {i} {'x' * (i * 37 % 3000)}\n".encode() for i in range(200)]
        w.writelines(lines[:100])
        for line in lines[100:]:
            w.write(line)
        await asyncio.wait_for(w.drain(), T)
        for line in lines:
            assert await asyncio.wait_for(r.readline(), T) == line.upper()
        w.close()
        assert w.is_closing()
        await asyncio.wait_for(w.wait_closed(), T)
        assert not failures
        assert await asyncio.wait_for(r.read(), T) == b""  # closed: EOF


async def test_large_payload_readexactly(stack: Stack) -> None:
    big = pattern(5 * MiB, 7)

    async def echo(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.readexactly(len(big))
        w.write(data)
        await w.drain()
        w.close()

    async with served(stack, echo) as (r, w, failures):
        w.write(big)
        await asyncio.wait_for(w.drain(), T)
        assert await asyncio.wait_for(r.readexactly(len(big)), T) == big
        assert await asyncio.wait_for(r.read(), T) == b""
        assert not failures


async def test_drain_waits_for_a_slow_reader(stack: Stack) -> None:
    total = backlog_bytes(stack)
    go = asyncio.Event()
    received = bytearray()

    async def slow(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await go.wait()
        while data := await r.read(1 * MiB):
            received.extend(data)
        w.close()

    data = pattern(total, 8)
    async with served(stack, slow) as (r, w, failures):
        for off in range(0, total, 1 * MiB):
            w.write(data[off: off + MiB])
        drain = asyncio.ensure_future(w.drain())
        await asyncio.sleep(0.3)
        assert not drain.done()  # flow control: the reader does not read
        assert w.transport.get_write_buffer_size() > total // 2
        go.set()
        await asyncio.wait_for(drain, T)
        w.write_eof()
        assert await asyncio.wait_for(r.read(), T) == b""
        assert received == data
        assert not failures


async def test_write_eof_half_close(stack: Stack) -> None:
    async def summarize(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        data = await r.read()  # until the client's EOF
        assert r.at_eof()
        w.write(f"{len(data)} bytes\n".encode())
        await w.drain()
        w.close()
        await w.wait_closed()

    async with served(stack, summarize) as (r, w, failures):
        assert w.can_write_eof()
        w.write(b"a" * 100_000)
        w.write_eof()
        assert await asyncio.wait_for(r.readline(), T) == b"100000 bytes\n"
        assert await asyncio.wait_for(r.read(), T) == b""
        assert r.at_eof()
        assert not failures


async def test_limit_kwarg(stack: Stack) -> None:
    seen: list[BaseException] = []

    async def readline(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            await r.readline()
        except ValueError as exc:  # LimitOverrunError becomes ValueError in readline()
            seen.append(exc)
        w.close()

    async with served(stack, readline, limit=1024) as (r, w, failures):
        w.write(b"y" * 5000 + b"\n")
        await asyncio.wait_for(w.drain(), T)
        assert await asyncio.wait_for(r.read(), T) == b""
        await eventually(lambda: bool(seen))
        assert "limit" in str(seen[0])
        assert not failures


async def test_peer_abort_surfaces_to_reader(stack: Stack) -> None:
    async def abort(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.readexactly(3)
        w.transport.abort()

    async with served(stack, abort) as (r, w, failures):
        w.write(b"abc")
        try:
            got = await asyncio.wait_for(r.read(), T)
        except ConnectionError as exc:  # RDMA: ConnectionClosed; TCP: maybe a reset
            got = b""
            if stack.rdma:
                assert isinstance(exc, aiordma.ConnectionClosed)
        assert got == b""
        assert not failures


async def test_server_close_and_wait_closed(stack: Stack) -> None:
    async def hold(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read()
        w.close()
        await w.wait_closed()

    server = await stack.start_server(hold)
    async with server:
        assert server.is_serving()
        r, w = await asyncio.wait_for(stack.open_connection(port_of(server)), T)
        w.write(b"hi")
        w.close()
        await asyncio.wait_for(w.wait_closed(), T)
    assert not server.is_serving()
    with pytest.raises(ConnectionRefusedError):
        await asyncio.wait_for(stack.open_connection(port_of_closed(stack)), T)


def port_of_closed(stack: Stack) -> int:
    """A port nobody listens on (bound and released again)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        port: int = s.getsockname()[1]
    return port
