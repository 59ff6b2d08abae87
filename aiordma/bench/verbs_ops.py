"""What one verbs operation costs in Python, in one process, on a real device (rxe in the
Soft-RoCE VM, or a NIC): aiordma's ``verbs`` provider against bare pyverbs.

    python -m aiordma.bench.verbs_ops [--iters 300] [--rounds 3] [--device rxe0]

Two RC QPs on one device are connected to each other (loopback). Each row times one
call, median over ``--iters`` calls, rounds interleaved so that the variants share the
machine's moods:

* ``post_recv`` / ``post_send`` -- one receive / one 64-byte inline SEND, timed alone;
* ``poll, 1 ready``  -- a poll that returns the one completion already queued (the
  queue is given 3 ms of busy waiting first, so no wait for the device is timed);
* ``poll, empty``    -- a poll of an empty CQ;
* ``poll, B ready``  -- per completion, for a poll of ``B`` queued completions.

Variants: ``pyverbs`` (work requests built once and re-posted, ``CQ.poll``: the floor
of any Python program over pyverbs), ``provider`` (``aiordma.verbs`` objects, with
their checks and queue accounting, on the data path they chose: compiled where the
``fastpath`` extension is built, see ``aiordma/verbs/ibverbs/__init__.py``),
``pyverbs post, ctypes poll`` (the same objects posting pyverbs WRs and polling
through ctypes: the path without the extension), ``pyverbs poll`` (posting as
``provider`` does, polling with pyverbs' ``CQ.poll``) and ``compiled, no checks`` (the extension's posters re-posting the WRs already in their C arrays and its
poller's raw tuples: what a compiled caller pays, plus one Python call each).
Every wait is bounded (``WAIT_S``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from aiordma import native
from aiordma.errors import DeviceError
from aiordma.verbs import (
    SGE,
    Access,
    AHAttr,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendFlags,
    SendWR,
    WROpcode,
    open_context,
)
from aiordma.verbs.ibverbs import clib

WAIT_S = 5.0
SETTLE_S = 0.003
BATCHES = (1, 4, 16)
SIZE = 64


def _busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Loopback:
    """Two connected RC QPs (a -> b) on one device, each with its own CQ."""

    def __init__(self, device: str | None, ip: str) -> None:
        self.ctx: Any = open_context(device, provider="verbs")
        gi = self.ctx.gid_index_for(ip)
        gid = self.ctx.query_gid(1, gi)
        # (Any: the ibverbs objects' private parts are used below)
        self.pd: Any = self.ctx.alloc_pd()
        self.cq_a: Any = self.ctx.create_cq(256)
        self.cq_b: Any = self.ctx.create_cq(256)
        cap = QPCap(max_send_wr=64, max_recv_wr=64, max_send_sge=1, max_recv_sge=1,
                    max_inline_data=SIZE)
        self.a: Any = self.pd.create_qp(self.cq_a, self.cq_a, cap)
        self.b: Any = self.pd.create_qp(self.cq_b, self.cq_b, cap)
        for qp, peer in ((self.a, self.b), (self.b, self.a)):
            qp.modify(QPAttr(QPState.INIT, qp_access_flags=Access.LOCAL_WRITE))
            qp.modify(QPAttr(QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=1, min_rnr_timer=1,
                             ah_attr=AHAttr(dgid=gid, sgid_index=gi)))
            qp.modify(QPAttr(QPState.RTS, sq_psn=1))
        self.buf = bytearray(1 << 16)
        self.mr = self.pd.reg_mr(self.buf, Access.LOCAL_WRITE)
        # each object's own data path, and the ctypes poller of each CQ
        cqs: tuple[Any, ...] = (self.cq_a, self.cq_b)
        qps: tuple[Any, ...] = (self.a, self.b)
        ctx: Any = self.ctx
        self.pollers = {id(cq): cq._poller for cq in cqs}
        self.posters = {id(qp): qp._fast for qp in qps}
        self.ctypes_pollers = {
            id(cq): clib.CQPoller(ctx._ctx_ptr, cq._cq_ptr) if cq._cq_ptr else None
            for cq in cqs}

    def use(self, post: str, poll: str) -> None:
        """``post``: "own" (the QP's data path) or "pyverbs"; ``poll``: "own",
        "ctypes" or "pyverbs"."""
        for qp in (self.a, self.b):
            qp._fast = self.posters[id(qp)] if post == "own" else None
        for cq in (self.cq_a, self.cq_b):
            cq._poller = {"own": self.pollers[id(cq)], "pyverbs": None,
                          "ctypes": self.ctypes_pollers[id(cq)]}[poll]

    def recv_wr(self, i: int) -> RecvWR:
        return RecvWR(100 + i, [SGE(self.mr.addr + 4096 + SIZE * i, SIZE, self.mr.lkey)])

    def send_wr(self, i: int) -> SendWR:
        return SendWR(i, WROpcode.SEND, [SGE(self.mr.addr, SIZE, self.mr.lkey)],
                      send_flags=SendFlags.SIGNALED | SendFlags.INLINE)

    def close(self) -> None:
        for obj in (self.a, self.b, self.mr, self.cq_a, self.cq_b, self.pd, self.ctx):
            obj.close()


def _drain(poll: Callable[[], int], want: int) -> None:
    got = 0
    deadline = time.monotonic() + WAIT_S
    while got < want:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{want - got} of {want} completions missing")
        got += poll()


def _timed(fn: Callable[[], Any]) -> tuple[int, Any]:
    t = time.perf_counter_ns()
    r = fn()
    return time.perf_counter_ns() - t, r


class Variant:
    """One way of posting and polling; ``op_round`` returns ns for each single-op row."""

    def __init__(self, name: str, lb: Loopback) -> None:
        self.name = name
        self.lb = lb

    def setup(self) -> None:
        """Called before each of this variant's rounds."""

    def post_recv(self) -> None:
        raise NotImplementedError

    def post_send(self) -> None:
        raise NotImplementedError

    def poll_a(self, n: int) -> int:
        raise NotImplementedError

    def poll_b(self, n: int) -> int:
        raise NotImplementedError

    def op_round(self) -> dict[str, int]:
        out: dict[str, int] = {}
        out["post_recv"], _ = _timed(self.post_recv)
        out["post_send"], _ = _timed(self.post_send)
        _busy(SETTLE_S)
        out["poll, 1 ready"], n = _timed(lambda: self.poll_b(16))
        _drain(lambda: self.poll_a(16), 1)
        _drain(lambda: self.poll_b(16), 1 - n)
        out["poll, empty"], _ = _timed(lambda: self.poll_b(16))
        return out

    def batch_round(self, batch: int) -> int | None:
        """ns per completion of one poll of ``batch`` queued receives (None if the poll
        did not return them all)."""
        for _ in range(batch):
            self.post_recv()
        for _ in range(batch):
            self.post_send()
        _busy(SETTLE_S)
        t, n = _timed(lambda: self.poll_b(batch))
        _drain(lambda: self.poll_a(batch), batch)
        _drain(lambda: self.poll_b(batch), batch - n)
        return t // batch if n == batch else None


class Pyverbs(Variant):
    """Bare pyverbs: prebuilt work requests re-posted, ``CQ.poll``."""

    def __init__(self, lb: Loopback) -> None:
        super().__init__("pyverbs", lb)
        pv = lb.ctx._pv
        mr = lb.mr
        self.rwr = pv.wr.RecvWR(wr_id=9, num_sge=1,
                                sg=[pv.wr.SGE(mr.addr + 4096, SIZE, mr.lkey)])
        self.swr = pv.wr.SendWR(wr_id=7, opcode=int(WROpcode.SEND), num_sge=1,
                                sg=[pv.wr.SGE(mr.addr, SIZE, mr.lkey)],
                                send_flags=int(SendFlags.SIGNALED | SendFlags.INLINE))
        self._post_recv, self._post_send = lb.b._qp.post_recv, lb.a._qp.post_send
        self._poll_a, self._poll_b = lb.cq_a._cq.poll, lb.cq_b._cq.poll

    def post_recv(self) -> None:
        self._post_recv(self.rwr)

    def post_send(self) -> None:
        self._post_send(self.swr)

    def poll_a(self, n: int) -> int:
        return int(self._poll_a(n)[0])

    def poll_b(self, n: int) -> int:
        return int(self._poll_b(n)[0])


class Provider(Variant):
    """aiordma's provider objects (work requests re-used, as an endpoint does), posting
    and polling as ``post``/``poll`` say (``Loopback.use``)."""

    def __init__(self, lb: Loopback, name: str, post: str = "own", poll: str = "own") -> None:
        super().__init__(name, lb)
        self.post, self.poll = post, poll
        self.rwrs = [lb.recv_wr(i) for i in range(max(BATCHES))]
        self.swr = [lb.send_wr(7)]
        self.i = 0

    def setup(self) -> None:
        self.lb.use(self.post, self.poll)

    def post_recv(self) -> None:
        self.i = (self.i + 1) % len(self.rwrs)
        self.lb.b.post_recv([self.rwrs[self.i]])

    def post_send(self) -> None:
        self.lb.a.post_send(self.swr)

    def poll_a(self, n: int) -> int:
        return len(self.lb.cq_a.poll(n))

    def poll_b(self, n: int) -> int:
        return len(self.lb.cq_b.poll(n))


class Compiled(Variant):
    """The compiled posters and pollers without the provider: WRs already in the C
    arrays re-posted (``post_*_again``), completions as raw tuples. The queue
    accounting of the provider objects is not kept: this variant runs last."""

    def __init__(self, lb: Loopback) -> None:
        super().__init__("compiled, no checks", lb)
        pa, pb = lb.posters[id(lb.a)], lb.posters[id(lb.b)]
        assert pa is not None and pb is not None
        self.pa, self.pb = pa, pb
        qa, qb = lb.pollers[id(lb.cq_a)], lb.pollers[id(lb.cq_b)]
        self.qa, self.qb = qa, qb
        self.built = False

    def setup(self) -> None:
        if not self.built:  # one receive and one send in the arrays, through the provider
            self.lb.use("own", "own")
            self.lb.b.post_recv([self.lb.recv_wr(0)])
            self.lb.a.post_send([self.lb.send_wr(7)])
            _busy(SETTLE_S)
            _drain(lambda: len(self.lb.cq_a.poll(16)), 1)
            _drain(lambda: len(self.lb.cq_b.poll(16)), 1)
            self.built = True

    def post_recv(self) -> None:
        self.pb.post_recv_again(1)

    def post_send(self) -> None:
        self.pa.post_send_again(1)

    def poll_a(self, n: int) -> int:
        return max(0, self.qa.poll(n)[0])

    def poll_b(self, n: int) -> int:
        return max(0, self.qb.poll(n)[0])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=300)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--ip", default=os.environ.get("AIORDMA_TEST_IP", "127.0.0.1"))
    a = p.parse_args(argv)
    try:
        lb = Loopback(a.device, a.ip)
    except DeviceError as exc:
        print(f"verbs_ops: {exc}", file=sys.stderr)
        return 2
    try:
        print(f"aiordma build: {native.build()}; data paths: posts "
              f"{lb.a.data_path}, polls {lb.cq_a.data_path}")
        variants: list[Variant] = [Pyverbs(lb), Provider(lb, "provider")]
        if lb.a.data_path == "compiled":
            variants.append(Provider(lb, "pyverbs post, ctypes poll", "pyverbs",
                                     "ctypes" if all(lb.ctypes_pollers.values()) else "pyverbs"))
        if lb.cq_a.data_path != "pyverbs":
            variants.append(Provider(lb, "pyverbs poll", "own", "pyverbs"))
        if lb.a.data_path == "compiled" and lb.cq_a.data_path == "compiled":
            variants.append(Compiled(lb))
        ops: dict[str, dict[str, list[int]]] = {v.name: {} for v in variants}
        per: dict[str, dict[int, list[int]]] = {v.name: {b: [] for b in BATCHES}
                                                for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                v.setup()
                for _ in range(a.iters):
                    for k, ns in v.op_round().items():
                        ops[v.name].setdefault(k, []).append(ns)
                for b in BATCHES:
                    for _ in range(max(1, a.iters // 10)):
                        per_wc = v.batch_round(b)
                        if per_wc is not None:
                            per[v.name][b].append(per_wc)
        lb.use("own", "own")
        rows = list(next(iter(ops.values())))
        names = [v.name for v in variants]
        print(f"verbs layer costs on {lb.ctx.name}, one process, medians in us "
              f"({a.rounds} rounds x {a.iters})")
        print(f"{'':26s}" + "".join(f"{n:>27s}" for n in names))
        for r in rows:
            print(f"{r:26s}" + "".join(f"{statistics.median(ops[n][r]) / 1e3:27.1f}"
                                       for n in names))
        for b in BATCHES:
            cells = [per[n][b] for n in names]
            print(f"{f'poll, {b} ready, per WC':26s}" + "".join(
                f"{statistics.median(c) / 1e3:27.1f}" if c else f"{'-':>27s}" for c in cells))
    finally:
        lb.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
