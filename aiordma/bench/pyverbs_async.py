"""The ``pyverbs-async`` baseline: the floor of an asyncio program over pyverbs.

The same verbs objects and work requests as ``aiordma/bench/pyverbs_sync.py``
(``pyverbs_qp.PyverbsQP``: one RC QP, WRs built once and re-posted), driven the way an
asyncio library has to at the least:
each operation awaits a Future that a CQ poller resolves, and the poller runs on the
event loop, re-scheduled with ``call_soon`` every loop iteration while anything is
awaited (a busy poll: no completion channel, no sleep). Nothing else: no framing,
credits, flow control, buffer management, checks or completion conversion. It runs
through the harness of ``aiordma/bench/worker.py`` with the same tests, counts, loop and
measuring coroutines as aiordma (``ping_pong``, ``windowed``), so

* aiordma / ``pyverbs-async`` is what aiordma costs above a bare asyncio program;
* ``pyverbs-async`` / ``pyverbs`` is what asyncio itself (one Future and one task
  switch per completion, a loop iteration per poll) costs above the synchronous loop.

Patterns (as ``aiordma/bench/rdma.py``): ``send_lat`` -- the client awaits its SEND's
completion, then the echo's receive; the server awaits a receive, SENDs it back and
awaits that completion. ``*_lat`` one-sided -- one signalled WR at a time.
``send_bw``/``msg_rate`` -- ``window`` coroutines each awaiting a signalled SEND; the
server counts receives. ``write_bw``/``read_bw`` -- ``window`` coroutines each awaiting
a signalled WRITE/READ. Every SEND-side WR is signalled (completions arrive in posting
order); each receive completion re-posts its receive at once. QP numbers, PSNs and
GIDs are exchanged over a TCP connection of their own at ``connect``.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

from .common import Config, bounded, exchange_lines, exchange_server, windowed
from .pyverbs_qp import RQ_DEPTH, PyverbsQP

_SEND_ID = 1
_RECV_ID = 2


class _Poller:
    """Polls the CQ from the loop while something waits; resolves Futures in order.

    Send-side completions resolve ``sends`` (posting order: one SQ, every WR
    signalled). A receive re-posts its WR, then resolves the oldest ``recvs`` waiter
    with the byte count, or is kept in ``ready`` when nobody waits yet (only while
    ``bank`` is set: the server's sink just counts). ``on_recv`` (the server's counter)
    runs for every receive. An error completion fails every waiter with RuntimeError.
    """

    def __init__(self, v: PyverbsQP, loop: asyncio.AbstractEventLoop) -> None:
        self.v = v
        self.loop = loop
        self.poll = v.cq.poll
        self.ok = v.e["IBV_WC_SUCCESS"]
        self.rwr = v.recv_wr(_RECV_ID)
        self.sends: deque[asyncio.Future[None]] = deque()
        self.recvs: deque[asyncio.Future[int]] = deque()
        self.ready: deque[int] = deque()
        self.on_recv: Callable[[], None] | None = None
        self.keep = False       # poll even when nothing waits (the server during a test)
        self.bank = True
        self.running = False
        self.closed = False
        self.failed: BaseException | None = None

    def post_recvs(self, n: int) -> None:
        for _ in range(n):
            self.v.qp.post_recv(self.rwr)

    def kick(self) -> None:
        if not self.running:
            self.running = True
            self.loop.call_soon(self._tick)

    def send_done(self, wr: Any) -> asyncio.Future[None]:
        """Post ``wr`` (signalled) and return the Future of its completion. Raises the
        error of a failed completion seen before."""
        if self.failed is not None:
            raise self.failed
        fut: asyncio.Future[None] = self.loop.create_future()
        self.sends.append(fut)
        self.v.qp.post_send(wr)
        self.kick()
        return fut

    def recv(self) -> Awaitable[int] | int:
        """The byte count of the next receive: an int if it is here, else a Future.
        Raises the error of a failed completion seen before."""
        if self.failed is not None:
            raise self.failed
        if self.ready:
            return self.ready.popleft()
        fut: asyncio.Future[int] = self.loop.create_future()
        self.recvs.append(fut)
        self.kick()
        return fut

    def _recv_waiter(self) -> asyncio.Future[int] | None:
        """The oldest receive waiter not cancelled (cancelled ones are dropped)."""
        recvs = self.recvs
        while recvs and recvs[0].done():
            recvs.popleft()
        return recvs[0] if recvs else None

    def _tick(self) -> None:
        if self.closed:
            self.running = False
            return
        k, wcs = self.poll(16)
        if k:
            for wc in wcs:
                if wc.status != self.ok:
                    self._fail(RuntimeError(f"completion error: status {wc.status} "
                                            f"vendor_err {wc.vendor_err} wr_id {wc.wr_id}"))
                    return
                if wc.wr_id == _RECV_ID:
                    self.v.qp.post_recv(self.rwr)
                    if self.on_recv is not None:
                        self.on_recv()
                    if self._recv_waiter() is not None:
                        self.recvs.popleft().set_result(wc.byte_len)
                    elif self.bank:
                        self.ready.append(wc.byte_len)
                elif self.sends:
                    f = self.sends.popleft()
                    if not f.done():
                        f.set_result(None)
        if self.keep or self.sends or self._recv_waiter() is not None:
            self.loop.call_soon(self._tick)
        else:
            self.running = False

    def _fail(self, exc: BaseException) -> None:
        self.failed = exc
        self.running = False
        for q in (self.sends, self.recvs):
            while q:
                f = q.popleft()
                if not f.done():
                    f.set_exception(exc)


# ======================================================================= server
class AioVerbsServer:
    """The server backend of ``aiordma/bench/worker.py`` (start/begin/mark/end/close)."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.v: PyverbsQP | None = None
        self.poller: _Poller | None = None
        self._connected: asyncio.Future[None] | None = None
        self._xchg: asyncio.Server | None = None
        self._task: asyncio.Task[None] | None = None
        self.received = 0
        self.unacked = 0
        self._waiter: tuple[int, asyncio.Future[None]] | None = None

    async def start(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.v = v = PyverbsQP(self.cfg)
        self.poller = p = _Poller(v, loop)
        p.on_recv = self._count
        self._connected = loop.create_future()

        async def answer(peer: dict[str, Any]) -> dict[str, Any]:
            v.connect(peer)
            return v.info()

        self._xchg, where = await exchange_server(answer, self._connected,
                                                  after=lambda: p.post_recvs(RQ_DEPTH))
        return where

    def _count(self) -> None:
        self.received += 1
        self._check()

    def _check(self) -> None:
        w = self._waiter
        if w is not None and self.received >= w[0] and not self.unacked and not w[1].done():
            w[1].set_result(None)

    async def begin(self, test: str, size: int, window: int, timeout: float) -> dict[str, Any]:
        assert self._connected is not None and self.poller is not None
        await bounded(asyncio.shield(self._connected), timeout, "the pyverbs-async QP")
        self.received = 0
        self.poller.ready.clear()
        self.poller.bank = test == "send_lat"
        self.poller.keep = test in ("send_lat", "send_bw", "msg_rate")
        if self.poller.keep:
            self.poller.kick()
        if test == "send_lat":
            self._task = asyncio.get_running_loop().create_task(self._echo())
        return {}

    async def _echo(self) -> None:
        assert self.v is not None and self.poller is not None
        p = self.poller
        wrs: dict[int, Any] = {}
        while True:
            got = p.recv()
            n = got if isinstance(got, int) else await got
            w = wrs.get(n)
            if w is None:
                w = wrs[n] = self.v.send_wr(_SEND_ID, n)
            self.unacked += 1
            try:
                await p.send_done(w)
            finally:
                self.unacked -= 1
            self._check()

    async def _wait_received(self, n: int, timeout: float) -> None:
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiter = (n, fut)
        self._check()
        try:
            await bounded(fut, timeout, f"server receiving {n} messages")
        finally:
            self._waiter = None

    async def mark(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        if self.poller is not None and self.poller.keep:
            await self._wait_received(sent_msgs, timeout)
        self.received = 0

    async def end(self, sent_msgs: int, sent_bytes: int, timeout: float) -> None:
        try:
            if self.poller is not None and self.poller.keep:
                await self._wait_received(sent_msgs, timeout)
        finally:
            if self._task is not None:
                self._task.cancel()
                self._task = None
            if self.poller is not None:
                self.poller.keep = False

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._xchg is not None:
            self._xchg.close()
        if self.poller is not None:
            self.poller.closed = True
        if self.v is not None:
            self.v.close()


# ======================================================================= client
class AioVerbsClient:
    """The client backend of ``aiordma/bench/worker.py`` (connect/lat_op/stream/close)."""

    def __init__(self, cfg: Config, info: dict[str, Any]) -> None:
        self.cfg = cfg
        self.info = info
        self.v: PyverbsQP | None = None
        self.peer: dict[str, Any] = {}
        self.poller: _Poller | None = None

    async def connect(self) -> None:
        self.v = v = PyverbsQP(self.cfg)
        self.peer = await exchange_lines(self.info["host"], self.info["port"], v.info(),
                                         "pyverbs-async")
        v.connect(self.peer)
        self.poller = _Poller(v, asyncio.get_running_loop())
        self.poller.post_recvs(RQ_DEPTH)

    def lat_op(self, test: str, size: int) -> Callable[[], Awaitable[Any]]:
        v, p = self.v, self.poller
        assert v is not None and p is not None
        if test == "send_lat":
            swr = v.send_wr(_SEND_ID, size)
            send_done, recv = p.send_done, p.recv

            async def pingpong() -> None:
                await send_done(swr)
                got = recv()
                if not isinstance(got, int):
                    await got
            return pingpong
        w = v.rdma_wr(_SEND_ID, test, size, self.peer)
        send_done = p.send_done
        return lambda: send_done(w)

    async def stream(self, test: str, size: int, count: int, window: int,
                     max_seconds: float) -> int:
        v, p = self.v, self.poller
        assert v is not None and p is not None
        if test in ("send_bw", "msg_rate"):
            w = v.send_wr(_SEND_ID, size)
        else:
            w = v.rdma_wr(_SEND_ID, test, size, self.peer)
        send_done = p.send_done
        ops, _secs = await windowed(lambda: send_done(w), count, window, max_seconds)
        return ops

    async def close(self) -> None:
        if self.poller is not None:
            self.poller.closed = True
        if self.v is not None:
            self.v.close()
