"""Shared pieces of the benchmark harness: sizes, tests, statistics, the event loop,
the control channel between the two processes, and CPU accounting.

Nothing here imports aiordma: the socket baselines run without it.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import resource
import statistics
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import asdict, dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

KiB = 1024
MiB = 1024 * KiB

#: perftest-style tests. *_lat: one operation at a time (round trips); *_bw: a window
#: of operations in flight; msg_rate: small sends, window 64; reactor: in one process;
#: cost: instructions and Python calls per 64 B round trip (cost.py; not in the default
#: set: it needs valgrind and takes minutes); dask: Dask's comm and a cluster workload on
#: tcp:// and rdma:// (aiordma.dask.bench; needs the dask extra)
LAT_TESTS = ("send_lat", "write_lat", "read_lat", "atomic_lat")
BW_TESTS = ("send_bw", "write_bw", "read_bw")
ALL_TESTS = (*LAT_TESTS, *BW_TESTS, "msg_rate", "reactor", "cost", "dask")
DEFAULT_TESTS = (*LAT_TESTS, *BW_TESTS, "msg_rate", "reactor")
TWO_PROCESS_TESTS = (*LAT_TESTS, *BW_TESTS, "msg_rate")

#: which socket pattern mirrors each test (see aiordma/bench/sockets.py):
#: echo = request of `size`, reply of `size`; ack = `size` then a 1-byte reply;
#: fetch = 1-byte request, reply of `size`; sink = one-way stream of `size` messages;
#: source = 1-byte requests (window W in flight), `size`-byte replies.
PATTERN = {
    "send_lat": "echo",
    "write_lat": "ack",
    "read_lat": "fetch",
    "atomic_lat": "echo",
    "send_bw": "sink",
    "write_bw": "sink",
    "read_bw": "source",
    "msg_rate": "sink",
}

SOCKET_BASELINES = ("tcp-proto", "tcp-streams", "unix-proto", "unix-streams")
LOCAL_BASELINES = ("memcpy",)
#: UCXX over UCX shared memory, polling and blocking progress (ucxx_baseline.py)
UCXX_BASELINES = ("ucxx-poll", "ucxx-block")
EXTERNAL_BASELINES = ("pyverbs", "pyverbs-async", "perftest", *UCXX_BASELINES)
DEFAULT_BASELINES = (*SOCKET_BASELINES, *LOCAL_BASELINES)
#: the baseline every aiordma figure is compared with first (the issue's targets)
REFERENCE = "tcp-proto"

DEFAULT_SIZES = "8,64,512,4K,64K,1M,16M"
RATE_MAX_SIZE = 4 * KiB  # msg_rate runs the sizes up to this
REACTOR_BATCHES = (1, 4, 16, 64)


def parse_size(s: str) -> int:
    s = s.strip().upper().removesuffix("B")
    mult = 1
    for suffix, m in (("K", KiB), ("M", MiB), ("G", 1024 * MiB)):
        if s.endswith(suffix):
            s, mult = s[:-1], m
            break
    n = int(float(s) * mult)
    if n < 1:
        raise ValueError(f"size must be >= 1 byte: {s!r}")
    return n


def parse_sizes(spec: str) -> list[int]:
    """``"8,64,4K,1M"`` or a range ``"8-16M"`` (powers of two)."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            lo_s, hi_s = part.split("-", 1)
            lo, hi = parse_size(lo_s), parse_size(hi_s)
            n = 1 << max(0, (lo - 1).bit_length())
            while n <= hi:
                out.append(n)
                n *= 2
        else:
            out.append(parse_size(part))
    return sorted(set(out))


def fmt_size(n: int) -> str:
    for unit, m in (("M", MiB), ("K", KiB)):
        if n >= m and n % m == 0:
            return f"{n // m}{unit}"
    return str(n)


def test_sizes(test: str, sizes: list[int]) -> list[int]:
    """The sizes a test runs: atomics are 8 bytes; msg_rate takes the small ones."""
    if test == "atomic_lat":
        return [8]
    if test == "msg_rate":
        small = [s for s in sizes if s <= RATE_MAX_SIZE]
        return small or [min(sizes)]
    return sizes


