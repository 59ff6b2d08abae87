"""Work requests posted as pyverbs objects: ``IbvQP``'s data path where the compiled one
(``fastpath``) is not built or not used (``AIORDMA_VERBS_POST=pyverbs``).

The callers (``IbvQP.post_send``/``post_recv``) have checked the WRs (contract.py) and
the queue room; these methods only build and post. A single WR with one SGE -- every
frame of an endpoint -- and one-SGE receives go through pyverbs WRs cached per SGE
(building one costs two pyverbs objects, each a logger look-up and a malloc, and their
``close``); anything else is built as a chain of new objects, freed after the post.
pyverbs errors become ``PostError``, out-of-range fields ``InvalidWorkRequest``.
"""

from __future__ import annotations

from typing import Any

from ...errors import PostError
from ..contract import ATOMIC_OPS, InvalidWorkRequest
from ..enums import WROpcode
from ..wr import RecvWR, SendWR
from . import compat

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF
_IMM_OPS = frozenset({WROpcode.SEND_WITH_IMM, WROpcode.RDMA_WRITE_WITH_IMM})
_RDMA_OPS = frozenset({WROpcode.RDMA_WRITE, WROpcode.RDMA_WRITE_WITH_IMM, WROpcode.RDMA_READ})
# what a post sets besides wr_id, opcode, flags and SGEs, per opcode: one look-up
_K_IMM, _K_RDMA, _K_ATOMIC = 1, 2, 4
_OP_KIND = {op: ((_K_IMM if op in _IMM_OPS else 0) | (_K_RDMA if op in _RDMA_OPS else 0)
                 | (_K_ATOMIC if op in ATOMIC_OPS else 0)) for op in WROpcode}
# pyverbs work requests of single-WR, single-SGE posts kept per QP for reuse
_WR_CACHE = 64

Key = tuple[int, int, int]  # an SGE: (addr, length, lkey)


def _set_op_fields(p: Any, wr: SendWR, kind: int) -> None:
    """Set on the pyverbs SendWR ``p`` the fields that ``wr``'s opcode reads besides
    wr_id, opcode, flags and SGEs (``kind`` = ``_OP_KIND[opcode]``): immediate data,
    the RDMA or the atomic part. Single posts and chains both build WRs through it."""
    if kind & _K_IMM:
        p.imm_data = compat.imm_to_wire(wr.imm_data)
    if kind & _K_RDMA:
        p.set_wr_rdma(wr.rkey & _M32, wr.remote_addr & _M64)
    elif kind & _K_ATOMIC:
        p.set_wr_atomic(wr.rkey & _M32, wr.remote_addr & _M64,
                        wr.compare_add & _M64, wr.swap & _M64)


def _cache_put(cache: dict[Key, Any], key: Key, p: Any, limit: int) -> None:
    if len(cache) >= limit:
        cache.pop(next(iter(cache))).close()  # the oldest
    cache[key] = p


