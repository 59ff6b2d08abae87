"""The ``pyverbs`` baseline: the same tests as ``aiordma/bench/rdma.py`` written the way a
synchronous pyverbs program would, with nothing in between -- one RC QP over the
device, work requests built once and re-posted, and ``cq.poll()`` in a busy loop (no
completion channel, no event loop). It is what aiordma's ``verbs`` provider is measured
against: the cost of Python calling pyverbs, without asyncio, framing or credits.

    python -m aiordma.bench.worker server pyverbs CONFIG_JSON
    python -m aiordma.bench.worker client pyverbs CONFIG_JSON SERVER_INFO_JSON

The two processes speak the harness's control protocol (JSON lines, see
``aiordma/bench/worker.py``) over a plain blocking TCP socket, which also carries the QP
numbers, PSNs, GIDs and the server's buffer (address, rkey) at connection time.

* ``send_lat``   -- the client posts a receive, then a SEND of ``size``; the server's
  busy loop answers every receive with a SEND of the same length (a ping-pong; the
  full round trip is measured, like every latency of this harness).
* ``write_lat`` / ``read_lat`` / ``atomic_lat`` -- one signalled RDMA WRITE / READ /
  FETCH_AND_ADD at a time, waited for by polling (the server does nothing).
* ``send_bw`` / ``msg_rate`` -- ``window`` SENDs in flight; the server keeps its
  receive queue full and counts receives.
* ``write_bw`` / ``read_bw`` -- ``window`` signalled WRITEs/READs in flight.

The server polls only while a test needs it (send tests); otherwise it waits on the
control socket, as aiordma's server does. GID selection reuses aiordma's
(``aiordma.verbs.ibverbs.compat``): the RoCE v2 IPv4 GID, ``AIORDMA_GID_INDEX``
overrides.
"""

from __future__ import annotations

import json
import select
import socket
import time
from typing import Any

from .common import LAT_TESTS, Config, CPUClock, Result, fill, lat_stats, test_timeout
from .pyverbs_qp import RQ_DEPTH, PyverbsQP

CTL_EVERY = 256         # the server looks at its control socket every this many empty polls


class _Poller:
    """Busy-polls the CQ; raises on an error completion."""

    def __init__(self, v: PyverbsQP) -> None:
        self.poll = v.cq.poll
        self.ok = v.e["IBV_WC_SUCCESS"]

    def wait(self, n: int, deadline: float) -> list[Any]:
        """Exactly ``n`` completions (polling; never more than asked)."""
        out: list[Any] = []
        poll = self.poll
        spins = 0
        while len(out) < n:
            k, wcs = poll(n - len(out))
            if k:
                for wc in wcs:
                    if wc.status != self.ok:
                        raise RuntimeError(f"completion error: status {wc.status} "
                                           f"vendor_err {wc.vendor_err} wr_id {wc.wr_id}")
                out += wcs
                continue
            spins += 1
            if not spins & 0xFFF and time.perf_counter() > deadline:
                raise TimeoutError(f"{n - len(out)} of {n} completions missing")
        return out


