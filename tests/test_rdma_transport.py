"""RDMATransport conformance: every test body runs against asyncio's own TCP transport
(the reference) and against aiordma on the provider under test, on both loops.

What a byte-stream transport must do: ordering, large writes split and reassembled,
write after close, EOF both ways, close/abort contracts, flow control with a slow
reader, the one fatal-error path for protocol callbacks, BufferedProtocol with small
buffers, and asyncio.Server semantics for the server.
"""

from __future__ import annotations

import asyncio
import sys

import pytest
from _stacks import (
    BufferedRecorder,
    KeepOpen,
    Recorder,
    Stack,
    T,
    backlog_bytes,
    connected,
    eventually,
    loop_errors,
    pattern,
    port_of,
)

import aiordma

KiB, MiB = 1024, 1024 * 1024


@pytest.fixture(params=["tcp", "rdma"])
def stack(request: pytest.FixtureRequest) -> Stack:
    if request.param == "rdma":
        return Stack("rdma", request.getfixturevalue("provider_name"))
    return Stack("tcp")


def default_limits(stack: Stack) -> tuple[int, int]:
    """asyncio's initial (low, high): (16 KiB, 64 KiB). uvloop's TCP transport starts
    with a low-water mark of 16 bytes (64 // 4, a unit slip in its constants); its
    set_write_buffer_limits() computes asyncio's values."""
    loop = asyncio.get_running_loop()
    if not stack.rdma and type(loop).__module__.startswith("uvloop"):
        return (16, 64 * KiB)
    return (16 * KiB, 64 * KiB)


class Echo(Recorder):
    """Writes back everything it receives."""

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.transport.write(data)


async def test_order_callbacks_and_echo(stack: Stack) -> None:
    sizes = [1, 100, 16 * KiB - 9, 16 * KiB - 8, 16 * KiB, 64 * KiB + 3, 1 * MiB, 7]
    async with connected(stack, server=Echo) as c:
        sent = b""
        for i, n in enumerate(sizes):
            chunk = pattern(n, i)
            c.transport.write(bytearray(chunk) if i % 2 else chunk)
            sent += chunk
        c.transport.writelines([b"a", memoryview(b"bc"), bytearray(b"def")])
        sent += b"abcdef"
        await c.client.wait_bytes(len(sent))
        assert bytes(c.client.data) == sent
        assert bytes(c.server.data) == sent
        c.transport.close()
        assert c.transport.is_closing()
        assert await asyncio.wait_for(c.client.lost, T) is None
        assert await asyncio.wait_for(c.server.lost, T) is None
        assert c.client.grammar() == "MDL"
        assert c.server.grammar() == "MDEL"  # the peer's close is an EOF first


async def test_large_write_split_and_reassembled(stack: Stack) -> None:
    async with connected(stack) as c:
        big = pattern(5 * MiB, 1)
        c.transport.write(big)
        await c.server.wait_bytes(len(big))
        assert bytes(c.server.data) == big
        assert c.server.chunks > 1  # a stream: no message boundaries promised
        small = [i.to_bytes(4, "little") for i in range(10_000)]
        for s in small:
            c.transport.write(s)
        await c.server.wait_bytes(len(big) + 40_000)
        assert bytes(c.server.data[len(big):]) == b"".join(small)
        if stack.rdma:  # coalesced: far fewer messages than writes
            assert c.server.chunks < 2_000


async def test_write_argument_checks_and_after_close(stack: Stack) -> None:
    async with connected(stack) as c:
        t = c.transport
        with pytest.raises(TypeError, match="bytes-like"):
            t.write("text")
        t.write(b"")  # nothing
        t.write(b"a")
        t.close()
        t.close()  # idempotent
        t.write(b"b")  # after close: dropped, not raised (asyncio's selector transport)
        assert t.is_closing()
        assert await asyncio.wait_for(c.client.lost, T) is None
        await asyncio.wait_for(c.server.lost, T)
        assert bytes(c.server.data) == b"a"
        assert c.server.grammar() == "MDEL"


async def test_write_after_write_eof_raises(stack: Stack) -> None:
    async with connected(stack, server=KeepOpen) as c:
        assert c.transport.can_write_eof()
        c.transport.write(b"x")
        c.transport.write_eof()
        c.transport.write_eof()  # idempotent
        with pytest.raises(RuntimeError, match=r"Cannot call write\(\) after write_eof\(\)"):
            c.transport.write(b"y")
        await asyncio.wait_for(c.server.eof, T)
        assert bytes(c.server.data) == b"x"


