"""Smoke check of the ``verbs`` provider's version shims on a real device (run in the VM).

    python3 tests/rxe/verbs_smoke.py

Prints what the provider found (pyverbs version, enum module, context pointer, channel
struct) and cross-checks the probes against pyverbs' own properties where a version has
them; then a loopback SEND through a shared completion channel, async events, and what
the device itself does with a misaligned atomic (posted through pyverbs directly, since
the provider refuses it before posting). Exit status 0 when every check passed.
"""

from __future__ import annotations

import os
import select
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from aiordma.verbs import (  # noqa: E402
    SGE,
    Access,
    AHAttr,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    WROpcode,
    open_context,
)
from aiordma.verbs.ibverbs import compat, probe  # noqa: E402
from aiordma.verbs.ibverbs.context import IbvContext  # noqa: E402

failures: list[str] = []


def check(cond: bool, what: str) -> None:
    print(("ok    " if cond else "FAIL  ") + what, flush=True)
    if not cond:
        failures.append(what)


def main() -> int:
    ip = os.environ.get("AIORDMA_TEST_IP") or os.environ.get("AIORDMA_RXE_ADDR", "127.0.0.1")
    ctx = open_context(provider="verbs")
    assert isinstance(ctx, IbvContext)
    pv = ctx._pv
    print(f"device {ctx.name}: {pv.describe()}; channel fd attribute: {pv.channel_has_fd}")
    print(f"context pointer {ctx._ctx_ptr or 0:#x}, async fd {ctx.async_fd}, "
          f"native async events: {ctx._reader is not None}")
    check(bool(ctx._ctx_ptr), "struct ibv_context located")
    words = probe.object_words(ctx._ctx)
    probed = probe.find_context_pointer(words, int(ctx._ctx.cmd_fd), ctx._mem.read,
                                         probe.is_event_fd)
    check(probed == ctx._ctx_ptr, "memory probe finds the same struct ibv_context")
    if pv.context_ptr_property:
        check(int(ctx._ctx.context) == probed, "probe == Context.context (rdma-core >= 61)")
    check(not os.get_blocking(ctx.async_fd), "async fd is non-blocking")
    check(probe.is_event_fd(ctx.async_fd), "async fd is an infinibandevent file")

    ch = ctx.create_comp_channel()
    check(ch._reader is not None, "struct ibv_comp_channel located (shared channels work)")
    check(not os.get_blocking(ch.fd), "channel fd is non-blocking")
    if pv.channel_has_fd:
        check(int(ch._cc.fd) == ch.fd, "channel fd == CompChannel.fd (rdma-core >= 57)")
        found = probe.find_channel(probe.object_words(ch._cc), ctx._ctx_ptr or 0,
                                    ctx._mem.read, probe.is_event_fd)
        check(found is not None and found[1] == ch.fd, "probe alone finds the same channel fd")
    attr = ctx.query_device()
    print(f"device attributes: {attr}")
    port = ctx.query_port(1)
    print(f"port 1: {port}")
    gi = ctx.gid_index_for(ip)
    gid = ctx.query_gid(1, gi)
    print(f"GID index for {ip}: {gi} = {compat.format_gid(gid)}")

    # loopback SEND with immediate data through one channel shared by two CQs
    pd = ctx.alloc_pd()
    cq_a = ctx.create_cq(16, ch)
    cq_b = ctx.create_cq(16, ch)
    print(f"CQ cqe requested 16, device gives {cq_a.cqe}")
    cap = QPCap(max_send_wr=8, max_recv_wr=8, max_send_sge=1, max_recv_sge=1)
    a = pd.create_qp(cq_a, cq_a, cap)
    b = pd.create_qp(cq_b, cq_b, cap)
    for qp, peer in ((a, b), (b, a)):
        qp.modify(QPAttr(QPState.INIT, qp_access_flags=Access.LOCAL_WRITE | Access.REMOTE_WRITE
                         | Access.REMOTE_READ | Access.REMOTE_ATOMIC))
        qp.modify(QPAttr(QPState.RTR, dest_qp_num=peer.qp_num, rq_psn=1, min_rnr_timer=1,
                         ah_attr=AHAttr(dgid=gid, sgid_index=gi)))
        qp.modify(QPAttr(QPState.RTS, sq_psn=1))
    buf = bytearray(64)
    mr = pd.reg_mr(buf, Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ
                   | Access.REMOTE_ATOMIC)
    buf[:5] = b"hello"
    cq_a.req_notify()
    cq_b.req_notify()
    b.post_recv([RecvWR(1, [SGE(mr.addr + 32, 16, mr.lkey)])])
    a.post_send([SendWR(2, WROpcode.SEND_WITH_IMM, [SGE(mr.addr, 5, mr.lkey)],
                        imm_data=0xDEADBEEF)])
    got: dict[int, int] = {}
    deadline = time.monotonic() + 10
    while len(got) < 2 and time.monotonic() < deadline:
        select.select([ch.fd], [], [], 0.5)
        while (cq := ch.get_event()) is not None:
            got[id(cq)] = got.get(id(cq), 0) + 1
    check(got.get(id(cq_a)) == 1 and got.get(id(cq_b)) == 1,
          f"one event for each CQ of the shared channel ({len(got)} CQs signalled)")
    wa, wb = cq_a.poll(), cq_b.poll()
    check([w.status.name for w in wa] == ["SUCCESS"], f"send completion {wa}")
    check(len(wb) == 1 and wb[0].imm_data == 0xDEADBEEF and bytes(buf[32:37]) == b"hello",
          f"receive completion with imm 0xDEADBEEF {wb} {wb and hex(wb[0].imm_data)}")
    for cq in (cq_a, cq_b):
        cq.ack_events(got.get(id(cq), 0))

    # what rxe does with a misaligned atomic (the provider refuses it before posting)
    e = pv.wr
    sge = e.SGE(mr.addr, 8, mr.lkey)
    wr = e.SendWR(wr_id=9, opcode=int(WROpcode.ATOMIC_FETCH_AND_ADD), num_sge=1, sg=[sge])
    wr.set_wr_atomic(mr.rkey, mr.addr + 4, 1, 0)
    try:
        a._qp.post_send(wr)
        time.sleep(0.5)
        print(f"rxe: misaligned atomic posted; completion {cq_a.poll()}; QP {a.state.name}")
    except pv.Error as exc:
        print(f"rxe: misaligned atomic refused by ibv_post_send: {exc}")
    print(f"async events: {ctx.get_async_events()}")
    for qp in (a, b):
        qp.close()
    mr.close()
    for cq in (cq_a, cq_b):
        cq.close()
    ch.close()
    pd.close()
    ctx.close()
    print("FAILED: " + "; ".join(failures) if failures else "all smoke checks passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