# ======================================================================= control channel
class _Ctl:
    """JSON lines over a blocking TCP socket (the server also peeks without blocking)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = b""

    def send(self, **msg: Any) -> None:
        self.sock.sendall(json.dumps(msg).encode() + b"\n")

    def _line(self) -> dict[str, Any] | None:
        i = self.buf.find(b"\n")
        if i < 0:
            return None
        line, self.buf = self.buf[:i], self.buf[i + 1:]
        msg: dict[str, Any] = json.loads(line)
        return msg

    def recv(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            msg = self._line()
            if msg is not None:
                return msg
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            r, _, _ = select.select([self.sock], [], [], left)
            if not r:
                raise TimeoutError("control channel: no message")
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("control connection closed")
            self.buf += data

    def peek(self) -> dict[str, Any] | None:
        """A message if one is there, without blocking."""
        msg = self._line()
        if msg is not None:
            return msg
        r, _, _ = select.select([self.sock], [], [], 0)
        if not r:
            return None
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("control connection closed")
        self.buf += data
        return self._line()

    def call(self, timeout: float, **msg: Any) -> dict[str, Any]:
        self.send(**msg)
        reply = self.recv(timeout)
        if reply.get("error"):
            raise RuntimeError(f"server: {reply['error']}")
        return reply


# ======================================================================= server
def serve(cfg: Config) -> int:
    v = PyverbsQP(cfg)
    lsock = socket.create_server(("127.0.0.1", 0))
    port = lsock.getsockname()[1]
    print("READY " + json.dumps({"control": port, "data": {"device": v.name}}), flush=True)
    lsock.settimeout(60)
    sock, _ = lsock.accept()
    lsock.close()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ctl = _Ctl(sock)
    try:
        hello = ctl.recv(60)
        v.connect(hello)
        ctl.send(**v.info())
        _Server(v, ctl, cfg).run()
    finally:
        sock.close()
        v.close()
    return 0


class _Server:
    def __init__(self, v: PyverbsQP, ctl: _Ctl, cfg: Config) -> None:
        self.v = v
        self.ctl = ctl
        self.tmo = test_timeout(cfg)
        self.rwr = v.recv_wr(2)
        for _ in range(RQ_DEPTH):
            v.qp.post_recv(self.rwr)
        self.sends: dict[int, Any] = {}
        self.mode = "idle"      # idle | echo | sink
        self.size = 0
        self.received = 0
        self.unacked = 0        # echo sends not completed yet
        self.pending: tuple[str, int, float] | None = None  # (cmd, msgs, deadline)
        self.cpu = CPUClock()
        self.ok = v.e["IBV_WC_SUCCESS"]

    def run(self) -> None:
        ctl = self.ctl
        while True:
            msg: dict[str, Any] | None
            if self.mode == "idle" and self.pending is None:
                msg = ctl.recv()
            else:
                msg = self._poll_until_control()
            if msg is not None and not self._command(msg):
                return
            self._check_pending()

    def _command(self, msg: dict[str, Any]) -> bool:
        cmd = msg.get("cmd")
        if cmd == "begin":
            test = msg["test"]
            self.mode = ("echo" if test == "send_lat" else
                         "sink" if test in ("send_bw", "msg_rate") else "idle")
            self.size = msg["size"]
            self.received = 0
            self.ctl.send(ok=True)
        elif cmd in ("mark", "end"):
            self.pending = (cmd, msg["msgs"] if self.mode != "idle" else 0,
                            time.perf_counter() + self.tmo)
        elif cmd == "quit":
            self.ctl.send(ok=True)
            return False
        else:
            self.ctl.send(error=f"unknown command {cmd!r}")
        return True

    def _check_pending(self) -> None:
        if self.pending is None:
            return
        cmd, msgs, deadline = self.pending
        if self.received >= msgs and not self.unacked:
            self.pending = None
            if cmd == "mark":
                self.received = 0
                self.cpu.start()
                self.ctl.send(ok=True)
            else:
                self.mode = "idle"
                self.ctl.send(cpu=self.cpu.elapsed())
        elif time.perf_counter() > deadline:
            self.pending = None
            self.mode = "idle"
            self.ctl.send(error=f"server received {self.received} of {msgs} messages")

    def _send_wr(self, size: int) -> Any:
        w = self.sends.get(size)
        if w is None:
            w = self.sends[size] = self.v.send_wr(1, size)
        return w

    def _poll_until_control(self) -> dict[str, Any] | None:
        """Serve the CQ (echo or count receives) until a control message arrives or a
        pending mark/end can be answered."""
        v = self.v
        poll, post_recv, post_send = v.cq.poll, v.qp.post_recv, v.qp.post_send
        rwr, ok = self.rwr, self.ok
        echo = self.mode == "echo"
        empty = 0
        while True:
            k, wcs = poll(16)
            if k:
                empty = 0
                for wc in wcs:
                    if wc.status != ok:
                        raise RuntimeError(f"server completion error: status {wc.status}")
                    if wc.wr_id == 2:       # a receive
                        self.received += 1
                        post_recv(rwr)
                        if echo:
                            post_send(self._send_wr(wc.byte_len))
                            self.unacked += 1
                    else:
                        self.unacked -= 1
                if self.pending is not None:
                    p = self.pending
                    if self.received >= p[1] and not self.unacked:
                        return None
                continue
            empty += 1
            if empty % CTL_EVERY == 0:
                msg = self.ctl.peek()
                if msg is not None:
                    return msg
                if self.pending is not None and time.perf_counter() > self.pending[2]:
                    return None


# ======================================================================= client
def client(cfg: Config, server: dict[str, Any]) -> int:
    v = PyverbsQP(cfg)
    sock = socket.create_connection(("127.0.0.1", server["control"]), timeout=30)
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    ctl = _Ctl(sock)
    failed = 0
    try:
        ctl.send(**v.info())
        peer = ctl.recv(60)
        v.connect(peer)
        rwr = v.recv_wr(2)
        for test, size in cfg.items()[cfg.skip:]:
            try:
                res = _one(v, ctl, cfg, test, size, peer, rwr)
            except Exception as exc:
                import traceback

                traceback.print_exc()
                res = Result("pyverbs", test, size, loop="-", error=repr(exc))
                failed += 1
                print("RESULT " + json.dumps(res.to_dict()), flush=True)
                return 1  # the QP's state is unknown: the harness restarts the pair
            print("RESULT " + json.dumps(res.to_dict()), flush=True)
    finally:
        try:
            ctl.call(10, cmd="quit")
        except Exception:
            pass
        sock.close()
        v.close()
    return 1 if failed else 0


def _one(v: PyverbsQP, ctl: _Ctl, cfg: Config, test: str, size: int, peer: dict[str, Any],
         rwr: Any) -> Result:
    res = Result("pyverbs", test, size, loop="-")
    tmo = test_timeout(cfg)
    warm, iters = cfg.iters_for(test, size)
    window = cfg.window_for(test)
    res.window = window
    ctl.call(tmo, cmd="begin", test=test, size=size, window=window)
    poller = _Poller(v)
    cpu = CPUClock()
    if test in LAT_TESTS:
        if test == "send_lat":
            swr = v.send_wr(1, size)
            post_recv, post_send = v.qp.post_recv, v.qp.post_send
            wait = poller.wait

            def op(deadline: float) -> None:
                post_recv(rwr)
                post_send(swr)
                wait(2, deadline)       # our send's completion and the echo's receive
        else:
            w = v.rdma_wr(1, test, size, peer)
            post_send, wait = v.qp.post_send, poller.wait

            def op(deadline: float) -> None:
                post_send(w)
                wait(1, deadline)
        deadline = time.perf_counter() + tmo
        for _ in range(warm):
            op(deadline)
        ctl.call(tmo, cmd="mark", msgs=warm)
        cpu.start()
        clock = time.perf_counter_ns
        samples: list[int] = []
        append = samples.append
        stop = clock() + int(cfg.max_seconds * 1e9)
        deadline = time.perf_counter() + tmo
        start = t = clock()
        for _ in range(iters):
            op(deadline)
            t1 = clock()
            append(t1 - t)
            t = t1
            if t1 > stop:
                break
        res.cpu_client_s = cpu.elapsed()
        reply = ctl.call(tmo, cmd="end", msgs=len(samples))
        fill(res, ops=len(samples), seconds=(t - start) / 1e9, size=size, samples_ns=samples)
        assert lat_stats(samples)
    else:
        if test in ("send_bw", "msg_rate"):
            w = v.send_wr(1, size)
        else:
            w = v.rdma_wr(1, test, size, peer)
        w_done = _stream(v, poller, w, warm, window, cfg.max_seconds, tmo) if warm else 0
        ctl.call(tmo, cmd="mark", msgs=w_done)
        cpu.start()
        t0 = time.perf_counter()
        ops = _stream(v, poller, w, iters, window, cfg.max_seconds, tmo)
        reply = ctl.call(tmo, cmd="end", msgs=ops)
        secs = time.perf_counter() - t0
        res.cpu_client_s = cpu.elapsed()
        fill(res, ops=ops, seconds=secs, size=size)
        if ops and secs:
            res.lat_mean_us = secs / ops * window * 1e6
    res.cpu_server_s = reply.get("cpu")
    if res.ops and res.cpu_client_s is not None and res.cpu_server_s is not None:
        res.cpu_us_per_op = (res.cpu_client_s + res.cpu_server_s) / res.ops * 1e6
    return res


def _stream(v: PyverbsQP, poller: _Poller, w: Any, count: int, window: int, max_seconds: float,
            tmo: float) -> int:
    """Keep ``window`` signalled WRs in flight until ``count`` completed or
    ``max_seconds`` passed (then no new ones are posted). Returns completed ops."""
    post_send, poll, ok = v.qp.post_send, v.cq.poll, poller.ok
    stop = time.perf_counter() + max_seconds
    deadline = time.perf_counter() + tmo
    posted = done = 0
    while posted < min(window, count):
        post_send(w)
        posted += 1
    spins = 0
    while done < posted:
        k, wcs = poll(16)
        if not k:
            spins += 1
            if not spins & 0xFFF and time.perf_counter() > deadline:
                raise TimeoutError(f"{posted - done} of {posted} completions missing")
            continue
        for wc in wcs:
            if wc.status != ok:
                raise RuntimeError(f"completion error: status {wc.status} "
                                   f"vendor_err {wc.vendor_err}")
        done += k
        if posted < count:
            if time.perf_counter() > stop:
                count = posted
            else:
                n = min(k, count - posted)
                for _ in range(n):
                    post_send(w)
                posted += n
    return done
