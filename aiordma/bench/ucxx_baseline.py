"""The ``ucxx-poll`` and ``ucxx-block`` baselines: UCXX (RAPIDS' Python bindings of UCX)
between two processes of one host over UCX shared memory (``UCX_TLS=sm,self``).

Both use UCXX's asyncio API (``ucxx.init``, endpoints, ``Endpoint.send``/``recv`` with
tags) and differ in its progress mode: ``ucxx-poll`` is ``progress_mode="polling"``
(a task on the event loop calls ``worker.progress()`` and yields, without end: a busy
poll), ``ucxx-block`` is ``progress_mode="blocking"`` (the worker's epoll descriptor is
a reader of the event loop; the worker is armed before the loop sleeps). UCXX's
``thread`` modes are not offered: their progress thread makes a CUDA context.

The endpoints are made from worker addresses, exchanged over a TCP connection of
their own at ``connect`` (no UCX connection manager is needed, so ``sm,self`` is
enough). Every test gets a tag pair of its own from the server's ``begin`` reply, so
a receive still posted from an earlier test never matches a later one. Buffers are
wrapped in ``ucxx``'s ``Array`` once per test and re-used.

Tests (``TESTS``; the others have no two-sided UCX counterpart here and are left out
of these baselines' runs by ``tests_of``): ``send_lat`` -- the client sends ``size``
bytes and awaits the echo; the server receives and sends it back. ``send_bw`` and
``msg_rate`` -- the client keeps ``window`` sends in flight (``common.windowed``); the
server keeps ``window`` receives posted and counts. They run through
``aiordma/bench/worker.py``: the same counts, warm-up, measuring loops, CPU accounting
and pair runner as aiordma and the socket baselines.

``check`` raises ``external.BaselineUnavailable`` with the reason unless ``ucxx`` is
importable and UCX lists a shared-memory transport, probed in a process of its own
(``python -m aiordma.bench.ucxx_baseline probe``).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from .common import Config, bounded, exchange_lines, exchange_server, windowed

#: baseline name -> UCXX progress mode
MODES = {"ucxx-poll": "polling", "ucxx-block": "blocking"}
#: the tests these baselines run
TESTS = ("send_lat", "send_bw", "msg_rate")
#: UCX transports: shared memory between the two processes, ``self`` for loopback
TLS = "sm,self"
#: UCX's shared-memory transport names (``ucxx.get_active_transports()``)
SM_TRANSPORTS = frozenset({"posix", "sysv", "cma", "xpmem", "knem"})
INSTALL_HINT = "pip install 'aiordma[ucxx]' (or make bench-ucxx, which uses build/ucxx-venv)"


def progress_mode(name: str) -> str:
    """UCXX's progress mode of baseline ``name``; ValueError for any other name."""
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"not a UCXX baseline: {name!r} (choose from "
                         f"{', '.join(MODES)})") from None


def tests_of(cfg: Config) -> list[str]:
    """The tests of ``cfg`` these baselines run, in ``cfg``'s order."""
    return [t for t in cfg.tests if t in TESTS]


def ucx_options() -> dict[str, str]:
    """The UCX options of both processes (``ucxx.init(options=...)``, which take
    precedence over ``UCX_*`` variables): shared memory only, host staging buffers."""
    return {"TLS": TLS, "RNDV_FRAG_MEM_TYPE": "host"}


def unavailable_reason(timeout: float = 60.0) -> str | None:
    """Why these baselines cannot run here, or None when they can: runs ``probe`` in
    a fresh interpreter (importing ucxx and starting UCX there, not in this process)."""
    try:
        p = subprocess.run([sys.executable, "-m", "aiordma.bench.ucxx_baseline", "probe"],
                           capture_output=True, text=True, timeout=timeout,
                           env=_probe_env())
    except subprocess.TimeoutExpired:
        return f"the UCXX probe did not finish in {timeout:.0f}s"
    return reason_from_probe(p.returncode, p.stdout, p.stderr)


def _probe_env() -> dict[str, str]:
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return env