@pytest.mark.parametrize("first", ["client", "server"])
async def test_eof_both_directions_half_close(stack: Stack, first: str) -> None:
    """One side write_eof()s; the other (eof_received -> True) stays open, answers and
    closes; the first gets the answer, then EOF, returns False and closes itself."""
    async with connected(stack, client=KeepOpen if first == "server" else Recorder,
                         server=KeepOpen if first == "client" else Recorder) as c:
        a, b = (c.client, c.server) if first == "client" else (c.server, c.client)
        a.transport.write(b"question")
        a.transport.write_eof()
        await asyncio.wait_for(b.eof, T)
        assert bytes(b.data) == b"question"
        assert not b.transport.is_closing()  # eof_received returned True
        b.transport.write(b"answer" * 1000)
        b.transport.close()
        assert await asyncio.wait_for(a.lost, T) is None
        assert await asyncio.wait_for(b.lost, T) is None
        assert bytes(a.data) == b"answer" * 1000
        assert a.grammar() == "MDEL"
        assert b.grammar() == "MDEL"


async def test_eof_received_false_closes_the_transport(stack: Stack) -> None:
    async with connected(stack) as c:
        c.server.transport.close()
        assert await asyncio.wait_for(c.client.lost, T) is None
        assert c.client.grammar() == "MEL"
        assert c.transport.is_closing()


async def test_flow_control_slow_reader_pauses_and_resumes_writer(stack: Stack) -> None:
    total = backlog_bytes(stack)
    async with connected(stack) as c:
        assert c.transport.get_write_buffer_limits() == default_limits(stack)
        c.server.transport.pause_reading()
        assert not c.server.transport.is_reading()
        c.server.transport.pause_reading()  # idempotent
        data = pattern(total, 2)
        for off in range(0, total, 64 * KiB):
            c.transport.write(data[off: off + 64 * KiB])
        assert c.client.pauses == 1 and c.client.paused
        await asyncio.sleep(0.3)
        # Held back by the paused reader, nothing delivered past what it buffers.
        assert c.client.paused and c.client.resumes == 0
        assert c.transport.get_write_buffer_size() > total // 2
        c.server.transport.resume_reading()
        assert c.server.transport.is_reading()
        await c.server.wait_bytes(total)
        await c.client.until(lambda: c.client.resumes == 1)
        assert c.transport.get_write_buffer_size() <= 16 * KiB
        assert bytes(c.server.data) == data  # nothing lost, nothing reordered
        assert c.client.pauses == 1


async def test_set_write_buffer_limits_like_asyncio(stack: Stack) -> None:
    async with connected(stack) as c:
        t = c.transport
        t.set_write_buffer_limits(high=100)
        assert t.get_write_buffer_limits() == (25, 100)
        t.set_write_buffer_limits(low=10)
        assert t.get_write_buffer_limits() == (10, 40)
        t.set_write_buffer_limits()
        assert t.get_write_buffer_limits() == (16 * KiB, 64 * KiB)
        with pytest.raises(ValueError, match=r"^high \(1\) must be >= low \(2\) must be >= 0$"):
            t.set_write_buffer_limits(high=1, low=2)
        with pytest.raises(ValueError, match=r"must be >= 0"):
            t.set_write_buffer_limits(high=0, low=-1)
        assert t.get_write_buffer_limits() == (16 * KiB, 64 * KiB)  # unchanged


async def test_close_while_writer_paused_flushes_everything(stack: Stack) -> None:
    total = backlog_bytes(stack)
    async with connected(stack) as c:
        c.server.transport.pause_reading()
        data = pattern(total, 3)
        c.transport.write(data)
        assert c.client.paused
        c.transport.close()
        await asyncio.sleep(0.2)
        assert not c.client.lost.done()  # close() waits for the flush
        c.server.transport.resume_reading()
        assert await asyncio.wait_for(c.client.lost, T) is None
        assert await asyncio.wait_for(c.server.lost, T) is None
        assert bytes(c.server.data) == data
        assert c.server.grammar() == "MDEL"


async def test_close_while_reading_paused(stack: Stack) -> None:
    async with connected(stack) as c:
        c.server.transport.pause_reading()
        c.transport.write(pattern(1 * MiB))
        await asyncio.sleep(0.05)
        c.server.transport.close()
        assert await asyncio.wait_for(c.server.lost, T) is None
        assert c.server.grammar() == "ML"  # paused: nothing delivered, then closed
        exc = await asyncio.wait_for(c.client.lost, T)
        assert exc is None or isinstance(exc, ConnectionError)


