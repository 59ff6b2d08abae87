"""Connection state machine of an endpoint (h11 style: tables of legal transitions): its
states, events and rules. ``ConnectionState`` applies them (``aiordma.protocol``; the
message engine's, compiled in ``engine_state.pxi`` with its fields in C, as the data path
reads them for every message), and is the one place a connection's state is kept.
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

__all__ = ["State", "Local", "Remote", "Event", "TRANSITIONS", "LOCAL", "REMOTE",
           "LOCAL_EVENTS", "NEEDS_PEER", "WHY"]


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

LOCAL_EVENTS = frozenset({_E.SEND_DATA, _E.SEND_CLOSE, _E.SHUT_WR, _E.CLOSE})
"""Our events (``LOCAL`` applies them; an illegal one raises ``LocalProtocolError``); the
others are the peer's (``REMOTE``; ``RemoteProtocolError``). ``FAIL`` is neither: it is
always legal."""
NEEDS_PEER = frozenset({_E.SEND_DATA, _E.SEND_CLOSE})
"""Our events that are illegal once the peer is GONE."""
WHY = {
    _S.LOCAL_CLOSING: "after we sent CLOSE",
    _S.REMOTE_CLOSED: "after the peer sent CLOSE",
    _S.CLOSED: "on a closed connection",
    _S.FAILED: "on a failed connection",
}
"""How an illegal event's error names the state it came in."""