class PyverbsWRs:
    """The pyverbs work requests of one QP (``pv``: the ``Pyverbs`` modules;
    ``max_recv``: its receive queue depth, the receive cache's size); each post is
    given the pyverbs QP (``pqp``), which this object does not keep: the QP stays
    referenced by ``IbvQP`` alone, so that the order in which the cyclic GC destroys
    pyverbs objects at exit stays that of the verbs objects. Posting happens on one
    thread (the event loop's)."""

    def __init__(self, pv: Any, max_recv: int) -> None:
        self._pv = pv
        self._recv_limit = max(_WR_CACHE, max_recv)
        # (addr, length, lkey) -> pyverbs SendWR / RecvWR, see _new_send_wr
        self._send_wrs: dict[Key, Any] = {}
        self._recv_wrs: dict[Key, Any] = {}

    def post_send_one(self, pqp: Any, wr: SendWR, op: WROpcode) -> None:
        """Post one WR with one SGE through the cached pyverbs WR of its SGE (no chain
        to build or free; inlined, as this runs for every message)."""
        s = wr.sg_list[0]
        key = (s.addr, s.length, s.lkey)
        try:
            p = self._send_wrs.get(key)
            if p is None:
                p = self._new_send_wr(key)
            p.wr_id = wr.wr_id & _M64
            p.opcode = op
            p.send_flags = int(wr.send_flags)
            kind = _OP_KIND[op]
            if kind:  # (a plain SEND uses none of the other fields: no call)
                _set_op_fields(p, wr, kind)
            pqp.post_send(p)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None

    def post_send_chain(self, pqp: Any, wrs: list[SendWR], ops: list[WROpcode]) -> None:
        """Post ``wrs`` (``ops[i]``: the opcode of ``wrs[i]``) as one chain of new
        pyverbs WRs (an empty SGE list is posted as num_sge 0)."""
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr, op in zip(reversed(wrs), reversed(ops), strict=True):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                kw: dict[str, Any] = {
                    "wr_id": wr.wr_id & _M64, "opcode": int(op), "num_sge": len(sg), "sg": sg,
                    "send_flags": int(wr.send_flags),
                }
                if head is not None:
                    kw["next_wr"] = head
                p = pvwr.SendWR(**kw)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                kind = _OP_KIND[op]
                if kind:
                    _set_op_fields(p, wr, kind)
                head = p
            pqp.post_send(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_send: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:  # ibv_post_send copied them; free the C memory now
                obj.close()
            for s in sges:
                s.close()

    def _new_send_wr(self, key: Key) -> Any:
        """A new pyverbs SendWR for single-WR posts with the one SGE ``key``, cached for
        re-use: the device copies a WR when it is posted, so the object is free again as
        soon as ``post_send`` returns. The caller sets ``wr_id``, ``opcode``,
        ``send_flags`` and what its opcode uses (a cached WR keeps the values of its
        last post: a plain SEND reads none of the others). A cached WR is never chained
        (its ``next`` stays NULL)."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.SendWR(wr_id=0, opcode=int(WROpcode.SEND), num_sge=1, sg=[sge],
                            send_flags=0)
        finally:
            sge.close()  # SendWR copied it
        _cache_put(self._send_wrs, key, p, _WR_CACHE)
        return p

    def _new_recv_wr(self, key: Key) -> Any:
        """A new pyverbs RecvWR for the one-SGE receive ``key``, cached for re-use like
        ``_new_send_wr``'s (one per receive buffer: the cache holds as many as the
        receive queue); the caller sets its ``wr_id``."""
        pvwr = self._pv.wr
        sge = pvwr.SGE(*key)
        try:
            p = pvwr.RecvWR(wr_id=0, num_sge=1, sg=[sge])
        finally:
            sge.close()
        _cache_put(self._recv_wrs, key, p, self._recv_limit)
        return p

    def post_recv_cached(self, pqp: Any, wrs: list[RecvWR], posted: list[int]) -> None:
        """Post one-SGE receives through their cached pyverbs WRs, one ibv_post_recv
        each (cheaper than building a chain of new objects), appending each posted
        wr_id to ``posted``. Like a chained post that fails at ``bad_wr``, the WRs
        before a failing one stay posted."""
        post = pqp.post_recv
        cache = self._recv_wrs
        try:
            for wr in wrs:
                s = wr.sg_list[0]
                key = (s.addr, s.length, s.lkey)
                p = cache.get(key)
                if p is None:
                    p = self._new_recv_wr(key)
                wr_id = wr.wr_id & _M64
                p.wr_id = wr_id
                post(p)
                posted.append(wr_id)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None

    def post_recv_chain(self, pqp: Any, wrs: list[RecvWR]) -> None:
        """Post receives with any number of SGEs as one chain of new pyverbs WRs (freed
        after the post; an empty SGE list is posted as num_sge 0)."""
        pvwr = self._pv.wr
        sges: list[Any] = []
        built: list[Any] = []
        head: Any = None
        try:
            for wr in reversed(wrs):
                sg = [pvwr.SGE(s.addr, s.length, s.lkey) for s in wr.sg_list]
                if not sg:
                    sg = [pvwr.SGE(0, 0, 0)]
                sges.extend(sg)
                if head is None:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg)
                else:
                    p = pvwr.RecvWR(wr_id=wr.wr_id & _M64, num_sge=len(sg), sg=sg, next_wr=head)
                built.append(p)
                if not wr.sg_list:
                    p.num_sge = 0
                head = p
            pqp.post_recv(head)
        except self._pv.Error as exc:
            raise PostError(compat.errno_of(exc), f"ibv_post_recv: {exc}") from None
        except OverflowError as exc:
            raise InvalidWorkRequest(f"a work request field is out of range: {exc}") from None
        finally:
            for obj in built:
                obj.close()
            for s in sges:
                s.close()

    def close(self) -> None:
        """Free the cached WRs."""
        for cache in (self._send_wrs, self._recv_wrs):
            for p in cache.values():
                p.close()
            cache.clear()
