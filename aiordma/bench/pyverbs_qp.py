"""The pyverbs objects both pyverbs baselines of the bench use (``pyverbs_sync.py``, the
synchronous busy loop, and ``pyverbs_async.py``, the minimal asyncio program): one
device, PD, CQ, RC QP and registered buffers, its connection to the peer's QP, and its
work requests, built once to be re-posted.
"""

from __future__ import annotations

import os
from typing import Any

from .common import Config

__all__ = ["PyverbsQP", "PORT", "RQ_DEPTH", "SQ_DEPTH"]

PORT = 1
RQ_DEPTH = 256          # receives kept posted on the server (and on the client for send_lat)
SQ_DEPTH = 128          # >= every window
_INLINE_PROBE = (256, 128, 64, 0)


class PyverbsQP:
    """One device, PD, CQ, RC QP and registered buffers (pyverbs objects)."""

    def __init__(self, cfg: Config) -> None:
        from aiordma.verbs.ibverbs import compat
        from aiordma.verbs.ibverbs.loader import load_pyverbs

        self.pv = pv = load_pyverbs()
        e = pv.e
        self.e = e
        name = cfg.device or _first_active(pv)
        self.name = name
        self.ctx = pv.device.Context(name=name)
        self.port = self.ctx.query_port(PORT)
        self.roce = int(self.port.link_layer) != e.get("IBV_LINK_LAYER_INFINIBAND", 1)
        if self.roce:
            entries = compat.read_sysfs_gids(name, PORT) or []
            self.gid_index = compat.select_gid_index(entries, "127.0.0.1", dev=name, port=PORT)
        else:
            self.gid_index = 0
        self.gid = str(self.ctx.query_gid(PORT, self.gid_index))
        self.pd = pv.pd.PD(self.ctx)
        self.cq = pv.cq.CQ(self.ctx, SQ_DEPTH + 2 * RQ_DEPTH + 16, None, None, 0)
        size = max(64, (max(cfg.sizes) + 63) // 64 * 64)
        self.size = size
        acc = (e["IBV_ACCESS_LOCAL_WRITE"] | e["IBV_ACCESS_REMOTE_WRITE"]
               | e["IBV_ACCESS_REMOTE_READ"] | e["IBV_ACCESS_REMOTE_ATOMIC"])
        self.mr = pv.mr.MR(self.pd, size, acc)          # the peer's target; receives land here
        self.smr = pv.mr.MR(self.pd, size, e["IBV_ACCESS_LOCAL_WRITE"])  # what we send/read into
        self.amr = pv.mr.MR(self.pd, 64, e["IBV_ACCESS_LOCAL_WRITE"])    # atomic results
        self.qp, self.max_inline = self._create_qp()
        self.psn = int.from_bytes(os.urandom(3), "little")

    def _create_qp(self) -> tuple[Any, int]:
        pv, e = self.pv, self.e
        last: BaseException | None = None
        for inline in _INLINE_PROBE:
            cap = pv.qp.QPCap(max_send_wr=SQ_DEPTH, max_recv_wr=RQ_DEPTH, max_send_sge=1,
                              max_recv_sge=1, max_inline_data=inline)
            init = pv.qp.QPInitAttr(qp_type=e["IBV_QPT_RC"], scq=self.cq, rcq=self.cq, cap=cap,
                                    sq_sig_all=0)
            try:
                return pv.qp.QP(self.pd, init), inline
            except pv.Error as exc:
                last = exc
        raise RuntimeError(f"ibv_create_qp failed: {last}")

    def info(self) -> dict[str, Any]:
        return {"qpn": self.qp.qp_num, "psn": self.psn, "gid": self.gid, "lid": self.port.lid,
                "mtu": int(self.port.active_mtu), "addr": self.mr.buf, "rkey": self.mr.rkey}

    def connect(self, peer: dict[str, Any]) -> None:
        pv, e = self.pv, self.e
        qp = self.qp
        a = pv.qp.QPAttr(qp_state=e["IBV_QPS_INIT"])
        a.pkey_index = 0
        a.port_num = PORT
        a.qp_access_flags = (e["IBV_ACCESS_LOCAL_WRITE"] | e["IBV_ACCESS_REMOTE_WRITE"]
                             | e["IBV_ACCESS_REMOTE_READ"] | e["IBV_ACCESS_REMOTE_ATOMIC"])
        qp.modify(a, e["IBV_QP_STATE"] | e["IBV_QP_PKEY_INDEX"] | e["IBV_QP_PORT"]
                  | e["IBV_QP_ACCESS_FLAGS"])
        dattr = self.ctx.query_device()
        a = pv.qp.QPAttr(qp_state=e["IBV_QPS_RTR"])
        a.path_mtu = min(int(self.port.active_mtu), int(peer["mtu"]))
        a.dest_qp_num = peer["qpn"]
        a.rq_psn = peer["psn"]
        a.max_dest_rd_atomic = max(1, min(16, int(dattr.max_qp_rd_atom)))
        a.min_rnr_timer = 1
        if self.roce:
            gr = pv.addr.GlobalRoute(dgid=pv.addr.GID(peer["gid"]), sgid_index=self.gid_index,
                                     hop_limit=64)
            a.ah_attr = pv.addr.AHAttr(dlid=0, sl=0, is_global=1, port_num=PORT, gr=gr)
        else:
            a.ah_attr = pv.addr.AHAttr(dlid=peer["lid"], sl=0, is_global=0, port_num=PORT)
        qp.modify(a, e["IBV_QP_STATE"] | e["IBV_QP_AV"] | e["IBV_QP_PATH_MTU"]
                  | e["IBV_QP_DEST_QPN"] | e["IBV_QP_RQ_PSN"] | e["IBV_QP_MAX_DEST_RD_ATOMIC"]
                  | e["IBV_QP_MIN_RNR_TIMER"])
        a = pv.qp.QPAttr(qp_state=e["IBV_QPS_RTS"])
        a.timeout = 14
        a.retry_cnt = 7
        a.rnr_retry = 7
        a.sq_psn = self.psn
        a.max_rd_atomic = max(1, min(16, int(dattr.max_qp_init_rd_atom)))
        qp.modify(a, e["IBV_QP_STATE"] | e["IBV_QP_TIMEOUT"] | e["IBV_QP_RETRY_CNT"]
                  | e["IBV_QP_RNR_RETRY"] | e["IBV_QP_SQ_PSN"] | e["IBV_QP_MAX_QP_RD_ATOMIC"])

    # --- work requests, built once and re-posted --------------------------------------
    def recv_wr(self, wr_id: int) -> Any:
        wr = self.pv.wr
        return wr.RecvWR(wr_id=wr_id, num_sge=1, sg=[wr.SGE(self.mr.buf, self.size, self.mr.lkey)])

    def send_wr(self, wr_id: int, size: int, signaled: bool = True) -> Any:
        wr, e = self.pv.wr, self.e
        flags = e["IBV_SEND_SIGNALED"] if signaled else 0
        if 0 < size <= self.max_inline:
            flags |= e["IBV_SEND_INLINE"]
        return wr.SendWR(wr_id=wr_id, opcode=e["IBV_WR_SEND"], num_sge=1,
                         sg=[wr.SGE(self.smr.buf, size, self.smr.lkey)], send_flags=flags)

    def rdma_wr(self, wr_id: int, test: str, size: int, peer: dict[str, Any]) -> Any:
        wr, e = self.pv.wr, self.e
        sig = e["IBV_SEND_SIGNALED"]
        if test.startswith("atomic"):
            w = wr.SendWR(wr_id=wr_id, opcode=e["IBV_WR_ATOMIC_FETCH_AND_ADD"], num_sge=1,
                          sg=[wr.SGE(self.amr.buf, 8, self.amr.lkey)], send_flags=sig)
            w.set_wr_atomic(peer["rkey"], peer["addr"], 1, 0)
            return w
        op = e["IBV_WR_RDMA_READ"] if test.startswith("read") else e["IBV_WR_RDMA_WRITE"]
        if op == e["IBV_WR_RDMA_WRITE"] and 0 < size <= self.max_inline:
            sig |= e["IBV_SEND_INLINE"]
        w = wr.SendWR(wr_id=wr_id, opcode=op, num_sge=1,
                      sg=[wr.SGE(self.smr.buf, size, self.smr.lkey)], send_flags=sig)
        w.set_wr_rdma(peer["rkey"], peer["addr"])
        return w

    def close(self) -> None:
        for obj in (self.qp, self.mr, self.smr, self.amr, self.cq, self.pd, self.ctx):
            try:
                obj.close()
            except Exception:
                pass


def _first_active(pv: Any) -> str:
    import aiordma

    for d in aiordma.list_devices():
        if d.provider == "verbs" and d.active:
            return str(d.name)
    raise RuntimeError("no RDMA device with an ACTIVE port")
