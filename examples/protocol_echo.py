"""An ``asyncio.Protocol`` echo server and client over aiordma: plain asyncio code.

    python examples/protocol_echo.py                                # both, one process
    python examples/protocol_echo.py --role server --port 18516     # prints "listening on"
    python examples/protocol_echo.py --role client --port 18516 --count 200 --size 64K

The protocols are what one writes for TCP; only ``aiordma.create_server`` /
``aiordma.create_connection`` replace the loop's methods. The server echoes every byte
and passes back-pressure on (``pause_writing`` -> ``pause_reading``); the client
streams ``--count`` x ``--size`` bytes, honouring ``pause_writing``, checks the echo
byte for byte and exits 1 on a mismatch, 2 on a connection error.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from typing import Any

from _common import parse_size, run

import aiordma


class EchoServer(asyncio.Protocol):
    """Write back everything; stop reading while the echo cannot be written."""

    corrupt = False  # --corrupt: flip the first byte echoed (tests the client's check)

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.corrupt:
            self.corrupt = False
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        self.transport.write(data)

    def pause_writing(self) -> None:
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.transport.resume_reading()

    def eof_received(self) -> bool:
        return False  # the transport closes once the echo is flushed


class EchoClient(asyncio.Protocol):
    """Check the echoed stream against what was sent; ``done`` holds the verdict."""

    def __init__(self, expected: bytes) -> None:
        loop = asyncio.get_running_loop()
        self.expected = memoryview(expected)
        self.received = 0
        self.done: asyncio.Future[None] = loop.create_future()
        self.can_write = asyncio.Event()
        self.can_write.set()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        end = self.received + len(data)
        if self.done.done():
            return
        if end > len(self.expected) or self.expected[self.received:end] != data:
            self.done.set_exception(ValueError(f"MISMATCH in bytes {self.received}..{end}"))
            return
        self.received = end
        if end == len(self.expected):
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.can_write.clear()

    def resume_writing(self) -> None:
        self.can_write.set()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.can_write.set()
        if not self.done.done():
            self.done.set_exception(exc or ConnectionError(
                f"connection closed after {self.received} of {len(self.expected)} bytes"))


def message(seq: int, size: int) -> bytes:
    """Message ``seq`` of ``size`` bytes: each one different."""
    block = bytes((seq * 131 + i * 7) & 0xFF for i in range(min(size, 4093)))
    return (block * (size // len(block) + 1))[:size]


async def client(args: argparse.Namespace, opts: dict[str, Any]) -> int:
    size = parse_size(args.size)
    if size < 1 or args.count < 1:
        print("protocol_echo: --size and --count must be >= 1", file=sys.stderr)
        return 2
    data = b"".join(message(seq, size) for seq in range(args.count))
    try:
        transport, proto = await aiordma.create_connection(
            lambda: EchoClient(data), args.host, args.port, timeout=args.timeout, **opts)
    except OSError as exc:
        print(f"protocol_echo: cannot connect to {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 2
    assert isinstance(proto, EchoClient)
    t0 = time.perf_counter()
    for seq in range(args.count):
        await asyncio.wait_for(proto.can_write.wait(), args.timeout)  # flow control
        transport.write(data[seq * size: (seq + 1) * size])
    try:
        await asyncio.wait_for(proto.done, args.timeout)
    except ValueError as exc:
        print(f"protocol_echo: {exc}", file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"protocol_echo: {exc!r} after {proto.received} bytes", file=sys.stderr)
        return 2
    finally:
        transport.close()
    dt = time.perf_counter() - t0
    print(f"protocol_echo ok: provider={transport.get_extra_info('provider')} "
          f"{args.count} x {size} B echoed in {dt * 1e3:.1f} ms "
          f"({2 * len(data) / dt / 1e6:.1f} MB/s both ways)", flush=True)
    return 0


async def serve(args: argparse.Namespace, opts: dict[str, Any],
                ready: asyncio.Future[int] | None = None) -> int:
    factory = type("CorruptingEchoServer", (EchoServer,), {"corrupt": True}) if args.corrupt \
        else EchoServer
    server = await aiordma.create_server(factory, args.host, args.port, **opts)
    port = server.sockets[0].getsockname()[1]
    if ready is not None:
        ready.set_result(port)
        async with server:
            await asyncio.Future()  # until cancelled
        return 0
    print(f"listening on {args.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with server:
        await stop.wait()
        server.close_clients()
    return 0


async def main(args: argparse.Namespace) -> int:
    opts: dict[str, Any] = {"provider": args.provider} if args.provider else {}
    if args.role == "server":
        return await serve(args, opts)
    if args.role == "client":
        return await client(args, opts)
    ready: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    args.port = 0
    server = asyncio.ensure_future(serve(args, opts, ready))
    try:
        args.port = await asyncio.wait_for(asyncio.shield(ready), args.timeout)
        return await client(args, opts)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--role", choices=["both", "server", "client"], default="both")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=18516)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--size", default="64K", help="bytes per write; K/M suffixes")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--corrupt", action="store_true", help="server: damage one echoed byte")
    p.add_argument("--provider", choices=["soft", "verbs"], default=None)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    a = p.parse_args()
    sys.exit(run(main(a), a.loop))