def reason_from_probe(rc: int, stdout: str, stderr: str) -> str | None:
    """The reason of a failed probe from its exit status and output (None: it passed).
    The probe prints one ``PROBE {json}`` line: ``{"ok": bool, "reason": str, ...}``."""
    for line in stdout.splitlines():
        if line.startswith("PROBE "):
            d = json.loads(line[len("PROBE "):])
            return None if d.get("ok") and rc == 0 else str(d.get("reason") or "probe failed")
    tail = (stderr or stdout).strip().splitlines()[-3:]
    return f"the UCXX probe exited with status {rc}: " + " | ".join(tail)


def probe() -> dict[str, Any]:
    """Import ucxx, start UCX with ``ucx_options()`` on an event loop and list its
    active transports. Returns ``{"ok", "reason", "transports", "ucx"}``."""
    quiet_ucx()
    try:
        import ucxx
    except Exception as exc:  # ImportError, or a library that fails to load
        return {"ok": False, "reason": f"ucxx is not importable ({exc!r}); {INSTALL_HINT}"}

    async def start() -> list[str]:
        ucxx.init(options=ucx_options(), progress_mode="polling")
        return sorted(ucxx.get_active_transports())

    try:
        transports = asyncio.run(start())
    except Exception as exc:
        return {"ok": False, "reason": f"UCX did not start with TLS={TLS}: {exc!r}"}
    version = ".".join(str(x) for x in ucxx.get_ucx_version())
    sm = sorted(SM_TRANSPORTS.intersection(transports))
    if not sm:
        return {"ok": False, "transports": transports, "ucx": version,
                "reason": f"UCX {version} has no shared-memory transport with TLS={TLS} "
                          f"(active: {', '.join(transports) or 'none'})"}
    return {"ok": True, "reason": "", "transports": transports, "ucx": version}


# ======================================================================= shared
def quiet_ucx() -> None:
    """Keep UCX from warning about ``UCX_MEMTYPE_CACHE`` (which ucxx sets and this UCX
    does not read): UCX logs to stdout, where the worker's ``READY`` line must come first."""
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def _init(name: str) -> Any:
    """Start UCXX in this process (on the running loop) for baseline ``name``."""
    quiet_ucx()
    import ucxx

    ucxx.init(options=ucx_options(), progress_mode=progress_mode(name))
    return ucxx


async def _endpoint(ucxx: Any, peer_hex: str) -> Any:
    addr = ucxx.get_ucx_address_from_buffer(bytes.fromhex(peer_hex))
    # UCX's shared-memory transports cannot detect a failed peer: with error handling
    # (ucxx's default) no transport qualifies and UCX answers "Destination is unreachable"
    return await ucxx.create_endpoint_from_worker_address(addr, endpoint_error_handling=False)


def _array(size: int) -> Any:
    from ucxx._lib.arr import Array

    return Array(bytearray(size))


def _tags(n: int) -> tuple[int, int]:
    """(client-to-server, server-to-client) tags of the ``n``-th test."""
    return 2 * n + 1, 2 * n + 2


