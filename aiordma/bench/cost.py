"""``--tests cost``: what one 64 B round trip costs the client, in user-space
instructions (valgrind's callgrind) and in interpreted Python calls, for aiordma and for
the same ping-pong over uvloop/asyncio TCP, in one run.

Wall-clock time is noisy on a shared machine; instruction counts are not: callgrind
counts the same program the same way whatever else runs. The client is run twice under
callgrind, with ``N1`` and ``N2`` round trips after the same warm-up; the difference
of the two totals divided by ``N2 - N1`` is the cost of one round trip, without the
start-up, the handshake and the exit (every thread of the client is counted: the
``soft`` device's own work is part of the cost). The difference spans 2,000 round trips,
so what lands in one run and not the other (a garbage collection, a table's growth, the
two processes interleaving otherwise) weighs a quarter of what it did over 500; three
runs of one build still differ by up to several hundred instructions per round trip.
The server runs normally. Every process gets ``PYTHONHASHSEED=0`` unless the
environment sets one (see ``_env``).

Both clients do the same per round trip: send 64 bytes, then await the reply as one
message (``await ep.send(); await ep.recv()`` against a Protocol whose
``data_received`` resolves the future a TCP client awaits), so the ratio compares what
each stack does for a message. Python calls per round trip (``sys.setprofile``, a
separate uncounted run) show how much of it is interpreted.

On the ``verbs`` provider, ``--baselines pyverbs-async`` adds the barest asyncio program
over pyverbs (``aiordma/bench/pyverbs_async.py``: it awaits its SEND's completion, then
the echo's receive, polling its CQ from the loop) as a third client against its own
server, and the ratio aiordma / pyverbs-async: what aiordma's per-message work costs
above the least an asyncio program over the same verbs does. (Its poller spins while
it waits; under callgrind the client runs some 50x slower than its server, so the
spin is short.)

Where valgrind is missing the instruction columns say so; the calls are still counted.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import Config, Result

SIZE = 64
WARMUP = 50
N1, N2 = 500, 2500
CALLS_N = 1000
KINDS = ("aiordma", "tcp-proto")
#: the baselines that ``--tests cost`` can add (``--baselines``): the verbs provider's
BASELINES = ("pyverbs-async",)


# ======================================================================= the workers
async def _aiordma_server(port_file: str, provider: str | None, poll_mode: str) -> None:
    import aiordma

    async def echo(ep: aiordma.Endpoint) -> None:
        try:
            while True:
                await ep.send(await ep.recv())
        except aiordma.ConnectionClosed:
            pass

    # (the client runs under valgrind, some 50x slower: generous setup timeouts)
    listener = await aiordma.listen(echo, "127.0.0.1", 0, provider=provider,
                                    poll_mode=poll_mode, handshake_timeout=300)
    _ready(port_file, listener.port)
    await asyncio.sleep(3600)


async def _pyverbs_async_server(port_file: str, device: str | None) -> None:
    from .pyverbs_async import AioVerbsServer

    srv = AioVerbsServer(_pyverbs_cfg(device))
    where = await srv.start()
    _ready(port_file, json.dumps(where))
    await srv.begin("send_lat", SIZE, 1, 3600)  # (returns once the client connected)
    await asyncio.sleep(3600)


def _pyverbs_cfg(device: str | None) -> Config:
    return Config(tests=["send_lat"], sizes=[SIZE], provider="verbs", device=device)


async def _tcp_server(port_file: str) -> None:
    loop = asyncio.get_running_loop()

    class Echo(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            self.t: Any = transport

        def data_received(self, data: bytes) -> None:
            self.t.write(data)

    srv = await loop.create_server(Echo, "127.0.0.1", 0)
    _ready(port_file, srv.sockets[0].getsockname()[1])
    await asyncio.sleep(3600)


def _ready(port_file: str, address: int | str) -> None:
    tmp = port_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(str(address))
    os.replace(tmp, port_file)


def _profile(count: list[int]) -> Any:
    def hook(_frame: Any, event: str, _arg: Any) -> None:
        if event == "call":
            count[0] += 1
    return hook


async def _aiordma_client(port: int, n: int, calls: bool, provider: str | None,
                          poll_mode: str) -> None:
    import aiordma

    ep = await aiordma.connect("127.0.0.1", port, timeout=300, handshake_timeout=300,
                               provider=provider, poll_mode=poll_mode)
    msg = b"x" * SIZE
    for _ in range(WARMUP):
        await ep.send(msg)
        await ep.recv()
    count = [0]
    if calls:
        sys.setprofile(_profile(count))
    for _ in range(n):
        await ep.send(msg)
        await ep.recv()
    sys.setprofile(None)
    if calls:
        print(json.dumps({"calls_per_rt": count[0] / n}), flush=True)
    ep.abort()
    await ep.wait_closed()


async def _pyverbs_async_client(info: str, n: int, calls: bool, device: str | None) -> None:
    from .pyverbs_async import AioVerbsClient

    client = AioVerbsClient(_pyverbs_cfg(device), json.loads(info))
    await client.connect()
    round_trip = client.lat_op("send_lat", SIZE)
    for _ in range(WARMUP):
        await round_trip()
    count = [0]
    if calls:
        sys.setprofile(_profile(count))
    for _ in range(n):
        await round_trip()
    sys.setprofile(None)
    if calls:
        print(json.dumps({"calls_per_rt": count[0] / n}), flush=True)
    await client.close()


async def _tcp_client(port: int, n: int, calls: bool) -> None:
    loop = asyncio.get_running_loop()

    class Client(asyncio.Protocol):
        def __init__(self) -> None:
            self.got = 0
            self.fut: asyncio.Future[None] | None = None

        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            import socket

            sock = transport.get_extra_info("socket")
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def data_received(self, data: bytes) -> None:
            self.got += len(data)
            if self.got >= SIZE and self.fut is not None and not self.fut.done():
                self.got -= SIZE
                self.fut.set_result(None)

    t, p = await loop.create_connection(Client, "127.0.0.1", port)
    msg = b"x" * SIZE

    async def round_trips(k: int) -> None:
        for _ in range(k):
            p.fut = loop.create_future()
            t.write(msg)
            await p.fut

    await round_trips(WARMUP)
    count = [0]
    if calls:
        sys.setprofile(_profile(count))
    await round_trips(n)
    sys.setprofile(None)
    if calls:
        print(json.dumps({"calls_per_rt": count[0] / n}), flush=True)
    t.close()


def worker(argv: list[str]) -> None:
    """``python -m aiordma.bench.cost server KIND PORTFILE LOOP PROVIDER POLL DEVICE`` or
    ``... client KIND ADDRESS N CALLS LOOP PROVIDER POLL DEVICE`` (ADDRESS: what the
    server wrote to PORTFILE: its port, or pyverbs-async's connection info as JSON;
    ``-`` for a provider, poll mode or device not given)."""
    role, kind = argv[0], argv[1]
    if role == "server":
        port_file, loop = argv[2], argv[3]
        provider, poll, device = _none(argv[4]), argv[5], _none(argv[6])
        coro: Any = (_aiordma_server(port_file, provider, poll) if kind == "aiordma" else
                     _pyverbs_async_server(port_file, device) if kind == "pyverbs-async" else
                     _tcp_server(port_file))
    else:
        address, n, calls, loop = argv[2], int(argv[3]), argv[4] == "1", argv[5]
        provider, poll, device = _none(argv[6]), argv[7], _none(argv[8])
        coro = (_aiordma_client(int(address), n, calls, provider, poll) if kind == "aiordma"
                else _pyverbs_async_client(address, n, calls, device)
                if kind == "pyverbs-async" else _tcp_client(int(address), n, calls))
    if loop == "uvloop":
        import uvloop

        uvloop.run(coro)
    else:
        asyncio.run(coro)


def _none(s: str) -> str | None:
    return None if s == "-" else s


# ======================================================================= the harness
def _server(kind: str, cfg: Config, poll_mode: str) -> tuple[subprocess.Popen[bytes], str]:
    port_file = os.path.join(tempfile.mkdtemp(prefix="aiordma-cost-"), "port")
    args = [sys.executable, "-m", "aiordma.bench.cost", "server", kind, port_file, cfg.loop,
            cfg.provider or "-", poll_mode, cfg.device or "-"]
    proc = subprocess.Popen(args, env=_env())
    deadline = time.monotonic() + 60
    while not os.path.exists(port_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the {kind} server did not start")
        time.sleep(0.05)
    with open(port_file) as f:
        return proc, f.read()


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # One string-hash seed for every run: dict probes (attribute and global lookups)
    # depend on it, and moved the count by up to 2 % between runs of the same code.
    env.setdefault("PYTHONHASHSEED", "0")
    return env


def _client_args(kind: str, address: str, n: int, calls: bool, cfg: Config,
                 poll_mode: str) -> list[str]:
    return [sys.executable, "-m", "aiordma.bench.cost", "client", kind, address, str(n),
            "1" if calls else "0", cfg.loop, cfg.provider or "-", poll_mode, cfg.device or "-"]


def _instructions(args: list[str], timeout: float) -> int:
    out = tempfile.mktemp(prefix="aiordma-callgrind-")
    try:
        r = subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}",
                            *args], capture_output=True, text=True, timeout=timeout, env=_env())
        if r.returncode:
            raise RuntimeError(f"client under callgrind failed: {r.stderr[-500:]}")
        with open(out) as f:
            m = re.search(r"^(?:summary|totals):\s+(\d+)", f.read(), re.M)
        if m is None:
            raise RuntimeError("no totals in the callgrind output")
        return int(m.group(1))
    finally:
        if os.path.exists(out):
            os.unlink(out)


def measure(kind: str, cfg: Config) -> Result:
    """The cost of one round trip of ``kind`` (``aiordma``, ``tcp-proto`` or
    ``pyverbs-async``)."""
    poll_mode = cfg.poll_mode or "blocking"
    res = Result(transport=kind, test="cost", size=SIZE, loop=cfg.loop,
                 note=(f"client, {poll_mode}" if kind == "aiordma" else
                       "client, polls its CQ from the loop" if kind == "pyverbs-async" else
                       "client"))
    # pyverbs-async's server connects one QP, once: a server per client run
    one_client = kind == "pyverbs-async"
    procs: list[subprocess.Popen[bytes]] = []

    def address() -> str:
        if procs and not one_client:
            return addr
        proc, where = _server(kind, cfg, poll_mode)
        procs.append(proc)
        return where

    try:
        addr = address()
        r = subprocess.run(_client_args(kind, addr, CALLS_N, True, cfg, poll_mode),
                           capture_output=True, text=True, timeout=300, env=_env())
        if r.returncode:
            res.error = f"client failed: {r.stderr[-300:]}"
            return res
        res.extra["python_calls_per_rt"] = json.loads(r.stdout.strip().splitlines()[-1])[
            "calls_per_rt"]
        if shutil.which("valgrind") is None:
            res.extra["instructions_note"] = "valgrind not installed"
            return res
        t = max(600.0, cfg.max_seconds * 100)
        totals = [_instructions(_client_args(kind, address(), n, False, cfg, poll_mode), t)
                  for n in (N1, N2)]
        res.extra["instructions_per_rt"] = (totals[1] - totals[0]) / (N2 - N1)
        res.ops = N2 - N1
    except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
        res.error = str(exc)
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(10)
    return res


def bench(cfg: Config, baselines: list[str] | tuple[str, ...] = ()) -> list[Result]:
    """Both kinds and those of ``baselines`` that are ``BASELINES`` (the others are not
    this test's), then the ratios aiordma / tcp-proto in aiordma's ``extra``
    (``instructions_ratio``, ``python_calls_ratio``) and aiordma / each baseline in
    that baseline's (``aiordma_instructions_ratio``). Raises ValueError for
    pyverbs-async on a provider other than verbs."""
    extra = [b for b in baselines if b in BASELINES]
    if extra and cfg.provider != "verbs":
        raise ValueError(f"--tests cost: {', '.join(extra)} runs on the verbs provider "
                         f"(--provider verbs), not {cfg.provider or 'the default'}")
    results = [measure(kind, cfg) for kind in (*KINDS, *extra)]
    aio, tcp = results[:2]
    for key in ("instructions", "python_calls"):
        a, b = aio.extra.get(f"{key}_per_rt"), tcp.extra.get(f"{key}_per_rt")
        if a is not None and b:
            aio.extra[f"{key}_ratio"] = a / b
    a = aio.extra.get("instructions_per_rt")
    for r in results[2:]:
        b = r.extra.get("instructions_per_rt")
        if a is not None and b:
            r.extra["aiordma_instructions_ratio"] = a / b
    return results


def format_rows(results: list[Result]) -> list[str]:
    """The table section of ``--tests cost``."""
    out = ["", "Cost of one 64 B round trip, client side (callgrind: user-space instructions; "
           "interpreted Python calls)",
           f"{'transport':13s} {'instructions':>12s} {'ratio':>7s} {'calls':>7s}  note"]
    for r in results:
        if r.error:
            out.append(f"{r.transport:13s} ERROR {r.error}")
            continue
        ins = r.extra.get("instructions_per_rt")
        ratio = r.extra.get("instructions_ratio")
        out.append(f"{r.transport:13s} {ins:>12,.0f} " if ins is not None else
                   f"{r.transport:13s} {r.extra.get('instructions_note', '-'):>12s} ")
        out[-1] += (f"{ratio:>6.2f}x " if ratio else f"{'':>7s} ")
        out[-1] += f"{r.extra.get('python_calls_per_rt', 0):>7.1f}  {r.note}"
        if "aiordma_instructions_ratio" in r.extra:
            out[-1] += f" (aiordma: {r.extra['aiordma_instructions_ratio']:.2f}x this)"
    return out


if __name__ == "__main__":
    worker(sys.argv[1:])
