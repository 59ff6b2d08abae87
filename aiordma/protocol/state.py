"""Connection state machine of an endpoint (h11 style: tables of legal transitions).

The message engine (``engine.py``) keeps the connection's state here and nowhere else.
It has two halves and a failure flag, as h11 keeps one state per role:

* **our side** (``Local``): what we may still send::

      OPEN --SHUT_WR / CLOSE--> DRAINING --SEND_CLOSE--> CLOSE_SENT
      OPEN --SEND_CLOSE--> CLOSE_SENT

  ``SHUT_WR`` (``send_eof()``) and ``CLOSE`` (``close()``) both stop new data; our CLOSE
  frame goes once what was sent before is delivered (``SEND_CLOSE``). ``CLOSE`` also
  marks the connection *final*: once our CLOSE is out, no further frame is sent (no
  credit returns), since nothing will be received any more.
* **the peer's side** (``Remote``): what may still arrive::

      OPEN --RECV_CLOSE--> CLOSED --PEER_GONE--> GONE

  ``PEER_GONE``: after its CLOSE, the peer's endpoint went away (its setup connection
  ended): what arrived stays readable, nothing can reach it any more.
* ``FAIL`` (an error, an abort, the peer gone without CLOSE) makes the connection
  FAILED, for good. A connection whose two CLOSEs have crossed is CLOSED, and stays so.

Legal events: SEND_DATA while our side is OPEN and the peer is not GONE; RECV_DATA while
the peer's side is OPEN; SEND_CLOSE once, not to a GONE peer; RECV_CLOSE once. CREDIT
and RNDV_DONE frames are flow-control bookkeeping, not state events. Anything else
raises ``LocalProtocolError`` (an event of ours) or ``RemoteProtocolError`` (the peer's)
and poisons the machine: it is FAILED, and every later event other than FAIL raises.
``state`` summarizes both halves in the five states of the classic table
(``TRANSITIONS``): OPEN, LOCAL_CLOSING, REMOTE_CLOSED, CLOSED, FAILED.
"""

from __future__ import annotations

from enum import Enum

from .errors import LocalProtocolError, RemoteProtocolError

__all__ = ["State", "Local", "Remote", "Event", "TRANSITIONS", "LOCAL", "REMOTE",
           "ConnectionState"]


class _Enum(Enum):
    """An enum whose members hash by identity, in C: ``Enum.__hash__`` is a Python
    function, and the data path looks these members up in the tables below for every
    message. (Members are singletons, and equal only to themselves.)"""

    __hash__ = object.__hash__


class State(_Enum):
    OPEN = "OPEN"
    LOCAL_CLOSING = "LOCAL_CLOSING"  # we sent CLOSE, the peer has not
    REMOTE_CLOSED = "REMOTE_CLOSED"  # the peer sent CLOSE, we still may send
    CLOSED = "CLOSED"  # both sent CLOSE
    FAILED = "FAILED"  # error or abort


class Local(_Enum):
    OPEN = "OPEN"
    DRAINING = "DRAINING"  # no new data; our CLOSE follows what was sent before
    CLOSE_SENT = "CLOSE_SENT"


class Remote(_Enum):
    OPEN = "OPEN"
    CLOSED = "CLOSED"  # its CLOSE arrived
    GONE = "GONE"  # and then its endpoint went away


class Event(_Enum):
    SEND_DATA = "SEND_DATA"
    RECV_DATA = "RECV_DATA"
    SEND_CLOSE = "SEND_CLOSE"
    RECV_CLOSE = "RECV_CLOSE"
    FAIL = "FAIL"
    SHUT_WR = "SHUT_WR"
    CLOSE = "CLOSE"
    PEER_GONE = "PEER_GONE"


_S, _E, _L, _R = State, Event, Local, Remote

LOCAL: dict[Local, dict[Event, Local]] = {
    _L.OPEN: {_E.SEND_DATA: _L.OPEN, _E.SHUT_WR: _L.DRAINING, _E.CLOSE: _L.DRAINING,
              _E.SEND_CLOSE: _L.CLOSE_SENT},
    _L.DRAINING: {_E.SHUT_WR: _L.DRAINING, _E.CLOSE: _L.DRAINING,
                  _E.SEND_CLOSE: _L.CLOSE_SENT},
    _L.CLOSE_SENT: {_E.SHUT_WR: _L.CLOSE_SENT, _E.CLOSE: _L.CLOSE_SENT},
}
"""Our side's legal transitions (events of ours)."""

