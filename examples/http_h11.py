"""HTTP/1.1 (h11) over aiordma: third-party protocol code on asyncio streams, unchanged.

    python examples/http_h11.py                    # over aiordma (soft or verbs)
    python examples/http_h11.py --stack tcp        # the very same code over asyncio TCP
    python examples/http_h11.py --requests 50 --size 1M

``http_server`` and ``http_client`` below are ordinary asyncio-streams code driving the
sans-IO h11 library (keep-alive, Content-Length bodies, EOF handling); nothing in
them knows about RDMA. ``--stack`` only picks who makes the reader/writer pairs:
``aiordma.start_server``/``open_connection`` or ``asyncio``'s. The client POSTs
``--requests`` bodies of ``--size`` bytes to /echo on one connection, checks each
response byte for byte, and exits 1 on any mismatch (needs ``pip install h11``).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any

import h11
from _common import parse_size, run

import aiordma

READ = 64 * 1024


async def _next_event(conn: h11.Connection, reader: asyncio.StreamReader) -> Any:
    while True:
        event = conn.next_event()
        if event is not h11.NEED_DATA:
            return event
        conn.receive_data(await reader.read(READ))  # b"" at EOF: h11 handles it


async def http_server(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Serve requests on one connection: POST /echo returns the body, GET / a greeting."""
    conn = h11.Connection(h11.SERVER)
    try:
        while True:
            event = await _next_event(conn, reader)
            if isinstance(event, h11.ConnectionClosed):
                break
            assert isinstance(event, h11.Request), event
            body = bytearray()
            while not isinstance(part := await _next_event(conn, reader), h11.EndOfMessage):
                body += part.data
            if event.method == b"POST" and event.target == b"/echo":
                status, out = 200, bytes(body)
            elif event.method == b"GET" and event.target == b"/":
                status, out = 200, b"hello from h11\n"
            else:
                status, out = 404, b"not found\n"
            writer.write(conn.send(h11.Response(status_code=status, headers=[
                ("Content-Length", str(len(out))), ("Content-Type", "application/octet-stream")])))
            writer.write(conn.send(h11.Data(data=out)))
            writer.write(conn.send(h11.EndOfMessage()))
            await writer.drain()
            if conn.our_state is h11.MUST_CLOSE:
                break
            conn.start_next_cycle()
    except h11.RemoteProtocolError:
        pass  # a broken client: drop the connection
    finally:
        writer.close()


async def http_client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      requests: list[tuple[bytes, bytes, bytes]]) -> list[tuple[int, bytes]]:
    """Send (method, target, body) requests on one keep-alive connection; returns
    (status, body) for each."""
    conn = h11.Connection(h11.CLIENT)
    out = []
    for method, target, body in requests:
        writer.write(conn.send(h11.Request(method=method, target=target, headers=[
            ("Host", "example"), ("Content-Length", str(len(body)))])))
        writer.write(conn.send(h11.Data(data=body)))
        writer.write(conn.send(h11.EndOfMessage()))
        await writer.drain()
        response = await _next_event(conn, reader)
        assert isinstance(response, h11.Response), response
        data = bytearray()
        while not isinstance(part := await _next_event(conn, reader), h11.EndOfMessage):
            data += part.data
        out.append((response.status_code, bytes(data)))
        conn.start_next_cycle()
    writer.close()
    await writer.wait_closed()
    return out


async def main(args: argparse.Namespace) -> int:
    opts: dict[str, Any] = {"provider": args.provider} if args.provider else {}
    size = parse_size(args.size)
    if args.stack == "rdma":
        server = await aiordma.start_server(http_server, args.host, 0, **opts)
    else:
        server = await asyncio.start_server(http_server, args.host, 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        if args.stack == "rdma":
            reader, writer = await aiordma.open_connection(args.host, port, **opts)
        else:
            reader, writer = await asyncio.open_connection(args.host, port)
        bodies = [bytes([i & 0xFF]) * size + str(i).encode() for i in range(args.requests)]
        reqs = [(b"GET", b"/", b"")] + [(b"POST", b"/echo", b) for b in bodies]
        reqs.append((b"GET", b"/missing", b""))
        got = await asyncio.wait_for(http_client(reader, writer, reqs), args.timeout)
        expected = ([(200, b"hello from h11\n")] + [(200, b) for b in bodies]
                    + [(404, b"not found\n")])
        for i, (g, e) in enumerate(zip(got, expected, strict=True)):
            if g != e:
                print(f"http_h11: MISMATCH in response {i}: status {g[0]}, {len(g[1])} bytes",
                      file=sys.stderr)
                return 1
    where = (f"aiordma provider={writer.get_extra_info('provider')}" if args.stack == "rdma"
             else "asyncio TCP")
    print(f"http_h11 ok: {len(got)} HTTP/1.1 requests over {where}, "
          f"{args.requests} x {size} B bodies echoed", flush=True)
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stack", choices=["rdma", "tcp"], default="rdma")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--size", default="64K", help="body bytes per POST; K/M suffixes")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--provider", choices=["soft", "verbs"], default=None)
    p.add_argument("--loop", choices=["auto", "asyncio", "uvloop"], default="auto")
    a = p.parse_args()
    sys.exit(run(main(a), a.loop))
