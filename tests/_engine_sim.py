"""A sans-IO harness for the message engine: buffer pools in plain memory, waiters
without a loop, and a port that records what the engine posts -- or, with ``Wire``,
delivers it to a second engine, like two devices connected back to back."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

from aiordma.protocol.engine import EnginePort, MessageEngine, Slots
from aiordma.verbs.enums import WCOpcode, WCStatus, WROpcode
from aiordma.verbs.wr import SGE, WC, SendWR

EAGER = 256


def make_pool(slot_size: int, count: int, base: int) -> Slots:
    """The engine's ``Slots`` over a bytearray (addresses are offsets + ``base``)."""
    return Slots(memoryview(bytearray(slot_size * count)), base, 7, slot_size, count)


class Waiter:
    """A future without a loop."""

    def __init__(self) -> None:
        self.result: Any = None
        self.exc: BaseException | None = None
        self.resolved = False
        self.callbacks: list[Callable[[bool], None]] = []

    def done(self) -> bool:
        return self.resolved

    def set_result(self, result: Any) -> None:
        assert not self.resolved, "resolved twice"
        self.resolved, self.result = True, result
        for cb in self.callbacks:
            cb(True)

    def set_exception(self, exc: BaseException) -> None:
        assert not self.resolved, "resolved twice"
        self.resolved, self.exc = True, exc
        for cb in self.callbacks:
            cb(False)


class Port(EnginePort):
    """The engine's port: records posts; ``later`` runs at ``turn()``."""

    def __init__(self) -> None:
        self.engine: MessageEngine
        self.ids = 0
        self.sends: list[list[SendWR]] = []
        self.recvs: list[int] = []  # posted receive slots, in order
        self.deferred: list[Callable[[], None]] = []
        self.failed: list[BaseException] = []
        self.errors_qp = 0
        self.markers: list[int] = []
        self.fail_next_post: BaseException | None = None
        self.staged: list[Any] = []
        self.destroyed = False

    # posting
    def new_send_id(self) -> int:
        self.ids += 1
        return self.ids

    def drop_send_id(self, wr_id: int) -> None:
        pass

    def post_send(self, wrs: list[SendWR]) -> None:
        if self.fail_next_post is not None:
            exc, self.fail_next_post = self.fail_next_post, None
            raise exc
        self.sends.append([_copy(w) for w in wrs])

    def post_marker(self, wr_id: int) -> None:
        self.markers.append(wr_id)

    def post_recv(self, slots: list[int]) -> None:
        self.recvs.extend(slots)

    def posted(self) -> None:
        pass

    def expedite(self) -> None:
        pass

    # the loop
    def later(self, fn: Callable[[], None]) -> None:
        self.deferred.append(fn)

    def turn(self) -> None:
        """End of a loop iteration: run what was deferred."""
        while self.deferred:
            self.deferred.pop(0)()

    def new_waiter(self, *, quiet: bool = False) -> Waiter:
        return Waiter()

    def when_done(self, waiter: Waiter, fn: Callable[[bool], None]) -> None:
        waiter.callbacks.append(fn)

    # memory
    def set_atomic_target(self, wr: SendWR, addr: int, lkey: int) -> None:
        wr.sg_list = [SGE(addr, 8, lkey)]

    def rndv_source(self, src: Any) -> tuple[int, int, int]:
        return src  # tests pass (addr, rkey, length)

    def release_source(self, src: Any) -> None:
        pass

    def lease_staging(self, n: int) -> Any:
        st = _Staging(n)
        self.staged.append(st)
        return st

    def staging_span(self, staging: Any, n: int) -> Any:
        return (0x9000, n, 9)

    def read_wrs(self, span: Any, length: int, addr: int, rkey: int) -> list[SendWR]:
        return [SendWR(0, WROpcode.RDMA_READ, [SGE(span[0], length, span[2])],
                       remote_addr=addr, rkey=rkey)]

    # lifecycle
    def qp_to_error(self) -> None:
        self.errors_qp += 1

    def on_failed(self, exc: BaseException, unexpected: bool) -> None:
        self.failed.append(exc)

    def check_drained(self) -> None:
        pass

    def maybe_closed(self) -> None:
        pass


class _Staging:
    def __init__(self, n: int) -> None:
        self.view = memoryview(bytearray(n))
        self.released = False

    def release(self) -> None:
        assert not self.released
        self.released = True


def _copy(w: SendWR) -> SendWR:
    c = SendWR(w.wr_id, w.opcode, [SGE(s.addr, s.length, s.lkey) for s in w.sg_list],
               w.send_flags, imm_data=w.imm_data, remote_addr=w.remote_addr, rkey=w.rkey,
               compare_add=w.compare_add, swap=w.swap)
    return c


def make_engine(port: Port, *, recv_depth: int = 16, send_depth: int = 16, eager: int = EAGER,
                base: int = 0x10000, **kw: Any) -> tuple[MessageEngine, Slots, Slots]:
    spool = make_pool(eager, send_depth, base)
    rpool = make_pool(eager, recv_depth, base + 0x100000)
    frame_wrs = [SendWR(0, WROpcode.SEND, [SGE(spool.addr(i), 0, spool.lkey)], 0)
                 for i in range(send_depth)]
    opts: dict[str, Any] = dict(eager=eager, max_message_size=1 << 20, inline_cap=0,
                                send_depth=send_depth, signal_interval=16, signal_bytes=1 << 16,
                                repost_batch=4, rndv_prefetch=1 << 20, busy_ahead=1 << 18)
    opts.update(kw)
    e = MessageEngine(port, spool=spool, rpool=rpool, frame_wrs=frame_wrs, **opts)
    port.engine = e
    slots = [rpool.acquire() for _ in range(recv_depth)]
    e.rx.post([s for s in slots if s is not None])
    return e, spool, rpool


class Wire:
    """Two engines back to back: a SEND posted by one lands in the other's oldest
    posted receive buffer; ``step()`` delivers everything posted, then completes the
    senders' signaled WRs, then runs both ports' deferred calls."""

    def __init__(self, a: tuple[MessageEngine, Slots, Slots, Port],
                 b: tuple[MessageEngine, Slots, Slots, Port]) -> None:
        self.sides = (a, b)
        self.recv_q: list[deque[int]] = [deque(), deque()]

    def step(self) -> int:
        moved = 0
        for i, (e, spool, _rpool, port) in enumerate(self.sides):
            pe, _ps, prpool, pport = self.sides[1 - i]
            q = self.recv_q[1 - i]
            q.extend(pport.recvs)
            pport.recvs.clear()
            sends, port.sends = port.sends, []
            for chain in sends:
                for wr in chain:
                    moved += 1
                    if wr.opcode == WROpcode.SEND:
                        slot = q.popleft()  # credits guarantee one is posted
                        n = wr.sg_list[0].length
                        off = wr.sg_list[0].addr - spool.base
                        prpool.slot(slot)[:n] = spool.view[off: off + n]
                        pe.on_recv_completion(WC(slot, WCStatus.SUCCESS, WCOpcode.RECV, n),
                                              slot)
                    if wr.send_flags & 2:
                        e.on_send_completion(WC(wr.wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
        for _e, _s, _r, port in self.sides:
            port.turn()
        return moved

    def run(self, limit: int = 1000) -> None:
        for _ in range(limit):
            if not self.step():
                return
        raise AssertionError("the wire did not settle")
