"""The futures an endpoint's operations wait on, made and resolved at the least cost.

A send, a receive that waits, a one-sided operation: each awaits one future, which the
message engine resolves from a completion. Two costs are taken off that path here:

* Making it. ``loop.create_future()`` is ``asyncio.Future(loop=loop)`` on asyncio's
  loops and uvloop's: a call with a keyword argument, for which CPython builds a dict,
  parses it and frees it. ``new_future`` makes the same future with a dict made once per
  endpoint (``future_kwargs``), which the engine's ``new_waiter`` passes on as it is.
  (``asyncio.Future()`` without the loop would look the running loop up instead, and on
  CPython 3.11 that check calls ``getpid()``, a system call, each time.)
* Resolving it. The engine resolves waiters of exactly ``asyncio.Future`` through the
  class's own ``done``/``set_result`` taken once (``register_waiter_type``), without a
  method lookup per message.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from .protocol import engine

__all__ = ["future_kwargs", "new_future"]

engine.register_waiter_type(asyncio.Future)

# compiled: C statics, no look-up per call
_new_waiter: Final = engine.new_waiter
_Future: Final = asyncio.Future


def future_kwargs(loop: asyncio.AbstractEventLoop) -> dict[str, Any] | None:
    """``{"loop": loop}`` when ``loop.create_future()`` makes exactly an
    ``asyncio.Future`` (asyncio's loops and uvloop's do), for ``new_future``; None when
    the loop makes its own kind, which ``new_future`` then asks it for. The dict is the
    caller's to keep, unchanged."""
    fut = loop.create_future()
    fut.cancel()
    return {"loop": loop} if type(fut) is _Future else None


def new_future(loop: asyncio.AbstractEventLoop,
               kwargs: dict[str, Any] | None) -> asyncio.Future[Any]:
    """A pending future of ``loop``, as ``loop.create_future()`` makes it; ``kwargs``:
    ``future_kwargs(loop)``."""
    if kwargs is not None:
        fut: asyncio.Future[Any] = _new_waiter(_Future, kwargs)
        return fut
    return loop.create_future()
