# Receive-credit flow control (included by engine.pyx): a SEND never arrives without
# a posted receive (no RNR).
#
# Each endpoint posts ``local_slots`` receive buffers for its peer and learns from the
# handshake how many the peer posted for it (``peer_credits``). One credit = one posted
# receive buffer at the peer; every frame sent (DATA, RNDV, RNDV_DONE, CREDIT, CLOSE)
# consumes one. A receive buffer is re-posted after its frame is consumed (control frames at
# once, DATA once the application has taken the payload); each re-post is a credit *owed* to
# the peer, returned piggy-backed in the ``credits`` field of the next outgoing frame, or
# by an explicit CREDIT frame once ``owed >= threshold``.
#
# Rules, and why they cannot deadlock or storm:
#
# 1. Piggy-back everything owed on every frame (``take_piggyback`` when building it).
# 0. One credit is set aside for our single CLOSE frame (EOF) until it is sent: CLOSE can
#    always go, so a close or half-close never waits for a paused reader (like TCP's FIN,
#    which needs no window). Rules 2 to 5 are about the other credits,
#    ``usable = peer_credits - (1 until CLOSE is sent)``; CLOSE is sent at most once.
# 2. DATA and RNDV need ``usable > reserve``: the last ``reserve`` credits are kept
#    for frames that return credit.
# 3. A control frame (CREDIT, RNDV_DONE) may spend a reserved credit only if it
#    carries at least one returned credit (``owed > 0``); above the reserve it always may.
#    So whenever a side spends its last credit, the frame gives the peer at least one; the
#    two sides can therefore never both sit at zero credits once the wire is drained:
#    if A spent its last credit on F, the peer gets >= 1 from F, and to get back to zero
#    it must spend its own last credit on a frame that reaches A after F was sent,
#    giving A credit again.
# 4. Explicit CREDIT only when ``owed >= threshold = max(2, local_slots // 2)``. With the
#    wire drained and both applications consuming, a side blocked on data holds at most
#    ``reserve + 1`` credits, so the peer owes at least
#    ``local_slots - reserve - 1 >= threshold`` (checked in ``__init__``) and has a credit
#    to say so (rule 3): progress. After our CLOSE we send no DATA, so the held-back
#    credit is no longer needed for this argument.
# 5. Every received CREDIT costs its receiver a buffer and so creates one owed credit, but a
#    CREDIT needs ``threshold >= 2`` owed to be sent: each CREDIT frame pays for at most
#    half of another, so an idle connection quiesces instead of ping-ponging.
# 6. Consumed buffers may wait to be re-posted together, at most ``repost_batch - 1`` of
#    them at a time (re-posting one by one costs a post per message). Waiting buffers are
#    neither posted nor owed, so rule 4 is restated with them: with the wire drained and
#    both applications consuming, a peer blocked on data holds ``C <= reserve + 1``
#    credits, and ``local_slots = C + owed + waiting``, so
#    ``owed >= local_slots - reserve - 1 - (repost_batch - 1)``, which is ``>= threshold``
#    because ``repost_batch <= local_slots - reserve - threshold`` (clamped in
#    ``__init__``; 1, i.e. no waiting, when the slots are too few). At quiescence
#    ``owed < threshold``, so we still hold ``C > reserve + 1``: both sides can send.
#
# Rule 0 with rules 2 and 3 mean a paused reader holds a writer back without ever
# trapping the writer's CLOSE: the data already sent sits in the reader's posted
# buffers, CLOSE lands in the buffer set aside for it, and the reader sees both, in
# order, when it resumes.
#
# Call order per outgoing frame: check ``can_send_*``, then ``consume()``, then
# ``take_piggyback()`` (rule 3 looks at ``owed``; ``consume`` enforces it).

MIN_SLOTS = 4
"""Fewest receive buffers an endpoint may post (so ``local_slots - 1 >= threshold``)."""


cdef inline int _threshold(int slots) noexcept:
    return 2 if slots // 2 < 2 else slots // 2