REMOTE: dict[Remote, dict[Event, Remote]] = {
    _R.OPEN: {_E.RECV_DATA: _R.OPEN, _E.RECV_CLOSE: _R.CLOSED},
    _R.CLOSED: {_E.PEER_GONE: _R.GONE},
    _R.GONE: {_E.PEER_GONE: _R.GONE},
}
"""The peer's side's legal transitions (events of the peer)."""

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
"""The summary: ``TRANSITIONS[state][event] -> next state`` for the frame events."""

_LOCAL_EVENTS = frozenset({_E.SEND_DATA, _E.SEND_CLOSE, _E.SHUT_WR, _E.CLOSE})
_NEEDS_PEER = frozenset({_E.SEND_DATA, _E.SEND_CLOSE})  # illegal to a GONE peer
_WHY = {
    _S.LOCAL_CLOSING: "after we sent CLOSE",
    _S.REMOTE_CLOSED: "after the peer sent CLOSE",
    _S.CLOSED: "on a closed connection",
    _S.FAILED: "on a failed connection",
}


class ConnectionState:
    """Where one endpoint's connection stands. Sans-IO: ``handle`` every frame sent or
    received (before sending, after parsing), every shutdown request and failure."""

    __slots__ = ("local", "remote", "failed", "final", "_poisoned")

    def __init__(self) -> None:
        #: our side (read-only: only ``handle`` changes these; plain attributes, not
        #: properties, because the data path reads them for every message)
        self.local = Local.OPEN
        #: the peer's side
        self.remote = Remote.OPEN
        #: FAIL was handled (or an illegal event poisoned the machine): the connection
        #: is over, nothing more is posted -- also after a clean close, which ends with
        #: FAIL too (``state`` then still says CLOSED)
        self.failed = False
        #: CLOSE was handled: after our CLOSE frame nothing more is sent
        self.final = False
        self._poisoned = False

    @property
    def state(self) -> State:
        """Both halves summarized in the classic five states."""
        if self._poisoned:
            return State.FAILED
        sent = self.local is Local.CLOSE_SENT
        if sent and self.remote is not Remote.OPEN:
            return State.CLOSED
        if self.failed:
            return State.FAILED
        if self.remote is Remote.OPEN:
            return State.LOCAL_CLOSING if sent else State.OPEN
        return State.REMOTE_CLOSED

    def handle(self, event: Event) -> State:
        """Apply ``event``; return the summary state. Raises ``LocalProtocolError`` /
        ``RemoteProtocolError`` for an illegal event, after moving to FAILED."""
        if event is Event.FAIL:
            self.failed = True
            return self.state
        if not self.failed:
            if event in _LOCAL_EVENTS:
                nxt_local = LOCAL[self.local].get(event)
                if nxt_local is not None and not (event in _NEEDS_PEER
                                                  and self.remote is Remote.GONE):
                    self.local = nxt_local
                    if event is Event.CLOSE:
                        self.final = True
                    return self.state
            else:
                nxt_remote = REMOTE[self.remote].get(event)
                if nxt_remote is not None:
                    self.remote = nxt_remote
                    return self.state
        prev = self.state
        self.failed = self._poisoned = True
        who = LocalProtocolError if event in _LOCAL_EVENTS else RemoteProtocolError
        if event in _NEEDS_PEER and self.remote is Remote.GONE and prev is not State.FAILED:
            why = "after the peer went away"
        elif event is Event.SEND_DATA and self.local is Local.DRAINING and prev is not State.FAILED:
            why = "after shutting down (send_eof or close)"
        else:
            why = _WHY.get(prev, "in state " + prev.name)
        raise who(f"{event.name} {why}")

    @property
    def can_send(self) -> bool:
        """True if DATA may still be sent (our side OPEN, the peer not GONE)."""
        return not self.failed and self.local is Local.OPEN and self.remote is not Remote.GONE

    @property
    def can_receive(self) -> bool:
        """True if DATA (and the peer's CLOSE) may still arrive."""
        return not self.failed and self.remote is Remote.OPEN

    @property
    def closed(self) -> bool:
        """True once CLOSED or FAILED (nothing more can happen)."""
        s = self.state
        return s is State.CLOSED or s is State.FAILED

    def __repr__(self) -> str:
        extra = "" if self.failed else f" local={self.local.name} remote={self.remote.name}"
        return f"<ConnectionState {self.state.name}{extra}>"
