"""A fake CQ, completion channel and context with exact verbs arm/event semantics, for
driving ``aiordma.cq_reactor.CQReactor`` without a provider: the reactor
micro-benchmark (``reactor-fake``) and tests/test_cq_reactor.py.

Arming is one-shot, and an event fires only for a completion added after arming; the
channel is a pipe, so the event loop really wakes up. ``close()`` asserts that every
event was acknowledged (a real ``ibv_destroy_cq`` would block otherwise).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from aiordma.verbs import WC


class FakeChannel:
    """A completion channel: a non-blocking pipe and the CQs whose events it carries."""

    manual_progress = False  # (CompChannel: a device that progresses by itself)

    def __init__(self) -> None:
        self.r, self.w = os.pipe()
        os.set_blocking(self.r, False)
        os.set_blocking(self.w, False)
        self.fd = self.r
        self.events: list[Any] = []

    def fire(self, cq: Any) -> None:
        self.events.append(cq)
        os.write(self.w, b"x")

    def event_reader(self) -> Any:
        return self.get_event

    def get_event(self) -> Any:
        """The CQ of the next event, or None when none is pending."""
        try:
            os.read(self.r, 1)
        except BlockingIOError:
            return None
        return self.events.pop(0)

    def close(self) -> None:
        os.close(self.r)
        os.close(self.w)


class FakeCQ:
    """Arming is one-shot; an event fires only for a completion added after arming.
    ``after_poll``: a callable run once right after the next poll took its completions
    (race injection: a completion that lands just after the reactor looked, before it
    could have re-armed; only re-arming *before* that last look catches it)."""

    def __init__(self, channel: FakeChannel) -> None:
        self.channel = channel
        self.q: list[WC] = []
        self.armed = False
        self.acked = 0
        self.events = 0
        self.after_poll: Callable[[], None] | None = None
        self.closed = False

    def add(self, wc: WC) -> None:
        self.add_batch([wc])

    def add_batch(self, wcs: list[WC]) -> None:
        """Complete ``wcs`` at once: one event if the CQ is armed."""
        self.q.extend(wcs)
        if self.armed:
            self.armed = False
            self.events += 1
            self.channel.fire(self)

    def poll(self, n: int) -> list[WC]:
        q = self.q
        out = q[:n]
        del q[:n]
        if self.after_poll is not None:
            hook, self.after_poll = self.after_poll, None
            hook()
        return out

    def c_ops(self) -> None:
        """No C-level poll (``api.CQ.c_ops``): the reactor polls it in Python."""
        return None

    def notifier(self) -> Any:
        return self.req_notify

    def req_notify(self, solicited_only: bool = False) -> None:
        self.armed = True

    def ack_events(self, n: int) -> None:
        self.acked += n

    def close(self) -> None:
        assert self.acked == self.events, "CQ destroyed with unacknowledged events"
        self.closed = True


class FakeCtx:
    """The part of a verbs ``Context`` the reactor uses; remembers the CQs it made."""

    name = "fake0"

    def __init__(self) -> None:
        self.cqs: list[FakeCQ] = []

    def create_comp_channel(self) -> FakeChannel:
        return FakeChannel()

    def create_cq(self, cqe: int, channel: FakeChannel) -> FakeCQ:
        cq = FakeCQ(channel)
        self.cqs.append(cq)
        return cq
