# ConnectionState (included by engine.pyx): the connection state machine of
# ``protocol/state.py``, whose tables (``LOCAL``, ``REMOTE``) it applies, with its
# halves and flags as C fields -- the data path reads them for every message.

cdef object LOCAL_OPEN = Local.OPEN
cdef object LOCAL_DRAINING = Local.DRAINING
cdef object REMOTE_OPEN = Remote.OPEN
cdef object EV_FAIL = Event.FAIL
cdef object EV_CLOSE = Event.CLOSE
cdef object EV_SEND_DATA = Event.SEND_DATA
cdef object ST_OPEN = State.OPEN
cdef object ST_LOCAL_CLOSING = State.LOCAL_CLOSING
cdef object ST_REMOTE_CLOSED = State.REMOTE_CLOSED
cdef object ST_CLOSED = State.CLOSED
cdef object ST_FAILED = State.FAILED
cdef object LOCAL_EVENTS = _state_rules.LOCAL_EVENTS
cdef object NEEDS_PEER = _state_rules.NEEDS_PEER
cdef dict LOCAL_RULES = _state_rules.LOCAL
cdef dict REMOTE_RULES = _state_rules.REMOTE
cdef dict WHY = _state_rules.WHY


cdef class ConnectionState:
    """Where one endpoint's connection stands (``aiordma.protocol.state`` has the rules
    and the table of its states). Sans-IO: ``handle`` every frame sent or received
    (before sending, after parsing), every shutdown request and failure.

    ``local`` (our side: ``Local``), ``remote`` (the peer's: ``Remote``), ``failed``
    (FAIL was handled, or an illegal event poisoned the machine: nothing more is posted
    -- also after a clean close, which ends with FAIL too, ``state`` then still saying
    CLOSED) and ``final`` (CLOSE was handled: after our CLOSE frame nothing more is
    sent) are read-only: only ``handle`` changes them."""

    def __cinit__(self):
        self.local = LOCAL_OPEN
        self.remote = REMOTE_OPEN

    @property
    def state(self):
        """Both halves summarized in the classic five states (``State``)."""
        return self.summary_c()

    cdef object summary_c(self):
        if self._poisoned:
            return ST_FAILED
        cdef bint sent = self.local is LOCAL_CLOSE_SENT
        if sent and self.remote is not REMOTE_OPEN:
            return ST_CLOSED
        if self.failed:
            return ST_FAILED
        if self.remote is REMOTE_OPEN:
            return ST_LOCAL_CLOSING if sent else ST_OPEN
        return ST_REMOTE_CLOSED

    cpdef object handle(self, object event):
        """Apply ``event`` (an ``Event``); return the summary state. Raises
        ``LocalProtocolError`` / ``RemoteProtocolError`` for an illegal event, after
        moving to FAILED."""
        if event is EV_FAIL:
            self.failed = True
            return self.summary_c()
        if not self.failed:
            if event in LOCAL_EVENTS:
                nxt = (<dict>LOCAL_RULES[self.local]).get(event)
                if nxt is not None and not (event in NEEDS_PEER
                                            and self.remote is REMOTE_GONE):
                    self.local = nxt
                    if event is EV_CLOSE:
                        self.final = True
                    return self.summary_c()
            else:
                nxt = (<dict>REMOTE_RULES[self.remote]).get(event)
                if nxt is not None:
                    self.remote = nxt
                    return self.summary_c()
        prev = self.summary_c()
        self.failed = self._poisoned = True
        who = LocalProtocolError if event in LOCAL_EVENTS else RemoteProtocolError
        if event in NEEDS_PEER and self.remote is REMOTE_GONE and prev is not ST_FAILED:
            why = "after the peer went away"
        elif (event is EV_SEND_DATA and self.local is LOCAL_DRAINING
              and prev is not ST_FAILED):
            why = "after shutting down (send_eof or close)"
        else:
            why = WHY.get(prev, "in state " + prev.name)
        raise who(f"{event.name} {why}")

    cdef bint can_send_c(self) noexcept:
        return not self.failed and self.local is LOCAL_OPEN and self.remote is not REMOTE_GONE

    cdef bint can_receive_c(self) noexcept:
        return not self.failed and self.remote is REMOTE_OPEN

    @property
    def can_send(self):
        """True if DATA may still be sent (our side OPEN, the peer not GONE)."""
        return self.can_send_c()

    @property
    def can_receive(self):
        """True if DATA (and the peer's CLOSE) may still arrive."""
        return self.can_receive_c()

    @property
    def closed(self):
        """True once CLOSED or FAILED (nothing more can happen)."""
        s = self.summary_c()
        return s is ST_CLOSED or s is ST_FAILED

    def __repr__(self):
        extra = "" if self.failed else f" local={self.local.name} remote={self.remote.name}"
        return f"<ConnectionState {self.summary_c().name}{extra}>"
