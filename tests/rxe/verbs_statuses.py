"""Survey: which work-completion statuses the real device reports for each fault (VM only).

    AIORDMA_TEST_IP=10.0.2.15 python3 tests/rxe/verbs_statuses.py

Runs the fault cases of tests/test_verbs_provider.py (reusing its helpers) on the
``verbs`` provider and prints, per case, the completions of both QPs (wr_id, status,
vendor_err), the QP states afterwards and the async events: the facts the ``soft``
provider is aligned with. Prints only; the exit status is 0 unless the survey crashed.
"""

from __future__ import annotations

import os
import signal
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
sys.path.insert(0, os.path.dirname(HERE))

os.environ.setdefault("AIORDMA_PROVIDER", "verbs")

import test_verbs_provider as t  # noqa: E402

from aiordma.verbs import (  # noqa: E402
    SGE,
    Access,
    QPCap,
    RecvWR,
    WROpcode,
    open_context,
)

ctx = open_context(provider="verbs")


def drain(cq, first: float = 3.0, quiet: float = 0.3):  # type: ignore[no-untyped-def]
    """Completions until ``quiet`` s pass without one (at most ``first`` s for the first)."""
    out = []
    last = time.monotonic()
    while True:
        got = cq.poll(16)
        now = time.monotonic()
        if got:
            out += got
            last = now
        elif now - last > (quiet if out else first):
            return out
        else:
            time.sleep(0.005)


def fmt(wcs) -> str:  # type: ignore[no-untyped-def]
    return ", ".join(f"{w.wr_id}:{w.status.name}" + (f"/v{w.vendor_err:#x}" if w.vendor_err
                                                     else "") for w in wcs) or "-"


def report(name: str, p, t0: float) -> None:  # type: ignore[no-untyped-def]
    wa, wb = drain(p.cq_a), drain(p.cq_b)
    evs = [(e.event_type.name, e.qp_num) for e in ctx.get_async_events()]
    qpn = {p.a.qp_num: "a", p.b.qp_num: "b"}
    evs_s = ", ".join(f"{n}({qpn.get(q, q)})" for n, q in evs) or "-"
    print(f"{name:34} requester a: {fmt(wa):45} responder b: {fmt(wb):30} "
          f"states a={p.a.state.name} b={p.b.state.name}; async: {evs_s} "
          f"[{time.monotonic() - t0:.2f}s]", flush=True)


def case(name: str, fn) -> None:  # type: ignore[no-untyped-def]
    res = t.Resources(ctx)
    try:
        ctx.get_async_events()
        t0 = time.monotonic()
        p = fn(res)
        if p is not None:
            report(name, p, t0)
    except Exception as exc:
        print(f"{name:34} raised {exc!r}", flush=True)
    finally:
        res.close()


def recv_too_small(res):  # type: ignore[no-untyped-def]
    p = t.Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(1, [t.sge(mb, 0, 8)]), RecvWR(2, [t.sge(mb)])])
    p.a.post_send([t.send(3, [t.sge(ma, 0, 16)]), t.send(4, [t.sge(ma, 0, 4)])])
    return p


def local(kind: str):  # type: ignore[no-untyped-def]
    def run(res):  # type: ignore[no-untyped-def]
        p = t.Pair(ctx, res)
        ma, _ = p.mr("a", 4096)
        mb, _ = p.mr("b", 4096)
        p.b.post_recv([RecvWR(i, [t.sge(mb)]) for i in range(3)])
        op = WROpcode.SEND
        if kind == "bad_lkey":
            bad = SGE(ma.addr, 16, ma.lkey ^ 0x5A5A00)
        elif kind == "outside_mr":
            bad = SGE(ma.addr + 4090, 16, ma.lkey)
        elif kind == "other_pd":
            bad = t.sge(res.add(p.pd_b.reg_mr(bytearray(64), t.ACC_ALL)), 0, 16)
        else:
            bad = t.sge(res.add(p.pd_a.reg_mr(bytearray(64), Access.REMOTE_READ)), 0, 16)
            op = WROpcode.RDMA_READ
        p.a.post_send([t.send(1, [t.sge(ma, 0, 16)]),
                       t.send(2, [bad], op, remote_addr=mb.addr, rkey=mb.rkey),
                       t.send(3, [t.sge(ma, 0, 16)])])
        return p
    return run


def local_alone(res):  # type: ignore[no-untyped-def]
    p = t.Pair(ctx, res)
    ma, _ = p.mr("a", 4096)
    p.a.post_send([t.send(2, [SGE(ma.addr, 16, ma.lkey ^ 0x5A5A00)]),
                   t.send(3, [t.sge(ma, 0, 16)])])
    return p


def remote(kind: str):  # type: ignore[no-untyped-def]
    def run(res):  # type: ignore[no-untyped-def]
        p, ma, mb, op, length, raddr, rkey = t.remote_case(ctx, res, kind)
        p.b.post_recv([RecvWR(9, [t.sge(mb)])])
        p.a.post_send([t.send(1, [t.sge(ma, 0, length)], op, remote_addr=raddr, rkey=rkey,
                              compare_add=1), t.send(2, [t.sge(ma, 0, 16)])])
        return p
    return run


