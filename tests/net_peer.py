"""One host of the two-host tests (tests/test_net_*.py, tests/test_liveness.py): an
aiordma server or a client scenario, in its own process (in its own network namespace
for the cross-host tests), reporting on stdout, one JSON object per line.

    python tests/net_peer.py serve --host H --port P [--stream-port Q --proto-port R] [OPTIONS]
    python tests/net_peer.py api --host H --port P --stream-port Q --proto-port R [--max-size N]
    python tests/net_peer.py traffic --host H --port P --bytes N [--seed S]
    python tests/net_peer.py hold --host H --port P --idle N --busy N --writers N

OPTIONS: ``--liveness S`` (``liveness_timeout``; ``none``: off), ``--ack-timeout C``.

* ``serve`` prints ``{"ready": true}`` once listening, then one ``{"event": "closed",
  "error", "cause", "t"}`` per connection that ends (``t``: time.monotonic(), one clock
  for every process of the machine). The first message of a connection picks its
  service: ``echo`` (every message back), ``sink`` (read everything), ``region`` (a
  1 MiB region for one-sided ops and atomics, its descriptor sent back, then echo),
  ``path`` (``rdma_path`` of this side's endpoint sent back as JSON, then echo; verbs).
  ``--stream-port``: an ``aiordma.start_server`` echo of lines; ``--proto-port``: an
  ``aiordma.create_server`` Protocol echo.
* ``api`` runs the endpoint API once (messages of 0 B to ``--max-size``, one-sided
  WRITE/READ, atomics, streams, Transport/Protocol) and prints ``{"ok": true, "sizes",
  "local", "peer"}`` (the addresses of its setup connection).
* ``traffic`` moves ``--bytes`` in sequence-numbered messages of many sizes through the
  echo service (16 in flight) with one-sided ops in between, and checks every echo:
  each message exactly once, in order, intact; prints ``{"ok": true, "messages",
  "bytes", "seconds"}``.
* ``hold`` opens idle endpoints (``idle<i>``), busy ones (``busy<i>``: a stream of
  64 KiB sends to ``sink``, 8 in flight) and writers without heartbeat (``write<i>``:
  64 KiB RDMA WRITEs to a ``region``, 8 in flight, so that work requests are always
  outstanding and only the QP's retry budget can end it), prints ``{"event":
  "connected"}``, then one
  ``{"event": "failed", "ep", "error", "cause", "t"}`` per endpoint that fails. Commands
  on stdin, each answered by one line: ``ping`` (every live idle endpoint does an echo
  round trip: ``{"event": "pong", "alive": [names]}``), ``progress`` (``{"event":
  "progress", "sent": {name: n}}``), ``quit`` (close all, ``{"event": "done"}``).

Every wait is bounded (``T``); the process exits non-zero with a traceback on any
failure of its own.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import os
import random
import sys
import threading
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiordma  # noqa: E402

T = 120.0  # bound of any single wait
LIMIT = 10_000_000  # bound of any loop's count (each is also bounded in time: T a wait)
EXIT_WATCH_S = 15.0  # a failed scenario's process still alive this long after: stacks dumped
KiB = 1024
MiB = 1024 * KiB


def emit(**obj: Any) -> None:
    print(json.dumps(obj), flush=True)


def _name(exc: BaseException | None) -> str | None:
    return type(exc).__name__ if exc is not None else None


def rdma_path(ep: aiordma.Endpoint) -> dict[str, Any]:
    """The path of ``ep``'s QP as the device reports it (``verbs`` provider only):
    ``path_mtu`` (bytes) and the address vector's ``sgid_index`` and ``dgid`` from
    ibv_query_qp, the GID index the endpoint chose for its setup connection's local
    address (``gid_index``) and the local port's ``active_mtu`` (bytes)."""
    qp = ep._qp  # the provider's IbvQP: its pyverbs QP and enums
    e = qp._pv.e
    attr, _init = qp._qp.query(e["IBV_QP_PATH_MTU"] | e["IBV_QP_AV"])
    ah = attr.ah_attr
    return {"path_mtu": 128 << int(attr.path_mtu), "sgid_index": int(ah.sgid_index),
            "dgid": str(ah.dgid), "gid_index": ep._gid_index,
            "active_mtu": ep._res.port.active_mtu.bytes}