cdef class CreditState:
    """Credit accounting of one endpoint (both directions). Not thread-safe; sans-IO."""

    def __init__(self, int peer_credits, int local_slots, *, int reserve=1,
                 int repost_batch=1):
        """``peer_credits``: receive buffers the peer posted for us (its handshake);
        ``local_slots``: receive buffers we post for the peer; ``reserve``: credits kept
        back from DATA/RNDV (one more is held for CLOSE, rule 0), the same on both sides;
        ``repost_batch``: how many consumed buffers to re-post together at most (rule 6;
        clamped to what ``local_slots`` allows, see ``repost_batch``). Raises
        ``ValueError`` if ``local_slots < 4``, ``peer_credits < 4``, ``reserve < 1``,
        ``repost_batch < 1``, or the peer's threshold could not be reached with
        ``reserve + 1`` credits held back (rule 4)."""
        if local_slots < MIN_SLOTS:
            raise ValueError(f"local_slots must be >= {MIN_SLOTS}, got {local_slots}")
        if peer_credits < MIN_SLOTS:
            raise ValueError(f"peer_credits must be >= {MIN_SLOTS}, got {peer_credits}")
        if reserve < 1:
            raise ValueError(f"reserve must be >= 1, got {reserve}")
        if repost_batch < 1:
            raise ValueError(f"repost_batch must be >= 1, got {repost_batch}")
        if peer_credits - reserve - 1 < _threshold(peer_credits):
            raise ValueError(f"reserve {reserve} too large for {peer_credits} peer credits")
        self._peer_credits = peer_credits
        self._held = 1  # for CLOSE (rule 0)
        self._initial_peer = peer_credits
        self._local_slots = local_slots
        self._owed = 0
        self._reserve = reserve
        self._threshold = _threshold(local_slots)
        self._repost_batch = max(1, min(repost_batch,
                                        local_slots - reserve - self._threshold))

    # -- sender side -----------------------------------------------------------------------
    @property
    def peer_credits(self):
        """Credits we hold: frames we may still send before the peer re-posts."""
        return self._peer_credits

    @property
    def close_sent(self):
        """True once ``consume_close()`` has spent the credit held for CLOSE."""
        return not self._held

    # (the two rules are cpdef: a Python subclass that changes one, as the tests' models
    # of wrong rules do, changes what ``consume`` allows too)
    cpdef bint can_send_data(self) except -1:
        """True if a DATA or RNDV frame may be sent now (``usable > reserve``)."""
        return self._peer_credits - self._held > self._reserve

    cpdef bint can_send_control(self) except -1:
        """True if a CREDIT or RNDV_DONE frame may be sent now: above the reserve, or with
        a reserved credit when it will carry returned credit (``owed > 0``)."""
        cdef int usable = self._peer_credits - self._held
        return usable > self._reserve or (usable > 0 and self._owed > 0)

    cdef int consume_c(self, bint control) except -1:
        if not (self.can_send_control() if control else self.can_send_data()):
            kind = "control" if control else "data"
            raise LocalProtocolError(
                f"no credit to send a {kind} frame (peer_credits={self._peer_credits}, "
                f"reserve={self._reserve}, owed={self._owed})"
            )
        self._peer_credits -= 1
        return 0

    def consume(self, bint control=False):
        """Spend one credit for a frame about to be posted. Raises ``LocalProtocolError``
        when ``can_send_data()`` (or ``can_send_control()`` if ``control``) is False."""
        self.consume_c(control)

    cdef int consume_close_c(self) except -1:
        if not self._held:
            raise LocalProtocolError("CLOSE was already sent on this connection")
        self._held = 0
        self._peer_credits -= 1
        return 0

    def consume_close(self):
        """Spend the credit held for our CLOSE frame (always available, rule 0). Raises
        ``LocalProtocolError`` on a second call: CLOSE is sent once per connection."""
        self.consume_close_c()

    cdef int on_credits_c(self, int n) except -1:
        if n < 0:
            raise LocalProtocolError(f"negative credit count {n}")
        if self._peer_credits + n > self._initial_peer:
            raise RemoteProtocolError(
                f"peer returned {n} credits, holding {self._peer_credits} of the "
                f"{self._initial_peer} it granted"
            )
        self._peer_credits += n
        return 0

    def on_credits(self, int n):
        """The peer returned ``n`` credits (the ``credits`` field of a received frame).
        Raises ``RemoteProtocolError`` if we would hold more than it ever granted."""
        self.on_credits_c(n)

    # -- receiver side ---------------------------------------------------------------------
    @property
    def owed(self):
        """Receive buffers re-posted and not yet reported to the peer."""
        return self._owed

    @property
    def threshold(self):
        """``owed`` at which an explicit CREDIT frame is due: ``max(2, local_slots // 2)``."""
        return self._threshold

    @property
    def repost_batch(self):
        """Re-post consumed buffers once this many wait (rule 6): fewer may wait, never
        more. ``min(asked, local_slots - reserve - threshold)``, at least 1."""
        return self._repost_batch

    cdef int on_reposted_c(self, int n) except -1:
        if n < 0 or self._owed + n > self._local_slots:
            raise LocalProtocolError(
                f"re-posted {n} buffers with {self._owed} already owed of {self._local_slots}"
            )
        self._owed += n
        return 0

    def on_reposted(self, int n=1):
        """We re-posted ``n`` receive buffers; we now owe the peer ``n`` more credits.
        Raises ``LocalProtocolError`` if that would exceed ``local_slots``."""
        self.on_reposted_c(n)

    cdef int take_piggyback_c(self) noexcept:
        cdef int n = self._owed if self._owed <= MAX_CREDITS else MAX_CREDITS
        self._owed -= n
        return n

    def take_piggyback(self):
        """Return the credits to put in an outgoing frame's header (at most 65535) and
        stop owing them. Call once per frame, after ``consume``."""
        return self.take_piggyback_c()

    cdef bint should_send_credit_c(self) noexcept:
        return self._owed >= self._threshold and self.can_send_control()

    def should_send_credit(self):
        """True if an explicit CREDIT frame is due now (``owed >= threshold`` and
        ``can_send_control()``)."""
        return self.should_send_credit_c()

    def __repr__(self):
        return (
            f"<CreditState peer_credits={self._peer_credits}/{self._initial_peer} "
            f"held_for_close={self._held} reserve={self._reserve} owed={self._owed} "
            f"local_slots={self._local_slots} threshold={self._threshold} "
            f"repost_batch={self._repost_batch}>"
        )
