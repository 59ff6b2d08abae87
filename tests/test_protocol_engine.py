"""The message engine (aiordma.protocol.engine) without a loop or a provider: what it
posts, how completions finish operations, credits, BATCH frames, rendezvous reads,
EOF, protocol violations and the failure path; and two engines back to back."""

from __future__ import annotations

import random

import pytest
from _engine_sim import EAGER, Port, Waiter, Wire, make_engine

from aiordma.errors import ConnectionClosed, RemoteAccessError
from aiordma.protocol.engine import (
    COPY_AT_SEND,
    DATA,
    RNDV,
    RX_DATA,
    RX_EOF,
    RX_RNDV,
    FrameType,
    Op,
    batch_records,
    check_messages,
    parse_frame,
    write_batch,
    write_close,
    write_data_header,
)
from aiordma.protocol.errors import RemoteProtocolError
from aiordma.protocol.state import Local, Remote, State
from aiordma.verbs.enums import WCOpcode, WCStatus, WROpcode
from aiordma.verbs.wr import WC


def connected(depth: int = 16, **kw: object) -> tuple[object, ...]:
    """An engine whose peer posted ``depth`` receive buffers, as it does."""
    port = Port()
    e, spool, rpool = make_engine(port, recv_depth=depth, send_depth=depth, **kw)  # type: ignore[arg-type]
    e.connect(peer_credits=depth, local_slots=depth, peer_eager=kw.get("eager", EAGER),
              peer_max_message=1 << 20, batching=True)
    return e, spool, rpool, port


def frame_of(spool, wr) -> object:  # type: ignore[no-untyped-def]
    off = wr.sg_list[0].addr - spool.base
    return parse_frame(spool.view[off: off + wr.sg_list[0].length], wr.sg_list[0].length, 1 << 20)


def send(e, data: bytes) -> Waiter:  # type: ignore[no-untyped-def]
    w = Waiter()
    e.tx.sendq.append(Op(DATA, w, memoryview(data)))
    e.tx.kick()
    return w


def recv_frame(e, rpool, port, slot: int, build) -> None:  # type: ignore[no-untyped-def]
    n = build(rpool.slot(slot))
    e.on_recv_completion(WC(slot, WCStatus.SUCCESS, WCOpcode.RECV, n), slot)