async def test_abort_with_data_pending(stack: Stack) -> None:
    async with connected(stack) as c:
        data = pattern(4 * MiB, 4)
        c.transport.write(data)
        c.transport.abort()
        c.transport.abort()  # idempotent
        assert c.transport.is_closing()
        if stack.rdma:  # (uvloop's TCP transport reports the dropped bytes until closed)
            assert c.transport.get_write_buffer_size() == 0
        c.transport.write(b"dropped")
        assert await asyncio.wait_for(c.client.lost, T) is None
        assert c.client.grammar() == "ML"
        exc = await asyncio.wait_for(c.server.lost, T)
        assert exc is None or isinstance(exc, ConnectionError)  # TCP: FIN or RST
        assert data.startswith(bytes(c.server.data))
        if stack.rdma:
            assert isinstance(exc, aiordma.ConnectionClosed)


class RaisesInData(Recorder):
    raise_in = "data_received"


class RaisesInEof(Recorder):
    raise_in = "eof_received"


@pytest.mark.parametrize("proto", [RaisesInData, RaisesInEof])
async def test_protocol_callback_raising_reaches_connection_lost(stack: Stack,
                                                                 proto: type[Recorder]) -> None:
    async with connected(stack, server=proto) as c:
        c.transport.write(b"trigger")
        if proto is RaisesInEof:
            await c.server.wait_bytes(7)
            c.transport.write_eof()
        exc = await asyncio.wait_for(c.server.lost, T)
        assert isinstance(exc, ValueError) and "boom" in str(exc)
        assert len(c.errors) == 1 and c.errors[0]["exception"] is exc
        assert c.errors[0]["protocol"] is c.server
        if stack.rdma:
            assert c.errors[0]["message"] == (
                f"Fatal error: protocol.{proto.raise_in}() call failed.")
        c.errors.clear()
        assert c.server.transport.is_closing()
        peer = await asyncio.wait_for(c.client.lost, T)  # the peer sees the connection end
        assert peer is None or isinstance(peer, ConnectionError)


@pytest.mark.parametrize("sizes", [(1, 7, 100, 4096), (256 * KiB,)], ids=["small", "large"])
async def test_buffered_protocol(stack: Stack, sizes: tuple[int, ...]) -> None:
    proto = type("Buffered", (BufferedRecorder,), {"sizes": sizes})
    async with connected(stack, server=proto) as c:
        data = pattern(1 * MiB + 3, 5)
        c.transport.write(data)
        for i in range(100):
            c.transport.write(bytes([i]) * i)
        total = len(data) + sum(range(100))
        await c.server.wait_bytes(total)
        assert bytes(c.server.data) == data + b"".join(bytes([i]) * i for i in range(100))
        srv = c.server
        assert isinstance(srv, BufferedRecorder)
        assert all(h == -1 or h > 0 for h in srv.hints)
        c.transport.close()
        assert await asyncio.wait_for(srv.lost, T) is None
        assert srv.grammar() == "MDEL"


async def test_extra_info_and_repr(stack: Stack) -> None:
    async with connected(stack) as c:
        t = c.transport
        peer = t.get_extra_info("peername")
        local = t.get_extra_info("sockname")
        assert peer[1] == c.server.transport.get_extra_info("sockname")[1]
        assert local[1] == c.server.transport.get_extra_info("peername")[1]
        assert t.get_extra_info("no such thing", 42) == 42
        assert t.get_protocol() is c.client
        assert t.is_reading()
        if stack.rdma:
            ep = t.get_extra_info("endpoint")
            assert isinstance(ep, aiordma.Endpoint)
            assert t.get_extra_info("qp_num") == ep.qp_num
            assert t.get_extra_info("peer_qp_num") == c.server.transport.get_extra_info("qp_num")
            assert t.get_extra_info("provider") == stack.provider
            assert t.get_extra_info("device") == ep.device_name
            assert "RDMATransport" in repr(t)
            assert isinstance(t, aiordma.RDMATransport)
            assert isinstance(t, asyncio.Transport)


