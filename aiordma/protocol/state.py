"""Connection state machine of an endpoint (h11 style: a table of legal transitions).

::

    OPEN --SEND_CLOSE--> LOCAL_CLOSING --RECV_CLOSE--> CLOSED
    OPEN --RECV_CLOSE--> REMOTE_CLOSED --SEND_CLOSE--> CLOSED
    any state --FAIL--> FAILED   (except CLOSED, which stays CLOSED)

SEND_DATA is legal while we have not sent CLOSE (OPEN, REMOTE_CLOSED); RECV_DATA while the
peer has not (OPEN, LOCAL_CLOSING). RNDV counts as DATA. CREDIT and RNDV_DONE frames are
flow-control bookkeeping, not state events: they are legal in both directions until the
connection is CLOSED or FAILED (a peer that has sent CLOSE must still acknowledge our
rendezvous messages and return credits).

An event not in the table raises ``LocalProtocolError`` (SEND_*: we broke the rules) or
``RemoteProtocolError`` (RECV_*: the peer did) and poisons the machine: the state becomes
FAILED and every later event other than FAIL raises again.
"""

from __future__ import annotations

from enum import Enum

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["State", "Event", "TRANSITIONS", "ConnectionState"]


class State(Enum):
    OPEN = "OPEN"
    LOCAL_CLOSING = "LOCAL_CLOSING"  # we sent CLOSE, the peer has not
    REMOTE_CLOSED = "REMOTE_CLOSED"  # the peer sent CLOSE, we still may send
    CLOSED = "CLOSED"  # both sent CLOSE
    FAILED = "FAILED"  # error or abort


class Event(Enum):
    SEND_DATA = "SEND_DATA"
    RECV_DATA = "RECV_DATA"
    SEND_CLOSE = "SEND_CLOSE"
    RECV_CLOSE = "RECV_CLOSE"
    FAIL = "FAIL"


_S, _E = State, Event
TRANSITIONS: dict[State, dict[Event, State]] = {
    _S.OPEN: {
        _E.SEND_DATA: _S.OPEN,
        _E.RECV_DATA: _S.OPEN,
        _E.SEND_CLOSE: _S.LOCAL_CLOSING,
        _E.RECV_CLOSE: _S.REMOTE_CLOSED,
        _E.FAIL: _S.FAILED,
    },
    _S.LOCAL_CLOSING: {
        _E.RECV_DATA: _S.LOCAL_CLOSING,
        _E.RECV_CLOSE: _S.CLOSED,
        _E.FAIL: _S.FAILED,
    },
    _S.REMOTE_CLOSED: {
        _E.SEND_DATA: _S.REMOTE_CLOSED,
        _E.SEND_CLOSE: _S.CLOSED,
        _E.FAIL: _S.FAILED,
    },
    _S.CLOSED: {_E.FAIL: _S.CLOSED},
    _S.FAILED: {_E.FAIL: _S.FAILED},
}
"""Legal transitions: ``TRANSITIONS[state][event] -> next state``."""

_LOCAL_EVENTS = frozenset({_E.SEND_DATA, _E.SEND_CLOSE})
_WHY = {
    _S.LOCAL_CLOSING: "after we sent CLOSE",
    _S.REMOTE_CLOSED: "after the peer sent CLOSE",
    _S.CLOSED: "on a closed connection",
    _S.FAILED: "on a failed connection",
}


class ConnectionState:
    """Where one endpoint's connection stands. Sans-IO: call ``handle`` for every frame
    sent or received (before sending, after parsing) and for failures."""

    __slots__ = ("_state",)

    def __init__(self) -> None:
        self._state = State.OPEN

    @property
    def state(self) -> State:
        return self._state

    def handle(self, event: Event) -> State:
        """Apply ``event``; return the new state. Raises ``LocalProtocolError`` /
        ``RemoteProtocolError`` for an illegal event, after moving to FAILED."""
        nxt = TRANSITIONS[self._state].get(event)
        if nxt is None:
            prev, self._state = self._state, State.FAILED
            who = LocalProtocolError if event in _LOCAL_EVENTS else RemoteProtocolError
            raise who(f"{event.name} {_WHY.get(prev, 'in state ' + prev.name)}")
        self._state = nxt
        return nxt

    @property
    def can_send(self) -> bool:
        """True if DATA (and our CLOSE) may still be sent."""
        return self._state is State.OPEN or self._state is State.REMOTE_CLOSED

    @property
    def can_receive(self) -> bool:
        """True if DATA (and the peer's CLOSE) may still arrive."""
        return self._state is State.OPEN or self._state is State.LOCAL_CLOSING

    @property
    def closed(self) -> bool:
        """True once CLOSED or FAILED (nothing more can happen)."""
        return self._state is State.CLOSED or self._state is State.FAILED

    def __repr__(self) -> str:
        return f"<ConnectionState {self._state.name}>"