@dataclass
class Config:
    """What both processes of one transport run (sent to each worker as JSON)."""

    tests: list[str]
    sizes: list[int]
    iters: int = 1000
    warmup: int = 100
    window: int = 16
    rate_window: int = 64
    #: how aiordma's msg_rate client sends: ``send`` (``rate_window`` tasks, one await
    #: per message) or ``many`` (``send_many`` calls of ``rate_window // 2`` messages,
    #: two in flight)
    rate_api: str = "send"
    max_seconds: float = 3.0
    max_bytes: int = 512 * MiB
    loop: str = "uvloop"
    provider: str | None = None
    device: str | None = None
    poll_mode: str | None = None
    spin_us: int | None = None
    skip: int = 0  # (test, size) items already done (a pair restarted after a failure)
    #: per-test sizes (``--sizes-for``); ``sizes`` then holds every size of the run
    sizes_for: dict[str, list[int]] = field(default_factory=dict)
    #: ``--cpus``: [server CPU, client CPU] each worker pins itself to (None: unpinned)
    cpus: list[int] | None = None

    def pin(self, role: str) -> None:
        """Pin this process (its threads to come too) to the CPU ``cpus`` gives ``role``
        (``server`` or ``client``); nothing when ``cpus`` is None. Raises OSError when
        the CPU is not this process's to use."""
        if self.cpus is not None:
            os.sched_setaffinity(0, {self.cpus[0] if role == "server" else self.cpus[1]})

    def sizes_of(self, test: str) -> list[int]:
        """The sizes ``test`` runs (``--sizes-for``, else ``--sizes``)."""
        return test_sizes(test, self.sizes_for.get(test, self.sizes))

    def items(self) -> list[tuple[str, int]]:
        """Every (test, size) of the two-process tests, in run order."""
        return [(t, s) for t in self.tests if t in TWO_PROCESS_TESTS
                for s in self.sizes_of(t)]

    def iters_for(self, test: str, size: int) -> tuple[int, int]:
        """(warmup, measured) operation counts: --iters, but at most --max-bytes of data
        per test (16 MiB x 1000 would take minutes); msg_rate sends 10x --iters."""
        iters = self.iters * 10 if test == "msg_rate" else self.iters
        cap = max(8, self.max_bytes // max(size, 1))
        n = max(1, min(iters, cap))
        w = min(self.warmup, max(1, n // 10)) if self.warmup else 0
        return w, n

    def window_for(self, test: str) -> int:
        if test == "msg_rate":
            return self.rate_window
        if test in BW_TESTS:
            return self.window
        return 1

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, s: str) -> Config:
        return cls(**json.loads(s))


@dataclass
class Result:
    """One (transport, test, size) measurement. Latencies in microseconds."""

    transport: str
    test: str
    size: int
    ops: int = 0
    seconds: float = 0.0
    window: int = 1
    lat_median_us: float | None = None
    lat_p99_us: float | None = None
    lat_min_us: float | None = None
    lat_mean_us: float | None = None
    gbps: float | None = None          # GB/s, 1e9 bytes per second, payload only
    msgs_per_s: float | None = None
    cpu_client_s: float | None = None
    cpu_server_s: float | None = None
    cpu_us_per_op: float | None = None  # both processes together
    loop: str = ""
    note: str = ""
    error: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    ratios: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def primary(r: Result) -> float | None:
    """The figure a test is judged by: median round trip (lat), GB/s (bw), msgs/s (rate)."""
    if r.test in LAT_TESTS:
        return r.lat_median_us
    if r.test in BW_TESTS or r.test == "memcpy":
        return r.gbps
    return r.msgs_per_s


def lat_stats(samples_ns: list[int]) -> dict[str, float]:
    if not samples_ns:
        return {}
    s = sorted(samples_ns)
    p99 = s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]
    return {
        "lat_median_us": statistics.median(s) / 1e3,
        "lat_p99_us": p99 / 1e3,
        "lat_min_us": s[0] / 1e3,
        "lat_mean_us": sum(s) / len(s) / 1e3,
    }


def fill(res: Result, *, ops: int, seconds: float, size: int,
         samples_ns: list[int] | None = None) -> Result:
    res.ops = ops
    res.seconds = seconds
    if seconds > 0 and ops:
        res.msgs_per_s = ops / seconds
        res.gbps = ops * size / seconds / 1e9
    if samples_ns:
        for k, v in lat_stats(samples_ns).items():
            setattr(res, k, v)
    return res


class CPUClock:
    """CPU seconds (user + system, every thread) of this process since ``start``."""

    def __init__(self) -> None:
        self.t0 = self.now()

    @staticmethod
    def now() -> float:
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return ru.ru_utime + ru.ru_stime

    def start(self) -> None:
        self.t0 = self.now()

    def elapsed(self) -> float:
        return self.now() - self.t0


# --- event loop -------------------------------------------------------------------------
def run(coro: Coroutine[Any, Any, T], loop: str) -> T:
    """Run ``coro`` on a fresh ``asyncio`` or ``uvloop`` loop."""
    if loop == "uvloop":
        try:
            import uvloop
        except ImportError:
            raise SystemExit("bench: --loop uvloop needs the uvloop package "
                             "(pip install 'aiordma[uvloop]')") from None
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as r:
            return r.run(coro)
    if loop != "asyncio":
        raise SystemExit(f"bench: unknown loop {loop!r}")
    return asyncio.run(coro)


# --- control channel: one JSON object per line over asyncio TCP -------------------------
class Control:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    async def send(self, **msg: Any) -> None:
        self.writer.write(json.dumps(msg).encode() + b"\n")
        await self.writer.drain()

    async def recv(self, timeout: float | None = None) -> dict[str, Any]:
        line = await asyncio.wait_for(self.reader.readline(), timeout)
        if not line:
            raise ConnectionError("control connection closed")
        msg: dict[str, Any] = json.loads(line)
        return msg

    async def call(self, timeout: float, **msg: Any) -> dict[str, Any]:
        await self.send(**msg)
        reply = await self.recv(timeout)
        if reply.get("error"):
            raise RuntimeError(f"server: {reply['error']}")
        return reply

    def close(self) -> None:
        self.writer.close()


async def bounded(coro: Awaitable[T], seconds: float, what: str) -> T:
    """Every wait of the harness is bounded: a hung test fails, it never hangs the run."""
    try:
        return await asyncio.wait_for(coro, seconds)
    except TimeoutError:
        raise TimeoutError(f"{what} did not finish in {seconds:.0f}s") from None


# The baselines that connect out of band (pyverbs-async, ucxx) swap one JSON line each
# way over TCP on 127.0.0.1: the client sends its own, the server answers with its own.
EXCHANGE_TIMEOUT = 30.0


async def exchange_lines(host: str, port: int, mine: dict[str, Any],
                         what: str) -> dict[str, Any]:
    """The client's side: send ``mine``, return the server's line. Raises
    ConnectionError when the server closes first (naming ``what``), TimeoutError."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(json.dumps(mine).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), EXCHANGE_TIMEOUT)
        if not line:
            raise ConnectionError(f"{what}: the exchange connection closed")
        peer: dict[str, Any] = json.loads(line)
        return peer
    finally:
        writer.close()


async def exchange_server(answer: Callable[[dict[str, Any]], Awaitable[dict[str, Any]]],
                          connected: asyncio.Future[None],
                          after: Callable[[], None] | None = None,
                          ) -> tuple[asyncio.Server, dict[str, Any]]:
    """The server's side on 127.0.0.1: for each client's line, ``answer(peer)`` gives
    ours; once it is sent, ``after()`` runs and ``connected`` is resolved (the first
    time). Returns the server and ``{"host", "port"}`` for the client."""

    async def on_client(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(r.readline(), EXCHANGE_TIMEOUT)
            reply = await answer(json.loads(line))
            w.write(json.dumps(reply).encode() + b"\n")
            await w.drain()
            if after is not None:
                after()
            if not connected.done():
                connected.set_result(None)
        finally:
            w.close()

    server = await asyncio.start_server(on_client, "127.0.0.1", 0)
    return server, {"host": "127.0.0.1", "port": server.sockets[0].getsockname()[1]}


def test_timeout(cfg: Config) -> float:
    """Upper bound of one test, warm-up and synchronisation included."""
    return cfg.max_seconds * 3 + 20


# --- the measuring loops, shared by every transport --------------------------------------
async def ping_pong(op: Callable[[], Awaitable[Any]], warmup: int, iters: int,
                    max_seconds: float) -> tuple[int, float, list[int]]:
    """Run ``op`` one at a time: ``warmup`` times, then up to ``iters`` times or
    ``max_seconds``. Returns (ops, seconds, per-op nanoseconds)."""
    for _ in range(warmup):
        await op()
    clock = time.perf_counter_ns
    samples: list[int] = []
    append = samples.append
    deadline = clock() + int(max_seconds * 1e9)
    start = clock()
    t = start
    for _ in range(iters):
        await op()
        t1 = clock()
        append(t1 - t)
        t = t1
        if t1 > deadline:
            break
    return len(samples), (t - start) / 1e9, samples


async def windowed(op: Callable[[], Awaitable[Any]], count: int, window: int,
                   max_seconds: float) -> tuple[int, float]:
    """Keep ``window`` calls of ``op`` in flight until ``count`` are done or
    ``max_seconds`` passed (no new ones start then). Returns (ops, seconds)."""
    done = 0
    started = 0
    deadline = time.perf_counter() + max_seconds

    async def worker() -> None:
        nonlocal done, started
        while started < count:
            started += 1
            await op()
            done += 1
            if time.perf_counter() > deadline:
                started = count

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(window, count))))
    return done, time.perf_counter() - t0


async def batched(call: Callable[[list[Any]], Awaitable[Any]], item: Any, count: int,
                  batch: int, calls: int, max_seconds: float) -> tuple[int, float]:
    """Send ``count`` copies of ``item`` through ``call`` (``Endpoint.send_many``), at
    most ``batch`` per call and ``calls`` calls in flight (``windowed``), until all are
    done or ``max_seconds`` passed (no new call starts then). Returns (items, seconds)."""
    full = [item] * batch
    whole, rest = divmod(count, batch)
    sizes = iter([batch] * whole + ([rest] if rest else []))
    n_calls = whole + (1 if rest else 0)

    def one() -> Awaitable[Any]:
        k = next(sizes)
        return call(full if k == batch else full[:k])

    done, secs = await windowed(one, n_calls, calls, max_seconds)
    # calls start in order and every one started completes: only the last is short
    return (count if done == n_calls else done * batch), secs