async def test_server_start_serving_close_wait_closed(stack: Stack) -> None:
    loop = asyncio.get_running_loop()
    made: list[Recorder] = []

    def factory() -> Recorder:
        made.append(Recorder())
        return made[-1]

    with loop_errors() as errors:
        server = await stack.create_server(factory, start_serving=False)
        assert not server.is_serving()
        assert server.get_loop() is loop
        port = port_of(server)  # bound, but not listening before start_serving()
        with pytest.raises(ConnectionRefusedError):
            await asyncio.wait_for(stack.create_connection(Recorder, port), T)
        assert not made
        await server.start_serving()
        assert server.is_serving()
        await server.start_serving()  # idempotent
        t, client = await asyncio.wait_for(stack.create_connection(Recorder, port), T)
        await eventually(lambda: bool(made) and made[0].made.done())
        server.close()
        server.close()  # idempotent
        assert not server.is_serving()
        assert not server.sockets
        t.write(b"still open")  # close() leaves existing connections alone
        await made[0].wait_bytes(10)
        waiting = asyncio.ensure_future(server.wait_closed())
        if stack.rdma or sys.version_info >= (3, 12):
            await asyncio.sleep(0.1)
            assert not waiting.done()  # waits for the connection (asyncio >= 3.12)
        t.close()
        await asyncio.wait_for(waiting, T)
        await asyncio.wait_for(made[0].lost, T)
        with pytest.raises(RuntimeError, match="is closed"):
            await server.serve_forever()
        assert not errors


async def test_server_serve_forever_and_context_manager(stack: Stack) -> None:
    server = await stack.create_server(Recorder, start_serving=False)
    async with server:
        task = asyncio.ensure_future(server.serve_forever())
        await asyncio.sleep(0.05)
        assert server.is_serving()
        with pytest.raises(RuntimeError, match="already being awaited"):
            await server.serve_forever()
        t, client = await asyncio.wait_for(stack.create_connection(Recorder, port_of(server)), T)
        t.close()
        await asyncio.wait_for(client.lost, T)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, T)
        assert not server.is_serving()
    assert not server.is_serving()


async def test_client_protocol_factory_raising(stack: Stack) -> None:
    def bad() -> Recorder:
        raise ZeroDivisionError("factory")

    server = await stack.create_server(Recorder)
    try:
        with pytest.raises(ZeroDivisionError):
            await asyncio.wait_for(stack.create_connection(bad, port_of(server)), T)
        t, client = await asyncio.wait_for(stack.create_connection(Recorder, port_of(server)), T)
        t.close()
        assert await asyncio.wait_for(client.lost, T) is None
    finally:
        server.close()
        await asyncio.wait_for(server.wait_closed(), T)


async def test_server_protocol_factory_raising(provider_name: str) -> None:
    """aiordma reports the error to the loop's exception handler (asyncio's selector
    loop does so only in debug mode; uvloop leaves the client hanging), drops that
    connection, and keeps serving."""
    stack = Stack("rdma", provider_name)
    calls = 0

    def flaky() -> Recorder:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ZeroDivisionError("factory")
        return Recorder()

    with loop_errors() as errors:
        server = await stack.create_server(flaky)
        try:
            t, client = await asyncio.wait_for(stack.create_connection(Recorder, port_of(server)), T)
            exc = await asyncio.wait_for(client.lost, T)  # the server dropped it
            assert isinstance(exc, aiordma.ConnectionClosed)
            assert [type(e.get("exception")) for e in errors] == [ZeroDivisionError]
            assert errors[0]["message"] == "Error on transport creation for incoming connection"
            assert server.is_serving()
            t, client = await asyncio.wait_for(stack.create_connection(Recorder, port_of(server)), T)
            t.close()
            assert await asyncio.wait_for(client.lost, T) is None
        finally:
            server.close()
            await asyncio.wait_for(server.wait_closed(), T)


async def test_rdma_options_and_chunking(provider_name: str) -> None:
    """aiordma-only knobs: write_chunk_size (default: the endpoint's eager payload)."""
    stack = Stack("rdma", provider_name)
    async with connected(stack, client_kw={"write_chunk_size": 1000}) as c:
        c.transport.write(pattern(10_000))
        await c.server.wait_bytes(10_000)
        assert c.server.chunks >= 10  # 1000-byte messages
        ep = c.transport.get_extra_info("endpoint")
        assert c.transport._chunk == 1000 and ep.eager_payload > 1000
    with pytest.raises(ValueError, match="write_chunk_size"):
        await aiordma.create_server(Recorder, "127.0.0.1", 0, provider=provider_name,
                                    write_chunk_size=0)
    with pytest.raises(TypeError, match="unknown option"):
        await aiordma.create_connection(Recorder, "127.0.0.1", 1, provider=provider_name,
                                        no_such_option=1)
