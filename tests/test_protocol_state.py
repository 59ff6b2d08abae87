"""Connection state machine (aiordma.protocol.state)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aiordma.protocol import (
    ConnectionState,
    Event,
    LocalProtocolError,
    RemoteProtocolError,
    State,
)
from aiordma.protocol.state import TRANSITIONS, Local, Remote

E, S = Event, State


def drive(*events: Event) -> ConnectionState:
    cs = ConnectionState()
    for e in events:
        cs.handle(e)
    return cs


def test_initial_state() -> None:
    cs = ConnectionState()
    assert cs.state is S.OPEN and cs.can_send and cs.can_receive and not cs.closed
    assert repr(cs) == "<ConnectionState OPEN local=OPEN remote=OPEN>"


@pytest.mark.parametrize(
    ("events", "state", "can_send", "can_receive"),
    [
        ((E.SEND_DATA, E.RECV_DATA), S.OPEN, True, True),
        ((E.SEND_CLOSE,), S.LOCAL_CLOSING, False, True),
        ((E.SEND_CLOSE, E.RECV_DATA, E.RECV_DATA), S.LOCAL_CLOSING, False, True),
        ((E.SEND_CLOSE, E.RECV_CLOSE), S.CLOSED, False, False),
        ((E.RECV_CLOSE,), S.REMOTE_CLOSED, True, False),
        ((E.RECV_CLOSE, E.SEND_DATA), S.REMOTE_CLOSED, True, False),
        ((E.RECV_CLOSE, E.SEND_CLOSE), S.CLOSED, False, False),
        ((E.FAIL,), S.FAILED, False, False),
        ((E.SEND_CLOSE, E.FAIL), S.FAILED, False, False),
        ((E.RECV_CLOSE, E.FAIL, E.FAIL), S.FAILED, False, False),
        ((E.SEND_CLOSE, E.RECV_CLOSE, E.FAIL), S.CLOSED, False, False),
    ],
)
def test_legal_paths(
    events: tuple[Event, ...], state: State, can_send: bool, can_receive: bool
) -> None:
    cs = drive(*events)
    assert (cs.state, cs.can_send, cs.can_receive) == (state, can_send, can_receive)


@pytest.mark.parametrize(
    ("events", "bad", "exc", "match"),
    [
        ((E.SEND_CLOSE,), E.SEND_DATA, LocalProtocolError, "SEND_DATA after we sent CLOSE"),
        ((E.SEND_CLOSE,), E.SEND_CLOSE, LocalProtocolError, "SEND_CLOSE after we sent CLOSE"),
        ((E.RECV_CLOSE,), E.RECV_DATA, RemoteProtocolError, "RECV_DATA after the peer sent CLOSE"),
        ((E.RECV_CLOSE,), E.RECV_CLOSE, RemoteProtocolError, "RECV_CLOSE after the peer sent"),
        ((E.SEND_CLOSE, E.RECV_CLOSE), E.SEND_DATA, LocalProtocolError, "on a closed connection"),
        ((E.SEND_CLOSE, E.RECV_CLOSE), E.RECV_DATA, RemoteProtocolError, "on a closed connection"),
        ((E.FAIL,), E.SEND_DATA, LocalProtocolError, "SEND_DATA on a failed connection"),
        ((E.FAIL,), E.RECV_CLOSE, RemoteProtocolError, "RECV_CLOSE on a failed connection"),
    ],
)
def test_illegal_events_raise_and_poison(
    events: tuple[Event, ...], bad: Event, exc: type[Exception], match: str
) -> None:
    cs = drive(*events)
    with pytest.raises(exc, match=match):
        cs.handle(bad)
    assert cs.state is S.FAILED and cs.closed
    assert not cs.can_send and not cs.can_receive
    with pytest.raises((LocalProtocolError, RemoteProtocolError)):
        cs.handle(E.SEND_DATA if bad is E.RECV_DATA else E.RECV_DATA)


def test_table_is_complete_and_fail_always_legal() -> None:
    assert set(TRANSITIONS) == set(State)
    for state, row in TRANSITIONS.items():
        assert E.FAIL in row, state
        assert set(row) <= set(Event)


CLASSIC = [E.SEND_DATA, E.RECV_DATA, E.SEND_CLOSE, E.RECV_CLOSE, E.FAIL]


@given(st.lists(st.sampled_from(CLASSIC), max_size=20))
def test_random_event_sequences(events: list[Event]) -> None:
    """The machine follows the table exactly; any violation lands in FAILED for good."""
    cs = ConnectionState()
    expected = S.OPEN
    for e in events:
        nxt = TRANSITIONS[expected].get(e)
        if nxt is None:
            who = LocalProtocolError if e.name.startswith("SEND") else RemoteProtocolError
            with pytest.raises(who):
                cs.handle(e)
            expected = S.FAILED
        else:
            assert cs.handle(e) is nxt
            expected = nxt
        assert cs.state is expected
        assert cs.can_send == (expected in (S.OPEN, S.REMOTE_CLOSED))
        assert cs.can_receive == (expected in (S.OPEN, S.LOCAL_CLOSING))


# -- the two halves -----------------------------------------------------------------------

L, R = Local, Remote


def test_shutdown_drains_then_closes() -> None:
    cs = drive(E.SEND_DATA, E.SHUT_WR)
    assert cs.local is L.DRAINING and not cs.can_send and cs.state is S.OPEN
    assert not cs.final
    with pytest.raises(LocalProtocolError, match="SEND_DATA after shutting down"):
        drive(E.SHUT_WR, E.SEND_DATA)
    cs = drive(E.SHUT_WR, E.CLOSE, E.SHUT_WR, E.SEND_CLOSE, E.CLOSE)
    assert cs.local is L.CLOSE_SENT and cs.final and cs.state is S.LOCAL_CLOSING


def test_peer_gone_after_its_close() -> None:
    cs = drive(E.RECV_CLOSE, E.SEND_DATA, E.PEER_GONE, E.PEER_GONE)
    assert cs.remote is R.GONE and not cs.can_send and not cs.can_receive
    assert cs.state is S.REMOTE_CLOSED and not cs.closed
    for bad in (E.SEND_DATA, E.SEND_CLOSE):
        with pytest.raises(LocalProtocolError, match="after the peer went away"):
            drive(E.RECV_CLOSE, E.PEER_GONE, bad)
    with pytest.raises(RemoteProtocolError, match="PEER_GONE"):
        drive(E.PEER_GONE)  # gone without its CLOSE: a failure, not a state


@given(st.lists(st.sampled_from(list(Event)), max_size=24))
def test_halves_follow_their_tables(events: list[Event]) -> None:
    """Each half moves exactly as its table says; SEND_* to a GONE peer and anything
    unlisted poison the machine; FAIL fails all but a CLOSED connection."""
    from aiordma.protocol.state import LOCAL, REMOTE

    cs = ConnectionState()
    local, remote, failed = L.OPEN, R.OPEN, False
    for e in events:
        if e is E.FAIL:
            cs.handle(e)
            failed = True
        else:
            if e in (E.SEND_DATA, E.SEND_CLOSE, E.SHUT_WR, E.CLOSE):
                nxt = None if failed else LOCAL[local].get(e)
                if nxt is not None and e in (E.SEND_DATA, E.SEND_CLOSE) and remote is R.GONE:
                    nxt = None
                ok, who = nxt is not None, LocalProtocolError
            else:
                nxt = None if failed else REMOTE[remote].get(e)
                ok, who = nxt is not None, RemoteProtocolError
            if ok:
                cs.handle(e)
                if e in (E.SEND_DATA, E.SEND_CLOSE, E.SHUT_WR, E.CLOSE):
                    local = nxt  # type: ignore[assignment]
                else:
                    remote = nxt  # type: ignore[assignment]
            else:
                with pytest.raises(who):
                    cs.handle(e)
                failed = True
        assert cs.failed == failed
        if not failed:
            assert (cs.local, cs.remote) == (local, remote)
        assert cs.can_send == (not failed and local is L.OPEN and remote is not R.GONE)