def test_a_send_posts_one_data_frame_and_completes() -> None:
    e, spool, _rpool, port = connected()
    w = send(e, b"hello")
    (chain,) = port.sends
    (wr,) = chain
    f = frame_of(spool, wr)
    assert f.type == FrameType.DATA and f.payload_len == 5 and wr.send_flags & 2
    assert not w.done() and spool.available == spool.count - 1
    e.on_send_completion(WC(wr.wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
    assert w.done() and w.exc is None and spool.available == spool.count


def test_sends_of_one_iteration_share_a_batch_frame() -> None:
    e, spool, _rpool, port = connected()
    first = send(e, b"a")  # the fast path: posted at once
    rest = [send(e, b"%d" % i) for i in range(5)]  # queued to the end of the iteration
    assert len(port.sends) == 1
    port.turn()
    assert len(port.sends) == 2 and len(port.sends[1]) == 1
    f = frame_of(spool, port.sends[1][0])
    assert f.type == FrameType.BATCH and f.aux == 5
    assert e.tx.messages_batched == 5
    for chain in port.sends:
        e.on_send_completion(WC(chain[-1].wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
    assert first.done() and all(w.done() and w.exc is None for w in rest)


def _batch_payloads(spool, wr) -> list[bytes]:  # type: ignore[no-untyped-def]
    off = wr.sg_list[0].addr - spool.base
    n = wr.sg_list[0].length
    frame = bytes(spool.view[off: off + n])
    f = parse_frame(frame, n, 1 << 20)
    assert f.type == FrameType.BATCH
    return [frame[o: o + ln] for o, ln in batch_records(frame, n, f.aux, 1 << 20)]


def test_a_batch_frame_carries_every_payload_whole_in_order() -> None:
    e, spool, _rpool, port = connected()
    msgs = [b"first", b"", bytearray(b"x" * 40), memoryview(b"0123456789")[2:7], b"z" * 30]
    waiters = []
    for m in msgs:
        w = Waiter()
        assert e.send_eager(w, m) is not None
        waiters.append(w)
    port.turn()
    assert _batch_payloads(spool, port.sends[1][0]) == [bytes(m) for m in msgs[1:]]
    assert e.tx.messages_batched == 4


def test_a_batch_takes_what_fits_one_frame_and_the_rest_follows() -> None:
    e, spool, _rpool, port = connected()
    big = EAGER - 8 - 2 * 4 - 20  # header, two records: room for a 20-byte payload more
    waiters = [Waiter() for _ in range(4)]
    assert e.send_eager(waiters[0], b"a") is not None  # posted at once
    for w, m in zip(waiters[1:], (b"b" * big, b"c" * 20, b"d" * 21), strict=True):
        assert e.send_eager(w, m) is not None
    port.turn()
    frames = [wr for chain in port.sends for wr in chain]
    assert _batch_payloads(spool, frames[1]) == [b"b" * big, b"c" * 20]
    f = frame_of(spool, frames[2])
    assert f.type == FrameType.DATA and f.payload_len == 21


def test_a_small_buffer_is_copied_when_queued_and_a_large_one_held_until_posted() -> None:
    e, spool, _rpool, port = connected(eager=4096)
    assert e.send_eager(Waiter(), b"first") is not None  # posted: the next ones queue
    small = bytearray(b"s" * COPY_AT_SEND)
    large = bytearray(b"L" * (COPY_AT_SEND + 1))
    assert e.send_eager(Waiter(), small) is not None
    assert e.send_eager(Waiter(), large) is not None
    small[:] = b"changed"  # copied already: the caller may reuse it at once
    with pytest.raises(BufferError):
        large.append(0)  # held through a view until copied into the frame
    port.turn()
    assert _batch_payloads(spool, port.sends[1][0]) == [b"s" * COPY_AT_SEND,
                                                       b"L" * (COPY_AT_SEND + 1)]
    large.append(0)  # copied: free again


def test_a_small_buffer_is_copied_into_its_op_and_framed_whole() -> None:
    """A payload (not bytes) of up to ``SMALL_PAYLOAD`` bytes is copied into its op when
    queued: the caller may change it at once; alone it goes as a DATA frame, behind
    others as a BATCH record, whole either way, and one byte more takes the other copy."""
    from aiordma.protocol.engine import SMALL_PAYLOAD

    e, spool, _rpool, port = connected(eager=4096)
    first = bytearray(b"f" * 10)
    assert e.send_eager(Waiter(), first) is not None  # posted at once: a DATA frame
    first[:] = b"gone"
    tiny = memoryview(bytearray(b"t" * SMALL_PAYLOAD))
    edge = bytearray(b"e" * (SMALL_PAYLOAD + 1))
    empty = bytearray()
    ops = [e.send_eager(Waiter(), m) for m in (tiny, empty, edge)]
    # held in the op, no object made for the copy; one byte more: a bytes copy
    assert [type(op.payload) for op in ops] == [type(None), type(None), bytes]
    tiny[:4] = b"XXXX"
    edge[:] = b""
    empty.extend(b"late")
    port.turn()
    frames = [wr for chain in port.sends for wr in chain]
    f = frame_of(spool, frames[0])
    off = frames[0].sg_list[0].addr - spool.base
    assert f.type == FrameType.DATA and f.payload_len == 10
    assert bytes(spool.view[off + f.payload_offset: off + f.payload_offset + 10]) == b"f" * 10
    assert _batch_payloads(spool, frames[1]) == [b"t" * SMALL_PAYLOAD, b"",
                                                 b"e" * (SMALL_PAYLOAD + 1)]


def test_send_eager_queues_only_flat_byte_buffers_of_the_three_types() -> None:
    e, _spool, _rpool, port = connected()
    import array
    for data in (bytearray(b"x" * (EAGER - 7)), "text", array.array("i", [1, 2]),
                 memoryview(b"abcdef")[::2], memoryview(bytearray(8)).cast("i")):
        assert e.send_eager(Waiter(), data) is None
    assert not port.sends and not e.tx.sendq
    released = memoryview(b"abc")
    released.release()
    with pytest.raises(ValueError):
        e.send_eager(Waiter(), released)


def test_sends_wait_for_credits_and_go_when_they_come_back() -> None:
    e, _spool, rpool, port = connected()
    waiters = []
    for i in range(20):
        waiters.append(send(e, b"%d" % i))
        port.turn()
    posted = sum(len(c) for c in port.sends)
    assert posted < 20 and e.tx.sendq  # out of credits: the rest waits (no RNR ever)
    # the peer re-posted 8 buffers and says so in a frame's header
    slot = port.recvs[0]
    recv_frame(e, rpool, port, slot, lambda buf: write_data_header(buf, 8, 0))
    assert sum(len(c) for c in port.sends) > posted


def test_received_data_is_queued_and_buffers_come_back_in_batches() -> None:
    e, _spool, rpool, port = connected()
    posted = list(port.recvs)
    for i, slot in enumerate(posted[:4]):
        recv_frame(e, rpool, port, slot,
                   lambda buf, i=i: write_data_header(buf, 0, 1) + _put(buf, 8, b"%d" % i))
    assert [m.kind for m in e.rx.rx] == [RX_DATA] * 4
    reposted = len(port.recvs)
    for _ in range(3):
        e.rx.consume_data(e.rx.rx[0])
    assert len(port.recvs) == reposted  # fewer than repost_batch (4) wait
    e.rx.consume_data(e.rx.rx[0])
    assert len(port.recvs) == reposted + 4 and e.credits.owed == 4  # type: ignore[union-attr]


def test_a_received_batch_queues_its_messages_in_order_and_reposts_its_buffer_once() -> None:
    """Each message of a BATCH frame is queued where it lies in the buffer; the buffer
    goes back with its last message's consumption, once (the re-posts go repost_batch
    = 4 buffers at a time, as for DATA frames)."""
    e, _spool, rpool, port = connected()
    batches = [[b"", b"a", b"bc" * 20, b"def"], [b"x"] * 3, [b"one"], [b"y" * 100, b"z"]]
    slots = list(port.recvs)[:4]
    for slot, msgs in zip(slots, batches, strict=True):
        recv_frame(e, rpool, port, slot, lambda buf, msgs=msgs: write_batch(buf, 0, msgs))
    rx = list(e.rx.rx)
    assert [m.kind for m in rx] == [RX_DATA] * 10
    assert [m.slot for m in rx] == [-1, -1, -1, slots[0], -1, -1, slots[1], slots[2], -1,
                                    slots[3]]
    assert [bytes(rpool.view[m.offset:m.offset + m.length]) for m in rx] == (
        [m for msgs in batches for m in msgs])
    reposted = len(port.recvs)
    for m in rx[:-1]:
        e.rx.consume_data(m)
    assert len(port.recvs) == reposted  # three buffers back: fewer than repost_batch
    e.rx.consume_data(rx[-1])
    assert sorted(port.recvs[reposted:]) == sorted(slots)
    assert e.rx.messages_received == 10 and not e.first_error


@pytest.mark.parametrize("damage", ["short", "long", "too large"])
def test_a_malformed_batch_fails_the_connection_and_queues_none_of_it(damage: str) -> None:
    """A BATCH whose records do not fill the frame exactly, or one of whose messages
    exceeds max_message_size, is a protocol violation: the connection fails and not one
    of its messages reaches the receive queue, not even those before the bad record."""
    e, _spool, rpool, port = connected()

    def build(buf: bytearray) -> int:
        n = write_batch(buf, 0, [b"ok", b"fine", b"z" * 64])
        if damage == "too large":  # the last record says 2 MiB (max_message_size 1 MiB)
            buf[n - 68:n - 64] = (2 << 20).to_bytes(4, "little")
        return n - 1 if damage == "short" else n + 1 if damage == "long" else n

    recv_frame(e, rpool, port, list(port.recvs)[0], build)
    assert isinstance(e.first_error, RemoteProtocolError) and e.state.failed
    assert len(e.rx.rx) == 0 and e.rx.messages_received == 0


def test_take_into_copies_the_head_message_or_takes_nothing() -> None:
    e, _spool, rpool, port = connected()
    for i, slot in enumerate(list(port.recvs)[:2]):
        recv_frame(e, rpool, port, slot,
                   lambda buf, i=i: write_data_header(buf, 0, 5) + _put(buf, 8, b"msg-%d" % i))
    out = bytearray(8)
    assert e.rx.take_into(bytearray(4)) == -1  # does not fit: the caller raises
    assert e.rx.take_into(b"readonly-buffer!") == -1  # not writable
    assert e.rx.take_into("not a buffer") == -1
    e.rx.receivers = 1  # a receive waits before us: it comes first
    assert e.rx.take_into(out) == -1
    e.rx.receivers = 0
    assert len(e.rx.rx) == 2 and out == bytearray(8)  # nothing taken so far
    assert e.rx.take_into(out) == 5 and out[:5] == b"msg-0"
    assert e.rx.take_into(memoryview(out)[3:]) == 5 and out == b"msgmsg-1"
    assert e.rx.take_into(out) == -1 and e.rx.messages_received == 2


def test_close_is_eof_and_data_after_it_is_a_protocol_violation() -> None:
    e, _spool, rpool, port = connected()
    slots = list(port.recvs)
    recv_frame(e, rpool, port, slots[0], lambda buf: write_close(buf, 0))
    assert e.rx.rx[-1].kind == RX_EOF and e.state.remote is Remote.CLOSED
    pending = send(e, b"we may still send")
    assert not pending.done() and e.state.can_send
    recv_frame(e, rpool, port, slots[1], lambda buf: write_data_header(buf, 0, 0))
    assert isinstance(e.first_error, RemoteProtocolError)
    assert e.state.failed and port.errors_qp == 1 and port.failed
    assert isinstance(pending.exc, ConnectionClosed)


def test_our_close_goes_once_and_nothing_after_it_when_final() -> None:
    e, spool, _rpool, port = connected()
    e.shut_wr()
    assert not e.state.can_send and e.state.local is Local.DRAINING
    eof = Waiter()
    assert e.queue_close(eof, final=True)
    assert e.state.local is Local.CLOSE_SENT and e.state.final
    f = frame_of(spool, port.sends[-1][-1])
    assert f.type == FrameType.CLOSE
    assert e.queue_close(Waiter(), final=True)  # once
    assert len(port.sends) == 1


def test_a_failed_completion_fails_everything_once() -> None:
    e, _spool, _rpool, port = connected()
    a = send(e, b"a")
    b = send(e, b"b")  # queued behind the fast path
    wr = port.sends[0][0]
    e.on_send_completion(WC(wr.wr_id, WCStatus.REM_ACCESS_ERR, WCOpcode.SEND))
    assert isinstance(a.exc, RemoteAccessError)  # the op's own typed error
    assert isinstance(b.exc, ConnectionClosed) and b.exc.__cause__ is a.exc
    assert e.state.state is State.FAILED and port.errors_qp == 1 and len(port.failed) == 1
    e.fail(ConnectionClosed("again"))  # runs once
    assert len(port.failed) == 1


def test_a_rendezvous_announcement_is_read_ahead_into_staging() -> None:
    e, _spool, rpool, port = connected()
    slot = port.recvs[0]
    from aiordma.protocol.engine import write_rndv

    recv_frame(e, rpool, port, slot, lambda buf: write_rndv(buf, 0, 42, 5000, 0xAB00, 0x77))
    (m,) = e.rx.rx
    assert m.kind == RX_RNDV and m.length == 5000 and m.read is not None
    (read,) = port.sends[-1]
    assert read.opcode == WROpcode.RDMA_READ and read.remote_addr == 0xAB00 and read.rkey == 0x77
    e.on_send_completion(WC(read.wr_id, WCStatus.SUCCESS, WCOpcode.RDMA_READ, 5000))
    assert m.read.done() and m.done_sent  # staged: the sender's source is released now
    done = frame_of(_spool_of(e), port.sends[-1][-1])
    assert done.type == FrameType.RNDV_DONE and done.aux == 42
    e.rx.consume_rndv(m)
    assert port.staged[0].released


def test_read_ahead_behind_a_receive_follows_where_its_own_read_went() -> None:
    """While a receive is in progress the messages behind it are read ahead within
    ``busy_ahead`` when its own READ went into staging, within ``direct_ahead`` when it
    went straight into its buffer (here 0: nothing is staged behind it)."""
    from aiordma.protocol.engine import write_rndv

    e, _spool, rpool, port = connected(busy_ahead=1 << 16, direct_ahead=0)
    e.rx.receivers = 1  # a receive is in progress (no READ of its own yet: direct assumed)
    for i, slot in enumerate(list(port.recvs)[:4]):
        recv_frame(e, rpool, port, slot,
                   lambda buf, i=i: write_rndv(buf, 0, i, 5000, 0xA000 + i, 0x77))
    first, second, third, fourth = e.rx.rx
    assert all(m.read is None for m in e.rx.rx)  # deferred for the receivers
    e.rx.read_for_receiver(first, (0x5000, 5000, 5))  # into the receiver's buffer
    assert first.read is not None and first.staging is None
    assert second.read is None and e.rx.rndv_staged == 0
    e.rx.read_for_receiver(second, None)  # a receive that needs staging (recv())
    assert second.staging is not None
    assert third.read is not None and fourth.read is not None  # read ahead behind it
    assert e.rx.rndv_staged == 3


def test_a_rendezvous_send_completes_on_rndv_done() -> None:
    e, spool, rpool, port = connected()
    w = Waiter()
    e.tx.sendq.append(Op(RNDV, w, payload=(0xC000, 0x55, 9000), msg_id=e.tx.next_msg_id()))
    e.tx.kick()
    f = frame_of(spool, port.sends[0][0])
    assert f.type == FrameType.RNDV and f.rndv_addr == 0xC000 and f.rndv_length == 9000
    e.on_send_completion(WC(port.sends[0][0].wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
    assert not w.done()  # the frame is out; the receiver has not read it yet
    from aiordma.protocol.engine import write_rndv_done

    recv_frame(e, rpool, port, port.recvs[0], lambda buf: write_rndv_done(buf, 0, f.aux, True))
    assert w.done() and w.exc is None and not e.tx.rndv_out


def test_post_failure_fails_the_connection() -> None:
    e, _spool, _rpool, port = connected()
    from aiordma.errors import PostError

    port.fail_next_post = PostError(22, "bad")
    w = send(e, b"x")
    assert isinstance(w.exc, PostError) and e.state.failed


def test_a_send_never_overtakes_one_already_queued() -> None:
    e, spool, _rpool, port = connected()
    first = Waiter()
    e.tx.sendq.append(Op(DATA, first, memoryview(b"first")))  # queued, not posted yet
    second = Waiter()
    assert e.send_eager(second, b"second") is not None
    (chain,) = port.sends  # one pump: both, in order (one BATCH frame)
    assert _batch_payloads(spool, chain[0]) == [b"first", b"second"]


def test_send_now_posts_first_then_makes_its_waiter() -> None:
    e, spool, _rpool, port = connected()
    posts_seen: list[int] = []

    def make() -> Waiter:
        posts_seen.append(len(port.sends))
        return Waiter()

    e.set_waiter_maker(None, make)
    op = e.send_now(b"hello")
    assert posts_seen == [1] and op is not None and isinstance(op.fut, Waiter)
    (wr,) = port.sends[0]
    assert frame_of(spool, wr).payload_len == 5 and not op.fut.done()
    e.on_send_completion(WC(wr.wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
    assert op.fut.done() and op.fut.exc is None


def test_send_now_queues_behind_the_iterations_first_post_with_its_waiter() -> None:
    e, _spool, _rpool, port = connected()
    e.set_waiter_maker(None, Waiter)
    first, second = e.send_now(b"a"), e.send_now(b"b")
    assert first is not None and second is not None and len(port.sends) == 1
    assert isinstance(second.fut, Waiter) and not second.posted
    port.turn()  # the end of the iteration posts it
    assert second.posted and len(port.sends) == 2
    e.on_send_completion(WC(port.sends[1][-1].wr_id, WCStatus.SUCCESS, WCOpcode.SEND))
    assert second.fut.done() and second.fut.exc is None


def test_send_now_hands_a_failed_post_to_its_waiter() -> None:
    e, _spool, _rpool, port = connected()
    from aiordma.errors import PostError

    e.set_waiter_maker(None, Waiter)
    port.fail_next_post = err = PostError(22, "bad")
    op = e.send_now(b"x")
    assert op is not None and op.fut.exc is err and e.state.failed
    assert e.send_now(b"y") is None  # failed: nothing more is taken


def test_send_now_takes_nothing_it_cannot_send_eagerly_and_needs_a_maker() -> None:
    e, _spool, _rpool, port = connected()
    with pytest.raises(TypeError):
        e.send_now(b"x")  # no maker yet: raised before anything is posted
    assert not port.sends
    with pytest.raises(TypeError):
        e.set_waiter_maker(None, None)
    e.set_waiter_maker(None, Waiter)
    assert e.send_now(b"z" * (EAGER + 1)) is None and e.send_now("text") is None
    assert not port.sends


@pytest.mark.parametrize("seed", range(8))
def test_two_engines_back_to_back(seed: int) -> None:
    """Random bursts of messages both ways through the credit window: every message
    arrives once, in order, whole; no receive buffer is ever missing (no RNR)."""
    rng = random.Random(seed)
    a = connected(8)
    b = connected(8, base=0x800000)
    wire = Wire(a, b)  # type: ignore[arg-type]
    sent: list[list[bytes]] = [[], []]
    got: list[list[bytes]] = [[], []]
    waiters: list[Waiter] = []
    for _round in range(40):
        for i in (0, 1):
            e = a[0] if i == 0 else b[0]
            for _ in range(rng.randrange(0, 6)):
                data = rng.randbytes(rng.randrange(0, EAGER - 8))
                sent[i].append(data)
                waiters.append(send(e, data))
        wire.run()
        for i, (e, _s, rpool, _p) in enumerate((a, b)):
            while e.rx.rx and rng.random() < 0.8:
                m = e.rx.rx[0]
                got[1 - i].append(bytes(rpool.view[m.offset: m.offset + m.length]))
                e.rx.consume_data(m)
            wire.run()
    for _ in range(200):  # drain everything
        for i, (e, _s, rpool, _p) in enumerate((a, b)):
            while e.rx.rx:
                m = e.rx.rx[0]
                got[1 - i].append(bytes(rpool.view[m.offset: m.offset + m.length]))
                e.rx.consume_data(m)
        if not wire.step() and not a[0].tx.sendq and not b[0].tx.sendq:
            break
    assert got == sent
    assert all(w.done() and w.exc is None for w in waiters)


def _put(buf, off: int, data: bytes) -> int:  # type: ignore[no-untyped-def]
    buf[off: off + len(data)] = data
    return len(data)


def _spool_of(e):  # type: ignore[no-untyped-def]
    return e.tx.spool


def test_a_registered_waiter_type_is_resolved_through_its_class_and_others_by_name() -> None:
    """``register_waiter_type``: a waiter of exactly the registered class is resolved
    through the class's own ``done``/``set_result`` (taken once); a waiter of another
    class -- a subclass too -- through its attributes, looked up by name."""
    from aiordma.protocol.engine import register_waiter_type, wake

    class Sub(Waiter):
        pass

    def shadowed(w: Waiter) -> Waiter:
        w.done = lambda: True  # type: ignore[method-assign]  # claims to be done already
        return w

    before = register_waiter_type(Waiter)
    try:
        exact, sub = shadowed(Waiter()), shadowed(Sub())
        wake([exact, sub])
        assert exact.resolved and exact.result is None  # the class's done(): not done
        assert not sub.resolved  # by name: its own done() says it is
        with pytest.raises(AttributeError):
            register_waiter_type(int)
        assert register_waiter_type(Waiter) is Waiter  # the failed one changed nothing
    finally:
        register_waiter_type(before)


def test_an_rdma_op_is_posted_as_its_work_request_and_completes() -> None:
    """``rdma_op``: one-sided work held as C fields goes out (on the port path) as the
    ``SendWR`` those fields describe, and its waiter completes with its completion."""
    from aiordma.protocol.engine import READ, WRITE, rdma_op

    e, _spool, _rpool, port = connected()
    port.sends.clear()
    w_write, w_read = Waiter(), Waiter()
    e.tx.oneq.append(rdma_op(WRITE, w_write, int(WROpcode.RDMA_WRITE_WITH_IMM), 0x1000, 64,
                             7, 0xFFFF_0000_0000_2000, 9, imm=0xDEADBEEF))
    e.tx.oneq.append(rdma_op(READ, w_read, int(WROpcode.RDMA_READ), 0x3000, 4096, 7,
                             0x4000, 11))
    e.tx.kick()
    (chain,) = port.sends
    write, read = chain
    assert (write.opcode, write.imm_data, write.remote_addr, write.rkey) == (
        WROpcode.RDMA_WRITE_WITH_IMM, 0xDEADBEEF, 0xFFFF_0000_0000_2000, 9)
    assert [(s.addr, s.length, s.lkey) for s in write.sg_list] == [(0x1000, 64, 7)]
    assert (read.opcode, read.remote_addr, read.rkey, read.sg_list[0].length) == (
        WROpcode.RDMA_READ, 0x4000, 11, 4096)
    assert read.send_flags & 2  # the last of the batch is signaled
    e.on_send_completion(WC(read.wr_id, WCStatus.SUCCESS, WCOpcode.RDMA_READ))
    assert w_write.resolved and w_read.resolved and w_read.exc is None
    with pytest.raises(OverflowError):
        rdma_op(WRITE, Waiter(), int(WROpcode.RDMA_WRITE), -1, 64, 7, 0, 9)


def test_an_atomic_op_lands_in_a_send_buffer_and_returns_the_old_value() -> None:
    """``atomic_op``: an atomic held as C fields goes out (on the port path) as the
    ``SendWR`` they describe, its 8-byte result pointed at a send buffer taken when it
    is posted; its waiter gets the old value from there, and the buffer is free again."""
    from aiordma.protocol.engine import atomic_op

    e, spool, _rpool, port = connected()
    port.sends.clear()
    free = spool.available
    fa, cs = Waiter(), Waiter()
    e.tx.oneq.append(atomic_op(fa, int(WROpcode.ATOMIC_FETCH_AND_ADD), 0x5008, 9, 3))
    e.tx.oneq.append(atomic_op(cs, int(WROpcode.ATOMIC_CMP_AND_SWP), 0x6000, 11,
                               0xFFFF_FFFF_FFFF_FFFF, 42))
    e.tx.kick()
    (chain,) = port.sends
    add, swap = chain
    assert (add.opcode, add.remote_addr, add.rkey, add.compare_add) == (
        WROpcode.ATOMIC_FETCH_AND_ADD, 0x5008, 9, 3)
    assert (swap.opcode, swap.remote_addr, swap.rkey, swap.compare_add, swap.swap) == (
        WROpcode.ATOMIC_CMP_AND_SWP, 0x6000, 11, 0xFFFF_FFFF_FFFF_FFFF, 42)
    assert spool.available == free - 2
    for wr, old in ((add, 7), (swap, 1 << 63)):
        (sge,) = wr.sg_list
        assert sge.length == 8 and sge.lkey == spool.lkey
        off = sge.addr - spool.base
        assert 0 <= off < len(spool.view) and off % spool.slot_size == 0
        spool.view[off: off + 8] = old.to_bytes(8, "little")  # the device's write
    e.on_send_completion(WC(swap.wr_id, WCStatus.SUCCESS, WCOpcode.COMP_SWAP))
    assert (fa.resolved, fa.result, cs.resolved, cs.result) == (True, 7, True, 1 << 63)
    assert spool.available == free
    with pytest.raises(OverflowError):
        atomic_op(Waiter(), int(WROpcode.ATOMIC_FETCH_AND_ADD), 0, 9, -1)


def test_check_messages_sums_flat_buffers_and_names_the_first_bad_one() -> None:
    """``check_messages`` (``send_many``'s check, in C): the total of C-contiguous
    bytes-like items up to the limit, else the index of the first one that is not."""
    import array

    words = array.array("I", [1, 2])
    good = [b"ab", bytearray(3), memoryview(b"cdef"), words, memoryview(bytearray(6))[1:]]
    assert check_messages(good, 8) == (2 + 3 + 4 + 8 + 5, -1)
    assert check_messages([], 8) == (0, -1)
    assert check_messages([b"ab", "text", b"x"], 8) == (0, 1)
    assert check_messages([b"ab", memoryview(bytearray(8))[::2]], 8) == (0, 1)
    assert check_messages([b"ab", b"c" * 9], 8) == (0, 1)
    released = memoryview(b"gone")
    released.release()
    assert check_messages([released], 8) == (0, 0)