def options(a: argparse.Namespace) -> dict[str, Any]:
    o: dict[str, Any] = {}
    if a.liveness is not None:
        o["liveness_timeout"] = None if a.liveness == "none" else float(a.liveness)
    if a.ack_timeout is not None:
        o["ack_timeout"] = a.ack_timeout
    return o


# --- server ----------------------------------------------------------------------------
async def serve(a: argparse.Namespace) -> None:
    async def handler(ep: aiordma.Endpoint) -> None:
        err: BaseException | None = None
        try:
            kind = await ep.recv()
            if kind == b"path":
                await ep.send(json.dumps(rdma_path(ep)).encode())
                kind = b"echo"
            if kind == b"region":
                mem = bytearray(MiB)
                region = ep.register(mem, remote_read=True, remote_write=True,
                                     remote_atomic=True)
                await ep.send(region.remote().pack())
                kind = b"echo"
            for _ in range(LIMIT):
                msg = await asyncio.wait_for(ep.recv(), 3600)
                if kind == b"echo":
                    await ep.send(msg)
        except aiordma.ConnectionClosed as exc:
            err = exc
        emit(event="closed", error=_name(err), cause=_name(err.__cause__ if err else None),
             t=time.monotonic())

    listener = await aiordma.listen(handler, a.host, a.port, **options(a))
    servers: list[Any] = []
    if a.stream_port:
        async def lines(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while line := await reader.readline():
                writer.write(line)
                await writer.drain()
            writer.close()

        class Echo(asyncio.Protocol):
            def connection_made(self, transport: Any) -> None:
                self.transport = transport

            def data_received(self, data: bytes) -> None:
                self.transport.write(data)

            def eof_received(self) -> bool:
                self.transport.close()
                return True

        servers.append(await aiordma.start_server(lines, a.host, a.stream_port, **options(a)))
        servers.append(await aiordma.create_server(Echo, a.host, a.proto_port,
                                                   **options(a)))
    emit(ready=True)
    try:
        await asyncio.sleep(3600)
    finally:
        listener.close()
        for s in servers:
            s.close()


# --- api -------------------------------------------------------------------------------
def _payload(n: int, seed: int) -> bytes:
    return random.Random(seed).randbytes(n)


async def check_atomics(ep: aiordma.Endpoint, word: aiordma.RemoteBuffer) -> None:
    """Zero the peer's 8-byte ``word``, then check fetch_add and both outcomes of
    compare_swap on it (the word ends at 42)."""
    await asyncio.wait_for(ep.write(ep.register(bytearray(8)), word), T)
    assert await asyncio.wait_for(ep.fetch_add(word, 5), T) == 0
    assert await asyncio.wait_for(ep.compare_swap(word, 5, 42), T) == 5
    assert await asyncio.wait_for(ep.compare_swap(word, 5, 43), T) == 42


async def api(a: argparse.Namespace) -> None:
    o = options(a)
    ep = await aiordma.connect(a.host, a.port, timeout=30, **o)
    sizes = [0, 1, 63, 64, ep.eager_payload, ep.eager_payload + 1, 4 * KiB, 64 * KiB, MiB,
             8 * MiB + 1, 64 * MiB]
    sizes = [s for s in sizes if s <= a.max_size]
    where = {"local": ep.local_address[0] if ep.local_address else None,
             "peer": ep.peer_address[0] if ep.peer_address else None}
    async with ep:
        await asyncio.wait_for(ep.send(b"region"), T)
        desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
        for n in sizes:  # every size, each echoed back byte for byte
            data = _payload(n, n)
            await asyncio.wait_for(ep.send(data), T)
            assert await asyncio.wait_for(ep.recv(), T) == data, f"echo of {n} bytes differs"
        window = [asyncio.ensure_future(ep.send(i.to_bytes(4, "little"))) for i in range(200)]
        await asyncio.wait_for(asyncio.gather(*window), T)
        got = [int.from_bytes(await asyncio.wait_for(ep.recv(), T), "little") for _ in range(200)]
        assert got == list(range(200)), "pipelined messages out of order"
        buf = bytearray(64 * KiB)
        mr = ep.register(buf)
        buf[:] = _payload(len(buf), 7)
        await asyncio.wait_for(ep.write(mr, desc.slice(0, len(buf))), T)
        back = bytearray(len(buf))
        mr2 = ep.register(back)
        await asyncio.wait_for(ep.read(mr2, desc.slice(0, len(buf))), T)
        assert back == buf, "RDMA READ after WRITE differs"
        await check_atomics(ep, desc.slice(MiB - 8, 8))
    reader, writer = await aiordma.open_connection(a.host, a.stream_port, timeout=30, **o)
    lines = [f"line {i} ".encode() * (i % 7 + 1) + b"\n" for i in range(100)]
    for line in lines:
        writer.write(line)
    await asyncio.wait_for(writer.drain(), T)
    for line in lines:
        assert await asyncio.wait_for(reader.readline(), T) == line, "stream line differs"
    writer.close()
    await asyncio.wait_for(writer.wait_closed(), T)
    got_bytes = bytearray()
    done = asyncio.get_running_loop().create_future()

    class Client(asyncio.Protocol):
        def data_received(self, data: bytes) -> None:
            got_bytes.extend(data)
            if len(got_bytes) >= MiB and not done.done():
                done.set_result(None)

    tr, _p = await aiordma.create_connection(Client, a.host, a.proto_port, timeout=30, **o)
    blob = _payload(MiB, 3)
    for i in range(0, MiB, 50_000):
        tr.write(blob[i:i + 50_000])
    await asyncio.wait_for(done, T)
    assert bytes(got_bytes) == blob, "Transport echo differs"
    tr.close()
    emit(ok=True, sizes=sizes, **where)


# --- traffic ---------------------------------------------------------------------------
SIZES = [0, 1, 100, 4 * KiB, 16 * KiB - 8, 16 * KiB, 60 * KiB, 256 * KiB, MiB]


async def traffic(a: argparse.Namespace) -> None:
    rng = random.Random(a.seed)
    ep = await aiordma.connect(a.host, a.port, timeout=60, **options(a))
    t0 = time.monotonic()
    async with ep:
        await asyncio.wait_for(ep.send(b"region"), T)
        desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
        local = bytearray(4 * KiB)
        mr = ep.register(local)
        plan: list[int] = []
        total = 0
        while total < a.bytes and len(plan) < 100_000:
            n = rng.choice(SIZES)
            plan.append(n)
            total += n
        sent: asyncio.Queue[bytes] = asyncio.Queue(maxsize=16)

        async def sender() -> None:
            for i, n in enumerate(plan):
                msg = i.to_bytes(4, "little") + _payload(max(0, n - 4), i)[: max(0, n - 4)]
                await asyncio.wait_for(sent.put(msg), T)
                await asyncio.wait_for(ep.send(msg), T)

        task = asyncio.ensure_future(sender())
        for i, _n in enumerate(plan):
            expect = await asyncio.wait_for(sent.get(), T)
            got = await asyncio.wait_for(ep.recv(), T)
            assert got == expect, f"message {i}: got {len(got)} bytes, not the {len(expect)} sent"
            if i % 50 == 49:  # one-sided work in between
                local[:] = _payload(len(local), i)
                await asyncio.wait_for(ep.write(mr, desc.slice(0, len(local))), T)
                local[:] = bytes(len(local))
                await asyncio.wait_for(ep.read(mr, desc.slice(0, len(local))), T)
                assert local == _payload(len(local), i), "READ after WRITE differs"
                assert await asyncio.wait_for(ep.fetch_add(desc.slice(MiB - 8, 8), 1), T) == i // 50
        await asyncio.wait_for(task, T)
    emit(ok=True, messages=len(plan), bytes=sum(plan), seconds=time.monotonic() - t0)


# --- hold ------------------------------------------------------------------------------
async def hold(a: argparse.Namespace) -> None:
    loop = asyncio.get_running_loop()
    o = options(a)
    eps: dict[str, aiordma.Endpoint] = {}
    sent: dict[str, int] = {}
    for i in range(a.idle):
        eps[f"idle{i}"] = await aiordma.connect(a.host, a.port, timeout=30, **o)
        await eps[f"idle{i}"].send(b"echo")
    for i in range(a.busy):
        eps[f"busy{i}"] = await aiordma.connect(a.host, a.port, timeout=30, **o)
    for i in range(a.writers):
        eps[f"write{i}"] = await aiordma.connect(a.host, a.port, timeout=30,
                                                 **dict(o, liveness_timeout=None))
    sent.update({n: 0 for n in eps if not n.startswith("idle")})
    failed: set[str] = set()
    pongs: dict[str, asyncio.Queue[bytes]] = {n: asyncio.Queue() for n in eps}

    async def watch(name: str, ep: aiordma.Endpoint) -> None:
        try:
            if name.startswith("idle"):
                for _ in range(LIMIT):  # only the echoes of "ping" come: a failure ends it
                    pongs[name].put_nowait(await asyncio.wait_for(ep.recv(), 3600))
            blob = bytes(64 * KiB)
            if name.startswith("write"):
                await asyncio.wait_for(ep.send(b"region"), T)
                desc = aiordma.RemoteBuffer.unpack(await asyncio.wait_for(ep.recv(), T))
                src = ep.register(bytearray(blob))
                dst = desc.slice(0, len(blob))
            else:
                await ep.send(b"sink")
            sem = asyncio.Semaphore(8)

            async def one() -> None:
                try:
                    if name.startswith("write"):
                        await ep.write(src, dst)
                    else:
                        await ep.send(blob)
                    sent[name] += 1
                finally:
                    sem.release()

            errors: list[BaseException] = []

            def done(f: asyncio.Future[None]) -> None:
                if not f.cancelled() and f.exception() is not None:
                    errors.append(f.exception())  # type: ignore[arg-type]

            for _ in range(LIMIT):
                if errors:
                    break
                await asyncio.wait_for(sem.acquire(), T)
                asyncio.ensure_future(one()).add_done_callback(done)
            raise errors[0] if errors else AssertionError(f"{name}: {LIMIT} operations")
        except aiordma.ConnectionClosed as exc:
            failed.add(name)
            emit(event="failed", ep=name, error=_name(exc), cause=_name(exc.__cause__),
                 t=time.monotonic())

    tasks = [asyncio.ensure_future(watch(n, ep)) for n, ep in eps.items()]
    emit(event="connected", eps=sorted(eps))
    commands: asyncio.Queue[str] = asyncio.Queue()

    def read_stdin() -> None:
        for line in sys.stdin:
            loop.call_soon_threadsafe(commands.put_nowait, line.strip())
        loop.call_soon_threadsafe(commands.put_nowait, "quit")

    threading.Thread(target=read_stdin, daemon=True).start()
    for _ in range(10_000):
        cmd = await asyncio.wait_for(commands.get(), 3600)
        if cmd == "ping":
            alive = []
            for n, ep in eps.items():
                if n.startswith("idle") and n not in failed:
                    await asyncio.wait_for(ep.send(b"x"), T)
                    assert await asyncio.wait_for(pongs[n].get(), T) == b"x"
                    alive.append(n)
            emit(event="pong", alive=alive)
        elif cmd == "progress":
            emit(event="progress", sent=dict(sent), failed=sorted(failed))
        elif cmd == "quit":
            break
    for t in tasks:
        t.cancel()
    for ep in eps.values():
        ep.abort()
    emit(event="done")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["serve", "api", "traffic", "hold"])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--stream-port", type=int, default=0)
    p.add_argument("--proto-port", type=int, default=0)
    p.add_argument("--max-size", type=int, default=64 * MiB)
    p.add_argument("--bytes", type=int, default=4 * MiB)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--idle", type=int, default=1)
    p.add_argument("--busy", type=int, default=1)
    p.add_argument("--writers", type=int, default=0)
    p.add_argument("--liveness", default=None)
    p.add_argument("--ack-timeout", type=int, default=None)
    a = p.parse_args()
    t0 = time.monotonic()
    try:
        asyncio.run({"serve": serve, "api": api, "traffic": traffic, "hold": hold}[a.mode](a))
    except Exception as exc:  # a one-shot scenario failed: say so at once, then exit
        emit(ok=False, error=_name(exc), cause=_name(exc.__cause__), detail=str(exc),
             seconds=time.monotonic() - t0)
        # an exit that hangs prints every thread's stack to stderr, then ends the process
        faulthandler.dump_traceback_later(EXIT_WATCH_S, exit=True)
        raise


if __name__ == "__main__":
    main()
