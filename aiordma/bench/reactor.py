"""Reactor micro-benchmark: completions dispatched per second and time per completion
by ``aiordma.cq_reactor.CQReactor`` at batch sizes 1, 4, 16, 64, in one process.

Each round registers ``batch`` handlers (what posting does), puts ``batch``
completions in the CQ at once (one channel event), and waits on the loop until the
reactor has dispatched them all. Time per completion = wall time / completions, so it
includes the loop wake-up (epoll), the channel read, ack, re-arm, the polls and the
dispatch, amortised over the batch -- the reactor's whole cost per completion.

Variants:

* ``reactor-fake``   -- a fake CQ whose completion channel is a pipe (as in
  tests/test_cq_reactor.py); handlers are plain callbacks: the reactor alone.
* ``reactor-future`` -- the same with ``future_handler`` resolving an asyncio future
  per completion (what an awaiting ``Endpoint`` operation adds, minus the task switch).
* ``reactor-soft``   -- the soft provider's real CQ and completion channel; completions
  are pushed by this thread under the device lock, as the NIC thread does.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from aiordma.cq_reactor import CQReactor, future_handler
from aiordma.verbs import WC, WCOpcode, WCStatus

from .common import REACTOR_BATCHES, Config, Result, run
from .fakecq import FakeCtx

VARIANTS = ("reactor-fake", "reactor-future", "reactor-soft")


async def _measure(variant: str, batch: int, cfg: Config) -> Result:
    loop = asyncio.get_running_loop()
    soft_ctx: Any = None
    if variant == "reactor-soft":
        from aiordma.verbs import open_context

        soft_ctx = open_context(provider="soft")
        ctx: Any = soft_ctx
    else:
        ctx = FakeCtx()
    reactor = CQReactor(ctx, loop, mode=cfg.poll_mode, spin_us=cfg.spin_us)
    cq: Any = reactor.acquire_cq(max(batch, 64))
    if variant == "reactor-soft":
        lock = soft_ctx._engine.lock

        def add(wcs: list[WC]) -> None:
            with lock:
                for wc in wcs:
                    cq.push(wc, None, 0, 0)
    else:
        add = cq.add_batch
    state = {"left": 0}
    done: list[asyncio.Future[None]] = []

    def on_wc(wc: WC, arg: Any) -> None:
        state["left"] -= 1
        if not state["left"]:
            done[0].set_result(None)

    def on_future(wc: WC, fut: asyncio.Future[WC]) -> None:
        future_handler(wc, fut)
        state["left"] -= 1
        if not state["left"]:
            done[0].set_result(None)

    register = reactor.register
    success, opcode = WCStatus.SUCCESS, WCOpcode.SEND

    async def one_round() -> None:
        done[:] = [loop.create_future()]
        state["left"] = batch
        if variant == "reactor-future":
            wcs = [WC(register(on_future, loop.create_future()), success, opcode)
                   for _ in range(batch)]
        else:
            wcs = [WC(register(on_wc, None), success, opcode) for _ in range(batch)]
        add(wcs)
        await done[0]

    total = max(cfg.iters * 20, 2000)
    rounds = max(1, total // batch)
    for _ in range(max(1, min(rounds // 10, 200))):
        await one_round()
    r0 = reactor.statistics()
    deadline = time.perf_counter() + cfg.max_seconds
    c0 = time.process_time()
    t0 = time.perf_counter()
    n = 0
    while n < rounds:
        await one_round()
        n += 1
        if time.perf_counter() > deadline:
            break
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    r1 = reactor.statistics()
    reactor.close()
    if soft_ctx is not None:
        soft_ctx.close()
    completions = n * batch
    res = Result(variant, "reactor", batch, ops=completions, seconds=wall, window=batch,
                 loop=cfg.loop)
    res.msgs_per_s = completions / wall
    res.lat_mean_us = wall / completions * 1e6
    res.cpu_client_s = cpu
    res.cpu_us_per_op = cpu / completions * 1e6
    wakeups = r1["wakeups"] - r0["wakeups"]
    res.extra = {"us_per_completion": res.lat_mean_us, "wakeups": wakeups,
                 "completions_per_wakeup": completions / wakeups if wakeups else None,
                 "mode": reactor.mode, "spin_us": reactor.spin_us}
    res.note = "batch size in the size column; latency column = wall us per completion"
    return res


async def _all(cfg: Config, variants: tuple[str, ...], batches: tuple[int, ...]) -> list[Result]:
    out = []
    for v in variants:
        for b in batches:
            out.append(await _measure(v, b, cfg))
    return out


def bench(cfg: Config, variants: tuple[str, ...] = VARIANTS,
          batches: tuple[int, ...] = REACTOR_BATCHES) -> list[Result]:
    """Run the micro-benchmark on a fresh loop of ``cfg.loop``."""
    return run(_all(cfg, variants, batches), cfg.loop)