# ======================================================================= server
class UcxxServer:
    """The server backend of ``aiordma/bench/worker.py`` (start/begin/mark/end/close)."""

    def __init__(self, cfg: Config, name: str) -> None:
        self.cfg = cfg
        self.name = name
        progress_mode(name)
        self.ucxx: Any = None
        self.ep: Any = None
        self._connected: asyncio.Future[None] | None = None
        self._xchg: asyncio.Server | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._n = 0
        self.received = 0
        self._waiter: tuple[int, asyncio.Future[None]] | None = None

    async def start(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.ucxx = ucxx = _init(self.name)
        mine = ucxx.get_worker_address().tobytes().hex()
        self._connected = loop.create_future()

        async def answer(peer: dict[str, Any]) -> dict[str, Any]:
            self.ep = await _endpoint(ucxx, peer["address"])
            return {"address": mine}

        self._xchg, where = await exchange_server(answer, self._connected)
        return where

    async def begin(self, test: str, size: int, window: int, timeout: float) -> dict[str, Any]:
        assert self._connected is not None
        await bounded(asyncio.shield(self._connected), timeout, "the UCXX endpoint")
        if test not in TESTS:
            raise ValueError(f"{self.name} does not run {test}")
        self._stop()
        self._n += 1
        c2s, s2c = _tags(self._n)
        self.received = 0
        loop = asyncio.get_running_loop()
        if test == "send_lat":
            self._tasks = [loop.create_task(self._echo(size, c2s, s2c))]
        else:
            self._tasks = [loop.create_task(self._sink(size, c2s)) for _ in range(window)]
        return {"tags": [c2s, s2c]}

    async def _echo(self, size: int, c2s: int, s2c: int) -> None:
        buf = _array(size)
        ep = self.ep
        while True:
            await ep.recv(buf, tag=c2s, force_tag=True)
            await ep.send(buf, tag=s2c, force_tag=True)
            self._count()

    async def _sink(self, size: int, c2s: int) -> None:
        buf = _array(size)
        ep = self.ep
        while True:
            await ep.recv(buf, tag=c2s, force_tag=True)
            self._count()

    def _count(self) -> None:
        self.received += 1
        w = self._waiter
        if w is not None and self.received >= w[0] and not w[1].done():
            w[1].set_result(None)

    async def _wait_received(self, n: int, timeout: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = (n, fut)
        if self.received >= n:
            fut.set_result(None)
        try:
            await bounded(fut, timeout, f"server receiving {n} messages")
        finally:
            self._waiter = None

    async def mark(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        await self._wait_received(sent_msgs, timeout)
        self.received = 0

    async def end(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        try:
            await self._wait_received(sent_msgs, timeout)
        finally:
            self._stop()

    def _stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        self._tasks = []

    async def close(self) -> None:
        self._stop()
        if self._xchg is not None:
            self._xchg.close()
        if self.ep is not None:
            await self.ep.close()


# ======================================================================= client
class UcxxClient:
    """The client backend of ``aiordma/bench/worker.py`` (connect/lat_op/stream/close);
    ``lat_op`` and ``stream`` take the server's ``begin`` reply (the test's tags)."""

    takes_info = True

    def __init__(self, cfg: Config, name: str, info: dict[str, Any]) -> None:
        self.cfg = cfg
        self.name = name
        progress_mode(name)
        self.info = info
        self.ep: Any = None
        self._bufs: dict[tuple[str, int], tuple[Any, Any]] = {}

    async def connect(self) -> None:
        ucxx = _init(self.name)
        mine = ucxx.get_worker_address().tobytes().hex()
        peer = await exchange_lines(self.info["host"], self.info["port"], {"address": mine},
                                    "ucxx")
        self.ep = await _endpoint(ucxx, peer["address"])

    def _buffers(self, test: str, size: int) -> tuple[Any, Any]:
        key = (test, size)
        if key not in self._bufs:
            self._bufs = {key: (_array(size), _array(size))}
        return self._bufs[key]

    def lat_op(self, test: str, size: int, info: dict[str, Any]) -> Callable[[], Awaitable[Any]]:
        c2s, s2c = info["tags"]
        sbuf, rbuf = self._buffers(test, size)
        send, recv = self.ep.send, self.ep.recv

        async def pingpong() -> None:
            await send(sbuf, tag=c2s, force_tag=True)
            await recv(rbuf, tag=s2c, force_tag=True)
        return pingpong

    async def stream(self, test: str, size: int, count: int, window: int,
                     max_seconds: float, info: dict[str, Any]) -> int:
        c2s = info["tags"][0]
        sbuf, _ = self._buffers(test, size)
        send = self.ep.send
        ops, _secs = await windowed(lambda: send(sbuf, tag=c2s, force_tag=True), count,
                                    window, max_seconds)
        return ops

    async def close(self) -> None:
        if self.ep is not None:
            await self.ep.close()


def main(argv: list[str]) -> int:
    """``probe``: print ``PROBE {json}`` (see ``probe``); exit 0 when it passed."""
    if argv[:1] != ["probe"]:
        print("usage: python -m aiordma.bench.ucxx_baseline probe", file=sys.stderr)
        return 2
    d = probe()
    print("PROBE " + json.dumps(d), flush=True)
    return 0 if d["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
