"""An endpoint's verbs resources, and the part of the message engine's port that uses
them: posting work requests, receive buffers, staging, rendezvous sources.

Resources of one endpoint: its own protection domain (keys handed to this peer are
useless on any other QP), one RC QP, a CQ reservation on the device's reactor, a
registered pool of receive buffers posted for the peer (its credits), a pool of eager
send buffers, and staging caches for rendezvous. Nothing is registered per message:
each buffer slot has one work request, re-used for every post of that slot (a provider
copies what it needs at post time).

Destruction (``destroy``) follows the order that cannot hang: the QP first, then the
regions, pools and staging caches (their MRs), the CQ reservation, the PD, the device
reference.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, cast

from .cq_reactor import CQReactor
from .device import Device
from .errors import RDMAError
from .memory import LocalSpan, RegionTable, SlotPool, Staging, StagingCache
from .native import mypyc_attr
from .options import EndpointOptions
from .protocol.engine import EnginePort, MessageEngine, Waiter
from .verbs import (
    MTU,
    SGE,
    WC,
    Access,
    AHAttr,
    QPAttr,
    QPCap,
    QPState,
    RecvWR,
    SendWR,
    WROpcode,
)

if TYPE_CHECKING:
    from .lifecycle import Lifecycle

log = logging.getLogger("aiordma")

_SEND: Final = WROpcode.SEND
_SIGNALED: Final = 2  # SendFlags.SIGNALED
_ALL_RIGHTS: Final = (Access.LOCAL_WRITE | Access.REMOTE_READ | Access.REMOTE_WRITE
                      | Access.REMOTE_ATOMIC)


def _report_done(fn: Callable[[bool], None], fut: asyncio.Future[Any]) -> None:
    """``fn(succeeded)`` for the done ``fut`` (a module function: mypyc compiles no
    closure in a method of a class that is not native)."""
    fn(not fut.cancelled() and fut.exception() is None)


def _consume_exception(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


@mypyc_attr(native_class=False)  # (its base is the compiled engine's: not a mypyc class)
class Resources(EnginePort):
    """The verbs objects of one endpoint (module doc); ``bind`` before posting.

    Raises what the device raises while the resources are made (RDMAError,
    ResourceLimitError, ...), after destroying what was made and releasing ``device``.
    """

    # released by destroy (deleted: held no more; also tells what was made at all)
    __deletable__ = ("qp", "staging_out", "staging_in", "spool", "rpool", "pd")

    def __init__(self, device: Device, opts: EndpointOptions, loop: asyncio.AbstractEventLoop,
                 auth_key: bytes | None) -> None:
        self.device = device
        self.loop = loop
        #: the completion handlers of our send and receive work requests (``bind``)
        self._on_send: Callable[[WC, Any], None]
        self._on_recv: Callable[[WC, int], None]
        self.destroyed = False  # (the engine port's flag)
        self.staging_registered = 0  # registrations by staging caches already closed
        self.hooks: Lifecycle  # the endpoint's lifecycle (set once it is made)
        ctx = device.ctx
        try:
            self.reactor: CQReactor = device.reactor(loop, mode=opts.poll_mode,
                                                     spin_us=opts.spin_us)
            dattr = ctx.query_device()
            self.port = ctx.query_port(1)
            self.pd = ctx.alloc_pd()
        except BaseException:
            device.release()  # the caller's reference: nothing else was made yet
            raise
        device.holders.add(self)  # destroyed at exit if still alive
        # One work request moves at most the port's max_msg_sz (rxe on 6.1: 8 MiB):
        # longer READs/WRITEs are posted as several, in order (see wr_chunks).
        self.max_wr = min(opts.max_wr_size or self.port.max_msg_sz, self.port.max_msg_sz)
        self.inline_cap = min(opts.inline_threshold, dattr.max_inline_data)
        self.recv_depth = min(opts.recv_depth, dattr.max_qp_wr)
        self.send_depth = min(opts.send_depth, dattr.max_qp_wr)
        self.regions = RegionTable()
        try:
            entries = self.send_depth + self.recv_depth
            self.cq = self.reactor.acquire_cq(entries)
            self._cq_entries = entries
            self.rpool = SlotPool(self.pd, opts.eager_size, self.recv_depth)
            self.spool = SlotPool(self.pd, opts.eager_size, self.send_depth)
            self.staging_out = StagingCache(self.pd, Access.LOCAL_WRITE | Access.REMOTE_READ)
            # READ targets: shared memory where the provider fills it by a plain copy
            self.staging_in = StagingCache(self.pd, Access.LOCAL_WRITE,
                                           shared=self.pd.context.maps_shared_memory)
            self.qp = self.pd.create_qp(self.cq, self.cq, QPCap(
                max_send_wr=self.send_depth, max_recv_wr=self.recv_depth,
                max_send_sge=1, max_recv_sge=1, max_inline_data=self.inline_cap))
            self.qp.modify(QPAttr(QPState.INIT, port_num=1, qp_access_flags=_ALL_RIGHTS,
                                  auth_key=auth_key))
        except BaseException:
            self.destroy()
            raise
        rp, sp = self.rpool, self.spool
        self.recv_wrs = [RecvWR(0, [SGE(rp.addr(i), rp.slot_size, rp.lkey)])
                         for i in range(rp.count)]
        self.frame_wrs = [SendWR(0, _SEND, [SGE(sp.addr(i), 0, sp.lkey)], 0)
                          for i in range(sp.count)]

    def bind(self, on_send: Callable[[WC, Any], None], on_recv: Callable[[WC, int], None],
             hooks: Lifecycle) -> None:
        """The handlers the reactor calls for our work requests' completions, and the
        endpoint's lifecycle (the engine's lifecycle hooks go there)."""
        self._on_send = on_send
        self._on_recv = on_recv
        self.hooks = hooks

    def attach(self, engine: MessageEngine) -> None:
        """Where the QP has C-level posts (``QP.c_ops``), ``engine`` posts through them,
        with wr_ids of its own, and the reactor hands it their completions."""
        engine.poke_posts = self.reactor.pokes_after_post
        ops = self.qp.c_ops()
        if ops is not None:
            engine.use_qp(ops[1], ops[0])
            self.reactor.attach_engine(self.qp.qp_num, engine)

    # ---------------------------------------------------------------- connecting
    def connect(self, gid: bytes, lid: int, qp_num: int, psn: int, mtu: int, gid_index: int,
                our_psn: int, *, timeout: int, retry_cnt: int) -> None:
        """Move the QP to RTS towards the peer (``timeout``/``retry_cnt``: the local ACK
        timeout and retries, their verbs meaning). Raises RDMAError."""
        path_mtu = MTU(min(mtu, int(self.port.active_mtu)))
        self.qp.modify(QPAttr(QPState.RTR, path_mtu=path_mtu, dest_qp_num=qp_num,
                              rq_psn=psn, max_dest_rd_atomic=16, min_rnr_timer=12,
                              ah_attr=AHAttr(dgid=gid, dlid=lid, sgid_index=gid_index,
                                             port_num=1)))
        self.qp.modify(QPAttr(QPState.RTS, sq_psn=our_psn, timeout=timeout,
                              retry_cnt=retry_cnt, rnr_retry=7, max_rd_atomic=16))

    # ---------------------------------------------------------------- engine port: posting
    def new_send_id(self) -> int:
        return self.reactor.register(self._on_send, None)

    def drop_send_id(self, wr_id: int) -> None:
        self.reactor.unregister(wr_id)

    def post_send(self, wrs: list[SendWR]) -> None:
        self.qp.post_send(wrs)

    def post_marker(self, wr_id: int) -> None:
        self.qp.post_send([SendWR(wr_id, _SEND, [], _SIGNALED)])

    def post_recv(self, slots: list[int]) -> None:
        register = self.reactor.register
        on_wc = self._on_recv
        wrs = [self.recv_wrs[slot] for slot in slots]
        for wr, slot in zip(wrs, slots, strict=True):
            wr.wr_id = register(on_wc, slot)
        try:
            self.qp.post_recv(wrs)
        except RDMAError:
            for wr, slot in zip(wrs, slots, strict=True):
                self.reactor.unregister(wr.wr_id)
                self.rpool.release(slot)
            raise

    def posted(self) -> None:
        self.reactor.poke()

    def expedite(self) -> None:
        self.reactor.expedite()

    def set_atomic_target(self, wr: SendWR, addr: int, lkey: int) -> None:
        wr.sg_list = [SGE(addr, 8, lkey)]

    def qp_to_error(self) -> None:
        try:
            self.qp.modify(QPAttr(QPState.ERR))
        except RDMAError:
            pass

    # ---------------------------------------------------------------- engine port: the loop
    def later(self, fn: Callable[[], None]) -> None:
        self.loop.call_soon(fn)

    def new_waiter(self, *, quiet: bool = False) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = self.loop.create_future()
        if quiet:
            # A failure is re-raised to the receiver that awaits it; when none does (it
            # was cancelled, or the READ was a prefetch), do not log it as never retrieved.
            fut.add_done_callback(_consume_exception)
        return fut

    def when_done(self, waiter: Waiter, fn: Callable[[bool], None]) -> None:
        fut = cast("asyncio.Future[Any]", waiter)  # (a waiter of new_waiter)
        fut.add_done_callback(functools.partial(_report_done, fn))

    def on_failed(self, exc: BaseException, unexpected: bool) -> None:
        self.hooks.on_failed(exc, unexpected)

    def check_drained(self) -> None:
        self.hooks.check_drained()

    def maybe_closed(self) -> None:
        self.hooks.maybe_closed()

    # ---------------------------------------------------------------- engine port: memory
    def rndv_source(self, src: Any) -> tuple[int, int, int]:
        if isinstance(src, Staging):
            return src.mr.addr, src.mr.rkey, src.length
        region = src.keep[1]
        return src.addr, region.rkey, src.length

    def release_source(self, src: Any) -> None:
        if isinstance(src, Staging):
            src.release()

    def lease_staging(self, n: int) -> Staging:
        return self.staging_in.lease(n)

    def staging_span(self, staging: Staging, n: int) -> LocalSpan:
        return LocalSpan(staging.mr.addr, n, staging.mr.lkey, staging)

    def read_wrs(self, span: LocalSpan, length: int, addr: int, rkey: int) -> list[SendWR]:
        return self.wr_chunks(WROpcode.RDMA_READ, span, length, addr, rkey)

    def wr_chunks(self, opcode: WROpcode, span: LocalSpan, length: int, remote_addr: int,
                  rkey: int) -> list[SendWR]:
        """The work requests that move ``length`` bytes between ``span`` and the remote
        address: one, or one per ``max_wr`` (the port's max_msg_sz) piece."""
        step = self.max_wr
        if length <= step:
            return [SendWR(0, opcode, [SGE(span.addr, length, span.lkey)],
                           remote_addr=remote_addr, rkey=rkey)]
        return [SendWR(0, opcode, [SGE(span.addr + off, min(step, length - off), span.lkey)],
                       remote_addr=remote_addr + off, rkey=rkey)
                for off in range(0, length, step)]

    # ---------------------------------------------------------------- destruction
    def staging_registrations(self) -> int:
        live = [getattr(self, name, None) for name in ("staging_in", "staging_out")]
        return self.staging_registered + sum(st.registrations for st in live if st is not None)

    def destroy(self) -> None:
        """Destroy every resource made (idempotent), then release the device."""
        if self.destroyed:
            return
        self.destroyed = True
        self.device.holders.discard(self)
        if hasattr(self, "qp"):
            self.device.unwatch_qp(self.qp.qp_num)
            self.reactor.detach_engine(self.qp.qp_num)
        if hasattr(self, "regions"):
            for region in self.regions.regions():
                region.close()
        for name in ("qp", "staging_out", "staging_in", "spool", "rpool"):
            obj = getattr(self, name, None)
            if obj is None:
                continue
            delattr(self, name)
            if isinstance(obj, StagingCache):
                self.staging_registered += obj.registrations  # (statistics)
            try:
                obj.close()
            except RDMAError as exc:
                log.warning("aiordma: closing %s failed: %s", name, exc)
        if hasattr(self, "cq"):
            self.reactor.release_cq(self.cq, self._cq_entries)
        pd = getattr(self, "pd", None)
        if pd is not None:
            delattr(self, "pd")
            try:
                pd.close()
            except RDMAError as exc:
                log.warning("aiordma: dealloc PD failed: %s", exc)
        self.device.release()
