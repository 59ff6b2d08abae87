"""Receive-credit flow control (aiordma.protocol.engine's CreditState): unit tests and a
two-peer simulation that models posted receive buffers explicitly."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aiordma.protocol import CreditState, LocalProtocolError, RemoteProtocolError

# -- unit tests ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("peer", "local", "reserve", "match"),
    [
        (8, 3, 1, "local_slots must be >= 4, got 3"),
        (3, 8, 1, "peer_credits must be >= 4, got 3"),
        (8, 8, 0, "reserve must be >= 1, got 0"),
        (4, 8, 3, "reserve 3 too large for 4 peer credits"),
        (8, 8, 5, "reserve 5 too large for 8 peer credits"),
    ],
)
def test_constructor_rejects(peer: int, local: int, reserve: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CreditState(peer, local, reserve=reserve)


def test_threshold() -> None:
    assert CreditState(4, 4).threshold == 2
    assert CreditState(4, 5).threshold == 2
    assert CreditState(4, 64).threshold == 32


def test_data_keeps_the_reserve_and_the_close_credit() -> None:
    cs = CreditState(4, 8)
    for _ in range(2):
        assert cs.can_send_data()
        cs.consume()
    assert cs.peer_credits == 2  # one reserved for credit-returning control, one for CLOSE
    assert not cs.can_send_data()
    with pytest.raises(LocalProtocolError, match="no credit to send a data frame"):
        cs.consume()
    assert cs.peer_credits == 2


def test_reserved_credit_only_for_control_that_returns_credit() -> None:
    cs = CreditState(4, 8)
    for _ in range(2):
        cs.consume()
    assert cs.owed == 0 and not cs.can_send_control()
    with pytest.raises(LocalProtocolError, match="no credit to send a control frame"):
        cs.consume(control=True)
    cs.on_reposted()
    assert cs.can_send_control()
    cs.consume(control=True)
    assert cs.take_piggyback() == 1
    assert cs.peer_credits == 1 and not cs.can_send_control()
    cs.on_reposted(5)
    assert not cs.can_send_control() and not cs.should_send_credit()


def test_close_always_has_its_credit_and_goes_once() -> None:
    """A writer stopped by a paused reader (no credit returned, nothing owed) can still
    send its CLOSE: rule 0 keeps a credit for it."""
    cs = CreditState(4, 4)
    while cs.can_send_data():
        cs.consume()
    assert not cs.can_send_control() and not cs.close_sent
    cs.consume_close()
    assert cs.close_sent and cs.peer_credits == 1  # the reserve is still there
    with pytest.raises(LocalProtocolError, match="CLOSE was already sent"):
        cs.consume_close()
    cs.on_credits(3)  # after CLOSE the held credit is part of the pool again
    assert cs.peer_credits == 4 and cs.can_send_data()
    for _ in range(3):
        cs.consume()
    assert not cs.can_send_data()


def test_control_above_reserve_needs_no_owed() -> None:
    cs = CreditState(4, 8)
    assert cs.owed == 0 and cs.can_send_control()
    cs.consume(control=True)
    assert cs.peer_credits == 3


def test_on_credits() -> None:
    cs = CreditState(6, 8)
    cs.consume()
    cs.consume()
    cs.on_credits(0)
    cs.on_credits(2)
    assert cs.peer_credits == 6
    with pytest.raises(RemoteProtocolError, match="peer returned 1 credits, holding 6 of the 6"):
        cs.on_credits(1)
    with pytest.raises(LocalProtocolError, match="negative"):
        cs.on_credits(-1)


def test_owed_and_piggyback() -> None:
    cs = CreditState(4, 8)
    assert cs.take_piggyback() == 0
    cs.on_reposted()
    cs.on_reposted(2)
    assert cs.owed == 3
    assert cs.take_piggyback() == 3
    assert cs.owed == 0
    cs.on_reposted(8)
    with pytest.raises(LocalProtocolError, match="re-posted 1 buffers with 8 already owed of 8"):
        cs.on_reposted()
    with pytest.raises(LocalProtocolError):
        cs.on_reposted(-1)


def test_piggyback_is_capped_at_u16() -> None:
    cs = CreditState(4, 70000)
    cs.on_reposted(70000)
    assert cs.take_piggyback() == 0xFFFF
    assert cs.take_piggyback() == 70000 - 0xFFFF
    assert cs.take_piggyback() == 0


def test_should_send_credit_at_threshold() -> None:
    cs = CreditState(4, 8)  # threshold 4
    cs.on_reposted(3)
    assert not cs.should_send_credit()
    cs.on_reposted()
    assert cs.should_send_credit()
    cs.consume(control=True)
    assert cs.take_piggyback() == 4
    assert not cs.should_send_credit()


def test_repr() -> None:
    cs = CreditState(4, 8)
    cs.consume()
    assert repr(cs) == ("<CreditState peer_credits=3/4 held_for_close=1 reserve=1 owed=0 "
                        "local_slots=8 threshold=4 repost_batch=1>")


@pytest.mark.parametrize(("local", "reserve", "asked", "batch"), [
    (64, 1, 16, 16), (64, 1, 100, 31), (8, 1, 16, 3), (5, 1, 16, 2), (4, 1, 16, 1),
    (64, 3, 40, 29), (64, 1, 1, 1),
])
def test_repost_batch_is_clamped_by_rule_6(local: int, reserve: int, asked: int,
                                           batch: int) -> None:
    assert CreditState(64, local, reserve=reserve, repost_batch=asked).repost_batch == batch


def test_repost_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="repost_batch must be >= 1, got 0"):
        CreditState(8, 8, repost_batch=0)


# -- two-peer simulation -------------------------------------------------------------------

DATA, CTRL, CREDIT, CLOSE = "DATA", "CTRL", "CREDIT", "CLOSE"  # CTRL: RNDV_DONE-like


@dataclass
class Peer:
    """One endpoint: its credit state, its posted receive buffers and its queues."""

    cs: CreditState
    slots: int  # receive buffers posted for the peer, in all
    posted: int  # of which currently posted (free)
    held: int = 0  # DATA frames received, buffer not yet released by the user
    waiting: int = 0  # buffers released, waiting to be re-posted together (rule 6)
    to_send: int = 0  # application messages queued
    ctrl_to_send: int = 0  # control frames (RNDV_DONE-like) queued
    received: int = 0  # application messages consumed by the user
    close: int = 0  # 0: not asked, 1: CLOSE queued (goes after the last DATA), 2: sent
    frames_sent: dict[str, int] = field(
        default_factory=lambda: {DATA: 0, CTRL: 0, CREDIT: 0, CLOSE: 0})


class Sim:
    """Two peers and two FIFO wires. Every frame consumes one posted receive buffer at
    its destination; DATA buffers are re-posted when the user consumes, control frames'
    at once; both wait until ``repost_batch`` of them can be re-posted together. Explicit
    CREDIT frames are sent by the endpoint whenever due."""

    def __init__(self, slots_a: int, slots_b: int, n_a: int, n_b: int, cs_type: type,
                 repost_batch: int = 1) -> None:
        self.peers = [
            Peer(cs_type(slots_b, slots_a, repost_batch=repost_batch), slots_a, slots_a,
                 to_send=n_a),
            Peer(cs_type(slots_a, slots_b, repost_batch=repost_batch), slots_b, slots_b,
                 to_send=n_b),
        ]
        self.wires: list[deque[tuple[str, int]]] = [deque(), deque()]  # wires[i]: i -> 1-i
        self.n = (n_a, n_b)

    def _emit(self, i: int, kind: str) -> None:
        p = self.peers[i]
        if kind == CLOSE:
            p.cs.consume_close()
        else:
            p.cs.consume(control=kind != DATA)
        self.wires[i].append((kind, p.cs.take_piggyback()))
        p.frames_sent[kind] += 1

    def credit_check(self, i: int) -> bool:
        if self.peers[i].cs.should_send_credit():
            self._emit(i, CREDIT)
            return True
        return False

    def send(self, i: int) -> bool:
        p = self.peers[i]
        if p.ctrl_to_send and p.cs.can_send_control():
            p.ctrl_to_send -= 1
            self._emit(i, CTRL)
        elif p.to_send and p.cs.can_send_data():
            p.to_send -= 1
            self._emit(i, DATA)
        elif p.close == 1 and not p.to_send:  # like the endpoint: after every DATA
            p.close = 2
            self._emit(i, CLOSE)
        else:
            return self.credit_check(i)
        self.credit_check(i)
        return True

    def deliver(self, i: int) -> bool:
        if not self.wires[i]:
            return False
        kind, credits = self.wires[i].popleft()
        dst = self.peers[1 - i]
        assert dst.posted > 0, f"frame arrived with no posted receive buffer (RNR): {self}"
        dst.posted -= 1
        dst.cs.on_credits(credits)
        if kind == DATA:
            dst.held += 1
        else:
            self._release(dst)
        self.credit_check(1 - i)
        return True

    @staticmethod
    def _release(p: Peer) -> None:
        """A buffer is free: it waits, and the batch is re-posted once it is full."""
        p.waiting += 1
        if p.waiting >= p.cs.repost_batch:
            p.posted += p.waiting
            p.cs.on_reposted(p.waiting)
            p.waiting = 0

    def consume(self, i: int) -> bool:
        p = self.peers[i]
        if not p.held:
            return False
        p.held -= 1
        p.received += 1
        self._release(p)
        self.credit_check(i)
        return True

    def queue_ctrl(self, i: int) -> bool:
        self.peers[i].ctrl_to_send += 1
        return True

    def close(self, i: int) -> bool:
        """The application asks for EOF: CLOSE is queued behind its remaining DATA."""
        p = self.peers[i]
        if p.close:
            return False
        p.close = 1
        return True

    def check_invariants(self) -> None:
        for i in (0, 1):
            src, dst = self.peers[i], self.peers[1 - i]
            returning = sum(c for _, c in self.wires[1 - i])
            tokens = (src.cs.peer_credits + len(self.wires[i]) + dst.held + dst.waiting
                      + dst.cs.owed + returning)
            assert tokens == dst.slots, f"credit conservation broken: {self}"
            assert dst.posted == dst.slots - dst.held - dst.waiting
            assert dst.waiting < dst.cs.repost_batch

    def step(self, action: str, i: int) -> bool:
        progressed: bool = getattr(self, action)(i)
        self.check_invariants()
        return progressed

    def drain(self, max_rounds: int) -> int:
        """A fair scheduler with users that consume everything: run until nothing moves.
        Returns the rounds used; fails if ``max_rounds`` is not enough."""
        for rounds in range(max_rounds):
            moved = False
            for i in (0, 1):
                while self.step("consume", i):
                    moved = True
                while self.step("send", i):
                    moved = True
            for i in (0, 1):
                while self.step("deliver", i):
                    moved = True
            if not moved:
                return rounds
        raise AssertionError(f"no quiescence after {max_rounds} rounds: {self}")

    def __repr__(self) -> str:
        return f"Sim(peers={self.peers}, wires={[list(w) for w in self.wires]})"


ACTIONS = ("send", "deliver", "consume", "queue_ctrl", "close")
# (action, side, repeat): bursts make full windows and crossing frames common.
schedules = st.lists(
    st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1), st.integers(1, 8)), max_size=100
)


Schedule = list[tuple[str, int, int]]


def _run(slots_a: int, slots_b: int, n_a: int, n_b: int, schedule: Schedule,
         repost_batch: int = 1) -> Sim:
    sim = Sim(slots_a, slots_b, n_a, n_b, CreditState, repost_batch)
    ctrl_budget = 20
    for action, i, repeat in schedule:
        for _ in range(repeat):
            if action == "queue_ctrl":
                if not ctrl_budget:
                    break
                ctrl_budget -= 1
            sim.step(action, i)  # (a): deliver asserts a posted buffer for every arrival
    return sim


@settings(max_examples=300, deadline=None)
@given(
    slots_a=st.integers(4, 24),
    slots_b=st.integers(4, 24),
    n_a=st.integers(0, 40),
    n_b=st.integers(0, 40),
    schedule=schedules,
    repost_batch=st.sampled_from([1, 2, 4, 16]),
)
def test_simulation_safe_live_and_quiet(
    slots_a: int, slots_b: int, n_a: int, n_b: int, schedule: Schedule, repost_batch: int
) -> None:
    sim = _run(slots_a, slots_b, n_a, n_b, schedule, repost_batch)
    # (b) liveness: users consume everything, the scheduler keeps delivering.
    sim.drain(max_rounds=4 * (n_a + n_b) + 50)
    a, b = sim.peers
    assert (a.to_send, b.to_send, a.ctrl_to_send, b.ctrl_to_send) == (0, 0, 0, 0)
    assert a.close != 1 and b.close != 1  # every CLOSE asked for went
    assert (b.received, a.received) == sim.n
    assert not sim.wires[0] and not sim.wires[1] and a.held == b.held == 0
    # ... and stays live: at quiescence both sides could send another message.
    assert a.cs.can_send_data() and b.cs.can_send_data(), sim
    # (c) quiescence: nothing more is ever sent without application traffic ...
    sent = [dict(p.frames_sent) for p in sim.peers]
    assert sim.drain(max_rounds=1) == 0
    assert [p.frames_sent for p in sim.peers] == sent
    # ... and CREDIT frames never outnumber the frames that caused them (no ping-pong):
    # each CREDIT needs >= 2 owed and each received frame creates 1.
    credit = sum(p.frames_sent[CREDIT] for p in sim.peers)
    other = sum(p.frames_sent[DATA] + p.frames_sent[CTRL] + p.frames_sent[CLOSE]
                for p in sim.peers)
    assert credit <= other


@settings(max_examples=100, deadline=None)
@given(slots_a=st.integers(4, 24), slots_b=st.integers(4, 24), schedule=schedules,
       repost_batch=st.sampled_from([1, 16]))
def test_simulation_without_application_traffic_quiesces(
    slots_a: int, slots_b: int, schedule: Schedule, repost_batch: int
) -> None:
    sim = _run(slots_a, slots_b, 0, 0, schedule, repost_batch)
    ctrl = sum(p.frames_sent[CTRL] + p.ctrl_to_send + p.frames_sent[CLOSE] + (p.close == 1)
               for p in sim.peers)
    sim.drain(max_rounds=2 * ctrl + 10)
    assert all(p.cs.can_send_data() for p in sim.peers), sim
    credit = sum(p.frames_sent[CREDIT] for p in sim.peers)
    assert credit <= ctrl


def test_idle_connection_sends_nothing() -> None:
    sim = Sim(4, 4, 0, 0, CreditState)
    assert sim.drain(max_rounds=1) == 0
    assert all(sum(p.frames_sent.values()) == 0 for p in sim.peers)


class NaiveCreditState(CreditState):
    """The tempting rule: any control frame may spend the last credit."""

    def can_send_control(self) -> bool:
        return self.peer_credits - (0 if self.close_sent else 1) > 0


def _both_spend_last_credit_on_control(cs_type: type) -> Sim:
    sim = Sim(4, 4, 4, 4, cs_type)
    for i in (0, 1):  # each fills the peer's buffers down to the reserve, no user reads
        for _ in range(2):
            sim.step("send", i)
    for i in (0, 1):
        while sim.step("deliver", i):
            pass
    for i in (0, 1):  # both now owe nothing and want to send e.g. an RNDV_DONE
        sim.step("queue_ctrl", i)
        sim.step("send", i)
    return sim


def test_naive_reserve_rule_deadlocks() -> None:
    """Shows why rule 3 exists: with the naive rule both peers end at zero credits while
    each owes the other a full window; the last message can never be sent."""
    sim = _both_spend_last_credit_on_control(NaiveCreditState)
    sim.drain(max_rounds=50)  # quiescent ...
    # Each holds only the CLOSE credit and owes the other its whole window.
    assert all(p.cs.peer_credits == 1 and p.cs.owed == 3 for p in sim.peers)
    assert all(p.to_send == 2 for p in sim.peers)  # ... but stuck


def test_reserve_rule_survives_the_same_schedule() -> None:
    sim = _both_spend_last_credit_on_control(CreditState)
    sim.drain(max_rounds=50)
    assert all(p.to_send == p.ctrl_to_send == 0 and p.received == 4 for p in sim.peers)


class UnclampedBatch(CreditState):
    """Re-posts only when every buffer waits: more than rule 6 allows."""

    @property
    def repost_batch(self) -> int:
        return 8


def _one_way_stream(cs_type: type) -> Sim:
    sim = Sim(8, 8, 20, 0, cs_type, repost_batch=8)
    sim.drain(max_rounds=100)
    return sim


def test_unclamped_repost_batch_deadlocks() -> None:
    """Shows why rule 6 bounds the batch: B consumed everything A could send, but its
    buffers wait for a batch that cannot fill, so A never gets credit back."""
    sim = _one_way_stream(UnclampedBatch)
    a, b = sim.peers
    assert a.to_send > 0 and b.waiting == b.received and b.cs.owed == 0  # stuck


def test_clamped_repost_batch_survives_the_same_stream() -> None:
    sim = _one_way_stream(CreditState)
    assert sim.peers[1].cs.repost_batch == 3
    assert sim.peers[0].to_send == 0 and sim.peers[1].received == 20


def test_paused_reader_never_traps_the_writers_close() -> None:
    """A fills B's window while B's user reads nothing, then closes: CLOSE still goes
    (no RNR: it lands in a posted buffer), and when B resumes it reads every message
    and the CLOSE, and both sides end with their windows back."""
    sim = Sim(4, 4, 10, 0, CreditState)
    while sim.step("send", 0):
        pass
    assert sim.peers[0].to_send == 8  # two went; the rest wait for credit
    sim.step("deliver", 0)
    sim.step("deliver", 0)
    sim.peers[0].to_send = 0  # the writer gives up on the rest and closes
    sim.step("close", 0)
    assert sim.step("send", 0) and sim.peers[0].close == 2
    assert sim.step("deliver", 0)  # CLOSE found a posted buffer (deliver asserts it)
    sim.drain(max_rounds=20)  # B's user resumes
    assert sim.peers[1].received == 2
    assert all(p.cs.can_send_data() for p in sim.peers)
