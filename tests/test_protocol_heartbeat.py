"""protocol.heartbeat: the PING/PONG rules, on a simulated clock and link."""

from __future__ import annotations

import heapq

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocol.errors import RemoteProtocolError
from aiordma.protocol.heartbeat import FRAME, PING, PONG, Heartbeat

T = 8.0


def test_accepting_side_speaks_first_connecting_side_waits() -> None:
    acc = Heartbeat(T, accepting=True, now=0.0)
    con = Heartbeat(T, accepting=False, now=0.0)
    first = acc.start(0.0)
    assert FRAME.unpack(first)[0] == PING
    assert con.start(0.0) == b""
    assert con.schedule() == T  # it judges, but does not ping before a frame came
    assert con.poll(1.0) == b""
    pong = con.received(first, 0.001)
    assert FRAME.unpack(pong) == (PONG, FRAME.unpack(first)[1])
    assert con.schedule() == pytest.approx(0.001)  # now it may ping
    assert FRAME.unpack(con.poll(0.001))[0] == PING


def test_answers_every_ping_and_buffers_partial_frames() -> None:
    hb = Heartbeat(None, accepting=False, now=0.0)
    data = FRAME.pack(PING, 7) + FRAME.pack(PONG, 1) + FRAME.pack(PING, 8)
    out = hb.received(data[:5], 0.0) + hb.received(data[5:20], 0.1) + hb.received(data[20:], 0.2)
    assert out == FRAME.pack(PONG, 7) + FRAME.pack(PONG, 8)
    assert hb.pongs_received == 1
    assert hb.last_heard == 0.2


def test_garbage_is_a_protocol_error() -> None:
    hb = Heartbeat(T, accepting=True, now=0.0)
    with pytest.raises(RemoteProtocolError):
        hb.received(b"\x07" + bytes(8), 0.0)


def test_pings_each_quarter_and_gives_up_after_timeout() -> None:
    hb = Heartbeat(T, accepting=True, now=0.0)
    assert hb.start(0.0)
    sent = [0.0]
    for _ in range(10):  # bounded: 4 pings, then the deadline
        when = hb.schedule()
        if when is None:
            break
        if hb.poll(when):
            sent.append(when)
    assert sent == [0.0, 2.0, 4.0, 6.0]
    assert hb.unresponsive and hb.schedule() is None


def test_an_answer_moves_the_deadline() -> None:
    hb = Heartbeat(T, accepting=True, now=0.0)
    hb.start(0.0)
    hb.received(FRAME.pack(PONG, 1), 5.0)
    hb.poll(12.9)
    assert not hb.unresponsive
    hb.poll(13.0)
    assert hb.unresponsive


def test_our_own_stall_does_not_count_against_the_peer() -> None:
    hb = Heartbeat(T, accepting=True, now=0.0)
    hb.start(0.0)
    assert hb.schedule() == 2.0
    out = hb.poll(30.0)  # we were stopped for 28 s
    assert not hb.unresponsive and FRAME.unpack(out)[0] == PING
    assert hb.schedule() == pytest.approx(30.0 + T / 4)
    hb.received(FRAME.pack(PONG, 2), 30.001)
    assert not hb.unresponsive


def test_no_timeout_never_judges_but_unblocks_the_peer() -> None:
    hb = Heartbeat(None, accepting=True, now=0.0)
    assert FRAME.unpack(hb.start(0.0))[0] == PING
    assert hb.schedule() is None and hb.poll(1e6) == b"" and not hb.unresponsive
    with pytest.raises(ValueError):
        Heartbeat(0.0, accepting=True, now=0.0)


def _simulate(freeze: float, thaw: float, rtt: float, end: float) -> float | None:
    """Both sides on one clock, a link of ``rtt / 2`` each way; side b frozen during
    [freeze, thaw): nothing it receives or its timers run until then. The time a
    noticed b unresponsive, or None."""
    sides = {"a": Heartbeat(T, accepting=True, now=0.0), "b": Heartbeat(T, accepting=False, now=0.0)}
    other = {"a": "b", "b": "a"}
    events: list[tuple[float, int, str, str, bytes]] = []
    seq = 0

    def push(t: float, kind: str, side: str, data: bytes = b"") -> None:
        nonlocal seq
        if side == "b" and freeze <= t < thaw:
            t = thaw
        seq += 1
        heapq.heappush(events, (t, seq, kind, side, data))

    def send(t: float, side: str, data: bytes) -> None:
        if data:
            push(t + rtt / 2, "rx", other[side], data)

    def arm(side: str) -> None:
        when = sides[side].schedule()
        if when is not None:
            push(when, "wake", side)

    send(0.0, "a", sides["a"].start(0.0))
    arm("a")
    sides["b"].start(0.0)
    arm("b")
    for _ in range(100_000):  # bounded
        if not events:
            break
        t, _s, kind, side, data = heapq.heappop(events)
        if t > end:
            break
        hb = sides[side]
        if kind == "rx":
            send(t, side, hb.received(data, t))
        else:
            due = hb.schedule()
            if due is None or t < due:
                continue  # a stale wake-up (re-armed since)
            send(t, side, hb.poll(t))
            if side == "a" and hb.unresponsive:
                return t
        arm(side)
    return None


@settings(max_examples=60, deadline=None)
@given(freeze=st.floats(10.0, 20.0), pause=st.floats(0.0, 5.9 - 0.01),
       rtt=st.floats(0.0001, 0.01))
def test_a_pause_shorter_than_three_quarters_passes(freeze: float, pause: float, rtt: float) -> None:
    assert _simulate(freeze, freeze + pause - rtt, rtt, freeze + 30.0) is None


@settings(max_examples=60, deadline=None)
@given(freeze=st.floats(10.0, 20.0), rtt=st.floats(0.0001, 0.01))
def test_a_frozen_peer_is_found_within_the_timeout(freeze: float, rtt: float) -> None:
    found = _simulate(freeze, freeze + 1000.0, rtt, freeze + 30.0)
    assert found is not None
    assert 0.75 * T - rtt <= found - freeze <= T + rtt