def qp_flags(op: WROpcode, access_b: Access):  # type: ignore[no-untyped-def]
    def run(res):  # type: ignore[no-untyped-def]
        p = t.Pair(ctx, res, access_b=access_b)
        ma, _ = p.mr("a", 64)
        mb, _ = p.mr("b", 64)
        p.a.post_send([t.send(1, [t.sge(ma, 0, 8)], op, remote_addr=mb.addr, rkey=mb.rkey,
                              compare_add=1)])
        return p
    return run


def rnr(op: WROpcode):  # type: ignore[no-untyped-def]
    def run(res):  # type: ignore[no-untyped-def]
        p = t.Pair(ctx, res, rnr_retry=2, min_rnr_timer=1)
        ma, _ = p.mr("a", 64)
        mb, _ = p.mr("b", 64)
        p.a.post_send([t.send(1, [t.sge(ma, 0, 8)], op, remote_addr=mb.addr, rkey=mb.rkey),
                       t.send(2, [t.sge(ma, 0, 8)])])
        return p
    return run


def write_imm_no_recv_rnr0(res):  # type: ignore[no-untyped-def]
    p = t.Pair(ctx, res, rnr_retry=0, min_rnr_timer=1)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.a.post_send([t.send(1, [t.sge(ma, 0, 8)], WROpcode.RDMA_WRITE_WITH_IMM,
                          remote_addr=mb.addr, rkey=mb.rkey, imm_data=5)])
    return p


def zero_len_recv_for_write_imm(res):  # type: ignore[no-untyped-def]
    p = t.Pair(ctx, res)
    ma, _ = p.mr("a", 64)
    mb, _ = p.mr("b", 64)
    p.b.post_recv([RecvWR(7, [])])
    p.a.post_send([t.send(1, [t.sge(ma, 0, 8)], WROpcode.RDMA_WRITE_WITH_IMM,
                          remote_addr=mb.addr, rkey=mb.rkey, imm_data=0xCAFE)])
    return p


def peer_killed(res):  # type: ignore[no-untyped-def]
    """The peer process dies (its QP is destroyed by the kernel), then we write to it."""
    child = t.Child("verbs")
    try:
        pd = res.add(ctx.alloc_pd())
        cq = res.add(ctx.create_cq(64))
        qp = res.add(pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16)))
        buf = bytearray(4096)
        m = res.add(pd.reg_mr(buf, t.ACC_ALL))
        child.connect(ctx, qp, timeout=10, retry_cnt=2)
        t._one_sided_roundtrip(cq, qp, m, buf, child.info)
        os.kill(child.proc.pid, signal.SIGSTOP)
        qp.post_send([t.send(4, [t.sge(m, 0, 64)], WROpcode.RDMA_WRITE,
                             remote_addr=child.info["addr"], rkey=child.info["rkey"])])
        print(f"{'peer SIGSTOPped (alive)':34} write: {fmt(t.poll_n(cq, 1, 20))}", flush=True)
        child.kill()
        t0 = time.monotonic()
        qp.post_send([t.send(5, [t.sge(m, 0, 64)], WROpcode.RDMA_WRITE,
                             remote_addr=child.info["addr"], rkey=child.info["rkey"]),
                      t.send(6, [t.sge(m, 0, 64)], WROpcode.RDMA_WRITE,
                             remote_addr=child.info["addr"], rkey=child.info["rkey"])])
        wcs = t.poll_n(cq, 2, 30)
        print(f"{'peer killed, then 2 writes':34} {fmt(wcs)} after "
              f"{time.monotonic() - t0:.2f}s (timeout=10, retry_cnt=2); state {qp.state.name}",
              flush=True)
    finally:
        child.kill()


def main() -> int:
    print(f"device {ctx.name}, {ctx._pv.describe()}, kernel {os.uname().release}")  # type: ignore[attr-defined]
    case("recv buffer too small", recv_too_small)
    for k in ("bad_lkey", "outside_mr", "other_pd", "read_into_readonly_mr"):
        case(f"local: {k}", local(k))
    case("local: bad_lkey as first WR", local_alone)
    for k in t.REMOTE_CASES:
        case(f"remote: {k}", remote(k))
    case("QP flags no REMOTE_READ: READ", qp_flags(WROpcode.RDMA_READ,
                                                   Access.LOCAL_WRITE | Access.REMOTE_WRITE))
    case("QP flags no ATOMIC: FETCH_ADD", qp_flags(WROpcode.ATOMIC_FETCH_AND_ADD,
                                                   Access.LOCAL_WRITE | Access.REMOTE_WRITE))
    case("RNR (rnr_retry=2): SEND", rnr(WROpcode.SEND))
    case("RNR (rnr_retry=2): WRITE_WITH_IMM", rnr(WROpcode.RDMA_WRITE_WITH_IMM))
    case("RNR (rnr_retry=0): WRITE_WITH_IMM", write_imm_no_recv_rnr0)
    case("WRITE_WITH_IMM into 0-SGE recv", zero_len_recv_for_write_imm)
    case("peer process killed", peer_killed)
    ctx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
