"""A verbs peer in its own process, for tests/test_verbs_provider.py (multi-process tests).

Protocol on stdin/stdout, one JSON object per line:

1. child -> parent: {"qpn", "gid" (hex), "lid", "addr", "rkey", "length", "psn"}
2. parent -> child: {"qpn", "gid" (hex), "lid", "psn", "key" (hex: QPAttr.auth_key)}
3. child -> parent: {"ready": true}; then the child only sleeps (time.sleep) until it is
   killed: every one-sided operation on its memory is served without its help.

Provider: AIORDMA_PROVIDER (default soft); address: AIORDMA_TEST_IP (default 127.0.0.1);
size of the registered buffer: AIORDMA_TEST_PEER_MR (default 1 MiB).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from aiordma.verbs import (  # noqa: E402
    MTU,
    Access,
    AHAttr,
    QPAttr,
    QPCap,
    QPState,
    open_context,
)

MR_SIZE = int(os.environ.get("AIORDMA_TEST_PEER_MR", 1 << 20))


def main() -> None:
    ip = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
    ctx = open_context(provider=os.environ.get("AIORDMA_PROVIDER", "soft"))
    gi = ctx.gid_index_for(ip)
    pd = ctx.alloc_pd()
    cq = ctx.create_cq(64)
    qp = pd.create_qp(cq, cq, QPCap(max_send_wr=16, max_recv_wr=16))
    buf = bytearray(MR_SIZE)
    acc = Access.LOCAL_WRITE | Access.REMOTE_WRITE | Access.REMOTE_READ | Access.REMOTE_ATOMIC
    mr = pd.reg_mr(buf, acc)
    psn = 0x2222
    print(json.dumps({"qpn": qp.qp_num, "gid": ctx.query_gid(1, gi).hex(),
                      "lid": ctx.query_port(1).lid, "addr": mr.addr, "rkey": mr.rkey,
                      "length": mr.length, "psn": psn}), flush=True)
    peer = json.loads(sys.stdin.readline())
    qp.modify(QPAttr(QPState.INIT, qp_access_flags=acc, auth_key=bytes.fromhex(peer["key"])))
    qp.modify(QPAttr(QPState.RTR, dest_qp_num=peer["qpn"], rq_psn=peer["psn"],
                     path_mtu=MTU.MTU_1024, max_dest_rd_atomic=16, min_rnr_timer=1,
                     ah_attr=AHAttr(dgid=bytes.fromhex(peer["gid"]), dlid=peer["lid"],
                                    sgid_index=gi)))
    qp.modify(QPAttr(QPState.RTS, sq_psn=psn, timeout=14, retry_cnt=7, rnr_retry=7,
                     max_rd_atomic=16))
    print(json.dumps({"ready": True}), flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
