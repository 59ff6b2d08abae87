"""One side of ``aiordma/bench/network.py``: a bulk transfer over plain asyncio TCP or an
aiordma endpoint, for a fixed time, between two network namespaces.

    python -m aiordma.bench.netpeer server tcp|rdma HOST PORT
    python -m aiordma.bench.netpeer client tcp|rdma HOST PORT SECONDS SIZE WINDOW [ACK_TIMEOUT]

The server prints ``READY`` and reads everything until the connection ends. The client
writes ``SIZE``-byte chunks (TCP: ``write`` + ``drain``) or sends ``SIZE``-byte
messages (aiordma: ``WINDOW`` in flight, ``ack_timeout=ACK_TIMEOUT`` when given) for
``SECONDS``, then prints one JSON line:
``{"bytes", "seconds", "mib_s", "error", "ack_timeouts"}`` (``ack_timeouts``: tries of
the soft QP's local ACK timer that ended without progress, a measure of the stalls
the retry budget had to outlast; None elsewhere). Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from typing import Any

T = 120.0


async def server(kind: str, host: str, port: int) -> None:
    if kind == "tcp":
        async def h(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            try:
                while await r.read(1 << 20):
                    pass
            except ConnectionError:
                pass
            w.close()

        srv: Any = await asyncio.start_server(h, host, port)
    else:
        import aiordma

        async def handler(ep: aiordma.Endpoint) -> None:
            try:
                while True:
                    await ep.recv()
            except aiordma.ConnectionClosed:
                pass

        srv = await aiordma.listen(handler, host, port)
    print("READY", flush=True)
    try:
        await asyncio.sleep(3600)
    finally:
        srv.close()


async def client(kind: str, host: str, port: int, seconds: float, size: int,
                 window: int, ack_timeout: int | None = None) -> dict[str, Any]:
    blob = bytes(size)
    n = 0
    err: BaseException | None = None
    timeouts = None
    t0 = time.monotonic()
    if kind == "tcp":
        r, w = await asyncio.wait_for(asyncio.open_connection(host, port), T)
        try:
            while time.monotonic() - t0 < seconds:
                w.write(blob)
                await asyncio.wait_for(w.drain(), T)
                n += size
        except (OSError, TimeoutError) as exc:
            err = exc
        dt = time.monotonic() - t0
        w.close()
    else:
        import aiordma

        opts = {} if ack_timeout is None else {"ack_timeout": ack_timeout}
        ep = await aiordma.connect(host, port, timeout=T, **opts)
        sem = asyncio.Semaphore(window)
        errors: list[BaseException] = []

        async def one() -> None:
            nonlocal n
            try:
                await asyncio.wait_for(ep.send(blob), T)
                n += size
            except (OSError, TimeoutError) as exc:
                errors.append(exc)
            finally:
                sem.release()

        tasks: list[asyncio.Task[None]] = []
        while time.monotonic() - t0 < seconds and not errors:
            await asyncio.wait_for(sem.acquire(), T)
            tasks.append(asyncio.ensure_future(one()))
        await asyncio.wait_for(asyncio.gather(*tasks), T)
        dt = time.monotonic() - t0
        err = errors[0] if errors else None
        qp = getattr(ep, "_qp", None)  # (the soft QP's counter; a benchmark may peek)
        timeouts = getattr(qp, "local_ack_timeouts", None)
        await ep.close()
    cause = getattr(err, "__cause__", None)
    return {"bytes": n, "seconds": dt, "mib_s": n / dt / 2**20,
            "error": None if err is None else f"{type(err).__name__}: {err}"
            + (f" (cause {type(cause).__name__})" if cause is not None else ""),
            "ack_timeouts": timeouts}


def main(argv: list[str]) -> int:
    role, kind, host, port = argv[0], argv[1], argv[2], int(argv[3])
    if role == "server":
        asyncio.run(server(kind, host, port))
        return 0
    ack = int(argv[7]) if len(argv) > 7 else None
    res = asyncio.run(client(kind, host, port, float(argv[4]), int(argv[5]), int(argv[6]), ack))
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
