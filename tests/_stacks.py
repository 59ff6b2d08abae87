"""One asyncio-level test body, two stacks: asyncio's own TCP ("tcp", the reference
behaviour) and aiordma ("rdma", the provider under test).

``stack`` fixture (defined in the test modules): a ``Stack`` for each. Helpers: a
``Recorder`` protocol that records every callback and checks asyncio's callback grammar,
a ``BufferedRecorder``, ``loop_errors()`` which collects ``call_exception_handler``
contexts (tests fail on unexpected ones), and ``connected()`` which yields a connected
client transport with both protocols.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import re
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import aiordma

HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
T = 20.0  # bound for every await


@dataclasses.dataclass
class Stack:
    name: str  # "tcp" | "rdma"
    provider: str | None = None

    @property
    def rdma(self) -> bool:
        return self.name == "rdma"

    def _opts(self, kw: dict[str, Any]) -> dict[str, Any]:
        return {"provider": self.provider, **kw} if self.rdma else kw

    async def create_server(self, factory: Callable[[], asyncio.BaseProtocol],
                            **kw: Any) -> Any:
        if self.rdma:
            return await aiordma.create_server(factory, HOST, 0, **self._opts(kw))
        return await asyncio.get_running_loop().create_server(factory, HOST, 0, **kw)

    async def create_connection(self, factory: Callable[[], asyncio.BaseProtocol], port: int,
                                **kw: Any) -> tuple[Any, Any]:
        if self.rdma:
            return await aiordma.create_connection(factory, HOST, port, **self._opts(kw))
        return await asyncio.get_running_loop().create_connection(factory, HOST, port, **kw)

    async def start_server(self, cb: Any, **kw: Any) -> Any:
        if self.rdma:
            return await aiordma.start_server(cb, HOST, 0, **self._opts(kw))
        return await asyncio.start_server(cb, HOST, 0, **kw)

    async def open_connection(self, port: int, **kw: Any
                              ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        if self.rdma:
            return await aiordma.open_connection(HOST, port, **self._opts(kw))
        return await asyncio.open_connection(HOST, port, **kw)


def port_of(server: Any) -> int:
    port: int = server.sockets[0].getsockname()[1]
    return port


def backlog_bytes(stack: Stack) -> int:
    """How much a flow-control test writes to a reader that does not read: more than
    the connection holds in flight, so most of it stays queued at the writer. A
    loopback TCP connection buffers megabytes in the kernel (32 MiB); the RDMA
    transport holds at most its credit window (recv_depth eager frames, 1 MiB by
    default) in flight, so 8 MiB does, and keeps the test short on rxe under TCG, where
    these transfers run at a few MB/s."""
    return 8 * 1024 * 1024 if stack.rdma else 32 * 1024 * 1024


def pattern(n: int, seed: int = 0) -> bytes:
    """``n`` bytes that show any reordering, loss or duplication of 4-byte words."""
    words = (n + 3) // 4
    return b"".join(((i * 2654435761 + seed) & 0xFFFFFFFF).to_bytes(4, "little")
                    for i in range(words))[:n]


async def eventually(cond: Callable[[], bool], timeout: float = T) -> None:
    """Poll ``cond`` every 5 ms until it holds; fail after ``timeout`` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        assert loop.time() < deadline, f"condition not met within {timeout:g}s"
        await asyncio.sleep(0.005)


@contextlib.contextmanager
def loop_errors() -> Iterator[list[dict[str, Any]]]:
    """Collect the loop's ``call_exception_handler`` contexts instead of logging them."""
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        yield errors
    finally:
        loop.set_exception_handler(old)


