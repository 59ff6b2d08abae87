"""Who receives a work completion: the reactor's wr_id table and its engines.

A completion goes to one of two places:

* the handler registered for its ``wr_id`` (``register(handler, arg) -> wr_id``): the
  completion calls ``handler(wc, arg)`` exactly once, on the loop thread, in CQ order.
  ``arg`` keeps the operation's buffers alive until then, even when the awaiting task
  was cancelled (``future_handler`` drops the result of a cancelled future quietly);
* the message engine of its QP (``attach_engine``), for the wr_ids the engine made
  itself (``WR_ENGINE`` set): in C where the CQ has a C-level poll
  (``protocol.engine.poll_dispatch`` reads ``engines``), else as
  ``engine.on_completion(wc)``.

Exceptions raised by handlers go to ``report`` (the reactor passes the loop's exception
handler) and never stop the dispatch of the other completions.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from .errors import completion_error
from .protocol.engine import WR_ENGINE, EngineTable, MessageEngine
from .verbs import WC, WCStatus

__all__ = ["WRTable", "Handler", "future_handler"]

Handler = Callable[[WC, Any], None]


def future_handler(wc: WC, fut: asyncio.Future[WC]) -> None:
    """A handler resolving ``fut`` with the WC, or with the typed CompletionError.

    A future that is already done (cancelled) is left alone: the completion is
    dropped quietly, its buffers are released with the table entry.
    """
    if fut.done():
        return
    if wc.status == WCStatus.SUCCESS:
        fut.set_result(wc)
    else:
        fut.set_exception(completion_error(wc.status, vendor_err=wc.vendor_err,
                                           wr_id=wc.wr_id, opcode=wc.opcode))


class WRTable:
    """The handlers of outstanding wr_ids and the engines of attached QPs.

    ``report(exc)`` receives what a handler raised during ``dispatch``/``fail_all``.
    """

    def __init__(self, report: Callable[[BaseException], None]) -> None:
        self.handlers: dict[int, tuple[Handler, Any]] = {}
        self.engines = EngineTable()  # qp_num -> engine (for the wr_ids it made)
        self.report = report
        self.next_wr_id = 1
        self.unknown_wr_ids = 0  # completions whose wr_id had no handler (counted, dropped)

    def register(self, handler: Handler, arg: Any) -> int:
        """A new wr_id whose completion will call ``handler(wc, arg)`` once."""
        wr_id = self.next_wr_id
        self.next_wr_id = wr_id + 1
        self.handlers[wr_id] = (handler, arg)
        return wr_id

    def unregister(self, wr_id: int) -> None:
        """Forget a wr_id that was never posted (post refused)."""
        self.handlers.pop(wr_id, None)

    def unregister_owner(self, owner: object) -> int:
        """Forget every wr_id whose handler is a method of ``owner`` (an endpoint that
        destroys its QP before its flush completions arrived). Returns how many; O(table)."""
        mine = [w for w, (h, _a) in self.handlers.items()
                if getattr(h, "__self__", None) is owner]
        for wr_id in mine:
            del self.handlers[wr_id]
        return len(mine)

    def attach_engine(self, qp_num: int, engine: MessageEngine) -> None:
        """Completions of QP ``qp_num`` whose wr_id the engine made (``WR_ENGINE``) go to
        ``engine``."""
        self.engines.attach(qp_num, engine)

    def detach_engine(self, qp_num: int) -> None:
        """Forget QP ``qp_num``'s engine (its later completions are unknown wr_ids)."""
        self.engines.detach(qp_num)

    def outstanding(self) -> int:
        """How many registered wr_ids have not completed yet."""
        return len(self.handlers)

    def dispatch(self, wcs: list[WC]) -> None:
        """Hand each of ``wcs``, in order, to its engine or its handler."""
        engines = self.engines
        for wc in wcs:
            try:
                if wc.wr_id & WR_ENGINE:
                    engine = engines.get(wc.qp_num)
                    if engine is not None:
                        engine.on_completion(wc)
                        continue
                self.dispatch_one(wc)
            except Exception as exc:  # a bug in a handler must not stop the dispatch
                self.report(exc)

    def dispatch_one(self, wc: WC) -> None:
        """The handler registered for ``wc``'s wr_id, if any (else it is counted in
        ``unknown_wr_ids``); what the handler raises propagates."""
        handlers = self.handlers
        wr_id = wc.wr_id
        entry = handlers.get(wr_id)  # (get and del: C calls; dict.pop is a method call)
        if entry is None:
            self.unknown_wr_ids += 1
            return
        del handlers[wr_id]
        entry[0](wc, entry[1])

    def fail_all(self) -> None:
        """Completions were lost (CQ overrun): every handler gets a failed WC
        (``GENERAL_ERR``) and the table is emptied. Handlers' exceptions are dropped."""
        handlers, self.handlers = self.handlers, {}
        for wr_id, (handler, arg) in handlers.items():
            wc = WC(wr_id, WCStatus.GENERAL_ERR, 0)  # type: ignore[arg-type]
            try:
                handler(wc, arg)
            except Exception:
                pass

    def clear(self) -> None:
        """Drop every handler (the reactor closes)."""
        self.handlers.clear()
