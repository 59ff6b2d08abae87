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
from aiordma.protocol.state import TRANSITIONS

E, S = Event, State


def drive(*events: Event) -> ConnectionState:
    cs = ConnectionState()
    for e in events:
        cs.handle(e)
    return cs


def test_initial_state() -> None:
    cs = ConnectionState()
    assert cs.state is S.OPEN and cs.can_send and cs.can_receive and not cs.closed
    assert repr(cs) == "<ConnectionState OPEN>"


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


@given(st.lists(st.sampled_from(list(Event)), max_size=20))
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
