"""One side of a two-process benchmark run.

    python -m aiordma.bench.worker server TRANSPORT CONFIG_JSON
    python -m aiordma.bench.worker client TRANSPORT CONFIG_JSON SERVER_INFO_JSON

TRANSPORT ``pyverbs`` runs the synchronous baseline of ``aiordma/bench/pyverbs_sync.py``
(same control protocol, no event loop); ``pyverbs-async`` the asyncio floor of
``aiordma/bench/pyverbs_async.py`` (a backend of this harness, like the sockets);
``ucxx-poll``/``ucxx-block`` UCXX over UCX shared memory (``aiordma/bench/ucxx_baseline.py``).

The server prints ``READY {json}`` (its control port and data address) on stdout and
serves until the client says ``quit`` (or the control connection closes). The client
runs every (test, size) of the configuration and prints one ``RESULT {json}`` line per
measurement. Control messages (JSON lines over TCP): ``begin`` (the server sets up
the test's pattern), ``mark`` (warm-up done: the server waits for the warm-up data,
then starts its CPU clock), ``end`` (the server waits for everything sent, stops, and
answers with its CPU seconds), ``quit``.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import traceback
from typing import Any

from .common import (
    LAT_TESTS,
    PATTERN,
    UCXX_BASELINES,
    Config,
    Control,
    CPUClock,
    Result,
    bounded,
    fill,
    ping_pong,
    run,
    test_timeout,
)


def _backend_server(transport: str, cfg: Config) -> Any:
    if transport == "aiordma":
        from .rdma import RdmaServer

        return RdmaServer(cfg)
    if transport == "pyverbs-async":
        from .pyverbs_async import AioVerbsServer

        return AioVerbsServer(cfg)
    if transport in UCXX_BASELINES:
        from .ucxx_baseline import UcxxServer

        return UcxxServer(cfg, transport)
    from .sockets import SocketServer

    family, api = transport.split("-")
    return SocketServer(family, "proto" if api == "proto" else "streams")


def _backend_client(transport: str, cfg: Config, info: dict[str, Any]) -> Any:
    if transport == "aiordma":
        from .rdma import RdmaClient

        return RdmaClient(cfg, info)
    if transport == "pyverbs-async":
        from .pyverbs_async import AioVerbsClient

        return AioVerbsClient(cfg, info)
    if transport in UCXX_BASELINES:
        from .ucxx_baseline import UcxxClient

        return UcxxClient(cfg, transport, info)
    from .sockets import SocketClient

    family, api = transport.split("-")
    return SocketClient(family, "proto" if api == "proto" else "streams", info)


# ======================================================================= server
async def serve(transport: str, cfg: Config) -> int:
    backend = _backend_server(transport, cfg)
    data = await backend.start()
    cpu = CPUClock()
    quit_ev = asyncio.Event()
    tmo = test_timeout(cfg)

    async def on_control(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        ctl = Control(reader, writer)
        try:
            while True:
                try:
                    msg = await ctl.recv()
                except (ConnectionError, OSError):
                    break
                cmd = msg.get("cmd")
                try:
                    if cmd == "begin":
                        reply = await backend.begin(msg["test"], msg["size"], msg["window"], tmo)
                        await ctl.send(**reply)
                    elif cmd == "mark":
                        await backend.mark(msg["msgs"], msg["bytes"], tmo)
                        cpu.start()
                        await ctl.send(ok=True)
                    elif cmd == "end":
                        await backend.end(msg["msgs"], msg["bytes"], tmo)
                        await ctl.send(cpu=cpu.elapsed())
                    elif cmd == "quit":
                        await ctl.send(ok=True)
                        break
                    else:
                        await ctl.send(error=f"unknown command {cmd!r}")
                except Exception as exc:
                    traceback.print_exc()
                    await ctl.send(error=repr(exc))
        finally:
            quit_ev.set()
            writer.close()

    ctl_server = await asyncio.start_server(on_control, "127.0.0.1", 0)
    port = ctl_server.sockets[0].getsockname()[1]
    print("READY " + json.dumps({"control": port, "data": data}), flush=True)
    await quit_ev.wait()
    ctl_server.close()
    try:
        await asyncio.wait_for(backend.close(), 15)
    except Exception:
        traceback.print_exc()
    return 0


# ======================================================================= client
async def _one(transport: str, backend: Any, ctl: Control, cfg: Config, test: str,
               size: int) -> Result:
    res = Result(transport, test, size, loop=cfg.loop)
    tmo = test_timeout(cfg)
    warm, iters = cfg.iters_for(test, size)
    window = cfg.window_for(test)
    res.window = window if (transport in ("aiordma", "pyverbs-async", *UCXX_BASELINES)
                            or PATTERN[test] == "source") else 0
    # aiordma's and UCXX's operations take the server's ``begin`` reply
    takes_info = transport == "aiordma" or getattr(backend, "takes_info", False)
    info = await ctl.call(tmo, cmd="begin", test=test, size=size, window=window)
    cpu = CPUClock()
    if test in LAT_TESTS:
        op = backend.lat_op(test, size, info) if takes_info else backend.lat_op(test, size)
        for _ in range(warm):
            await bounded(op(), tmo, f"{test} warm-up")
        await ctl.call(tmo, cmd="mark", msgs=warm, bytes=warm * size)
        cpu.start()
        ops, secs, samples = await bounded(ping_pong(op, 0, iters, cfg.max_seconds), tmo, test)
        res.cpu_client_s = cpu.elapsed()
        reply = await ctl.call(tmo, cmd="end", msgs=ops, bytes=ops * size)
        fill(res, ops=ops, seconds=secs, size=size, samples_ns=samples)
    else:
        async def stream(count: int, seconds: float) -> int:
            if takes_info:
                n: int = await backend.stream(test, size, count, window, seconds, info)
            else:
                n = await backend.stream(test, size, count, window, seconds)
            return n

        w = await bounded(stream(warm, cfg.max_seconds), tmo, f"{test} warm-up") if warm else 0
        await ctl.call(tmo, cmd="mark", msgs=w, bytes=w * size)
        cpu.start()
        t0 = time.perf_counter()
        ops = await bounded(stream(iters, cfg.max_seconds), tmo, test)
        reply = await ctl.call(tmo, cmd="end", msgs=ops, bytes=ops * size)
        secs = time.perf_counter() - t0
        res.cpu_client_s = cpu.elapsed()
        fill(res, ops=ops, seconds=secs, size=size)
        if getattr(backend, "api", ""):
            res.extra["api"] = backend.api
        if ops and secs:
            res.lat_mean_us = secs / ops * window * 1e6 if window else None
    res.cpu_server_s = reply.get("cpu")
    if res.ops and res.cpu_client_s is not None and res.cpu_server_s is not None:
        res.cpu_us_per_op = (res.cpu_client_s + res.cpu_server_s) / res.ops * 1e6
    if transport == "aiordma" and hasattr(backend, "end_test"):
        backend.end_test()
    return res


async def client(transport: str, cfg: Config, server: dict[str, Any]) -> int:
    r, w = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", server["control"]), 30)
    ctl = Control(r, w)
    backend = _backend_client(transport, cfg, server["data"])
    await bounded(backend.connect(), 60, f"{transport} connect")
    failed = 0
    try:
        for test, size in cfg.items()[cfg.skip:]:
            try:
                res = await _one(transport, backend, ctl, cfg, test, size)
            except Exception as exc:
                traceback.print_exc()
                res = Result(transport, test, size, loop=cfg.loop, error=repr(exc))
                failed += 1
                print("RESULT " + json.dumps(res.to_dict()), flush=True)
                return 1  # the connection's state is unknown: the harness restarts the pair
            print("RESULT " + json.dumps(res.to_dict()), flush=True)
        if transport == "aiordma":
            st = backend.statistics()
            print("STATS " + json.dumps(st), flush=True)
    finally:
        try:
            await ctl.call(10, cmd="quit")
        except Exception:
            pass
        ctl.close()
        try:
            await backend.close()
        except Exception:
            traceback.print_exc()
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    role, transport, cfg_json = argv[0], argv[1], argv[2]
    cfg = Config.from_json(cfg_json)
    cfg.pin(role)
    if transport == "pyverbs":  # synchronous busy-polling, no event loop
        from . import pyverbs_sync

        if role == "server":
            return pyverbs_sync.serve(cfg)
        return pyverbs_sync.client(cfg, json.loads(argv[3]))
    if role == "server":
        return run(serve(transport, cfg), cfg.loop)
    return run(client(transport, cfg, json.loads(argv[3])), cfg.loop)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