class Recorder(asyncio.Protocol):
    """Records the callbacks; ``violations`` lists any break of asyncio's grammar
    ``connection_made -> data_received* -> eof_received? -> connection_lost`` or of
    pause/resume pairing."""

    keep_open = False  # what eof_received returns
    raise_in: str | None = None  # "data_received" | "eof_received": raise ValueError there

    def __init__(self) -> None:
        loop = asyncio.get_running_loop()
        self.transport: Any = None
        self.codes: list[str] = []
        self.data = bytearray()
        self.chunks = 0
        self.pauses = 0
        self.resumes = 0
        self.paused = False
        self.violations: list[str] = []
        self.made: asyncio.Future[Any] = loop.create_future()
        self.eof: asyncio.Future[None] = loop.create_future()
        self.lost: asyncio.Future[BaseException | None] = loop.create_future()
        self._changed = asyncio.Event()

    # -- grammar
    def _event(self, code: str) -> None:
        self.codes.append(code)
        if not re.fullmatch(r"MD*E?L?", "".join(self.codes)):
            self.violations.append(f"callback order {''.join(self.codes)}")
        self._changed.set()

    def grammar(self) -> str:
        """The callbacks so far, data_received runs collapsed: e.g. 'MDEL'."""
        return re.sub(r"D+", "D", "".join(self.codes))

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self.transport = transport
        self._event("M")
        self.made.set_result(transport)

    def data_received(self, data: bytes) -> None:
        if not isinstance(data, bytes) or not data:
            self.violations.append(f"data_received({data!r:.40})")
        self.data += data
        self.chunks += 1
        self._event("D")
        if self.raise_in == "data_received":
            raise ValueError("boom in data_received")

    def eof_received(self) -> bool:
        self._event("E")
        self.eof.set_result(None)
        if self.raise_in == "eof_received":
            raise ValueError("boom in eof_received")
        return self.keep_open

    def connection_lost(self, exc: BaseException | None) -> None:
        self._event("L")
        self.lost.set_result(exc)

    def pause_writing(self) -> None:
        if self.paused:
            self.violations.append("pause_writing twice")
        self.paused = True
        self.pauses += 1
        self._changed.set()

    def resume_writing(self) -> None:
        if not self.paused:
            self.violations.append("resume_writing without pause")
        self.paused = False
        self.resumes += 1
        self._changed.set()

    async def until(self, cond: Callable[[], bool], timeout: float = T) -> None:
        """Wait (bounded) until ``cond()`` holds; re-checked after every callback."""
        async def wait() -> None:
            while not cond():
                self._changed.clear()
                await self._changed.wait()

        await asyncio.wait_for(wait(), timeout)

    async def wait_bytes(self, n: int) -> None:
        await self.until(lambda: len(self.data) >= n or self.lost.done())
        assert len(self.data) >= n, f"got {len(self.data)} of {n} bytes before connection_lost"


class KeepOpen(Recorder):
    keep_open = True


class BufferedRecorder(asyncio.BufferedProtocol, Recorder):
    """A BufferedProtocol offering buffers of the sizes in ``sizes`` (cycled)."""

    sizes: tuple[int, ...] = (1, 7, 100, 4096)

    def __init__(self) -> None:
        Recorder.__init__(self)
        self._i = 0
        self._buf = memoryview(bytearray(max(self.sizes)))
        self._offered = 0
        self.hints: list[int] = []

    def get_buffer(self, sizehint: int) -> memoryview:
        self.hints.append(sizehint)
        self._offered = self.sizes[self._i % len(self.sizes)]
        self._i += 1
        return self._buf[: self._offered]

    def eof_received(self) -> bool:  # BufferedProtocol's would shadow Recorder's
        return Recorder.eof_received(self)

    def buffer_updated(self, nbytes: int) -> None:
        if not 0 < nbytes <= self._offered:
            self.violations.append(f"buffer_updated({nbytes}) for a buffer of {self._offered}")
        self.data += self._buf[:nbytes]
        self.chunks += 1
        self._event("D")


@dataclasses.dataclass
class Conn:
    transport: Any  # the client's
    client: Recorder
    server: Recorder
    errors: list[dict[str, Any]]


@contextlib.asynccontextmanager
async def connected(stack: Stack, client: type[Recorder] = Recorder,
                    server: type[Recorder] = Recorder, *, client_kw: dict[str, Any] | None = None,
                    server_kw: dict[str, Any] | None = None) -> AsyncIterator[Conn]:
    """A connected pair. On exit both ends are aborted if still open, the server is
    closed, and the test fails on grammar violations or unexpected loop errors (a test
    that expects some removes them from ``conn.errors``)."""
    with loop_errors() as errors:
        q: asyncio.Queue[Recorder] = asyncio.Queue()

        def factory() -> Recorder:
            p = server()
            q.put_nowait(p)
            return p

        srv = await stack.create_server(factory, **(server_kw or {}))
        conn: Conn | None = None
        try:
            t, c = await asyncio.wait_for(
                stack.create_connection(client, port_of(srv), **(client_kw or {})), T)
            s = await asyncio.wait_for(q.get(), T)
            await asyncio.wait_for(s.made, T)
            conn = Conn(t, c, s, errors)
            yield conn
            assert not c.violations and not s.violations, (c.violations, s.violations)
            assert not errors, errors
        finally:
            if conn is not None:
                for p in (conn.client, conn.server):
                    # (not after connection_lost: asyncio 3.11's selector transport
                    # crashes on abort() after a close() that had to flush)
                    if p.transport is not None and not p.lost.done():
                        p.transport.abort()
                for p in (conn.client, conn.server):
                    await asyncio.wait_for(asyncio.shield(p.lost), T)
            srv.close()
            await asyncio.wait_for(srv.wait_closed(), T)
