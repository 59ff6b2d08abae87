"""A process that runs out of file descriptors, for tests/test_fd_limits.py.

``server``: listen (provider from AIORDMA_PROVIDER), print ``{"port": N}``, then obey
stdin lines: ``exhaust`` (open /dev/null until EMFILE, keep them; answer
``{"exhausted": n}``), ``free`` (close them; ``{"freed": n}``), ``quit``. aiordma's
warnings go to stderr.

``client PORT HEADROOM``: lower RLIMIT_NOFILE to the descriptors open now plus
HEADROOM, connect to PORT, exchange one message, print ``{"ok": true}`` or
``{"ok": false, "error": type name, "message": str, "limit_named": bool}``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import resource
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import aiordma  # noqa: E402

HOST = os.environ.get("AIORDMA_TEST_IP", "127.0.0.1")
PROVIDER = os.environ.get("AIORDMA_PROVIDER", "soft")


def _say(obj: object) -> None:
    print(json.dumps(obj), flush=True)


async def server() -> None:
    async def echo(ep: aiordma.Endpoint) -> None:
        try:
            while True:
                await ep.send(await ep.recv())
        except aiordma.ConnectionClosed:
            pass

    listener = await aiordma.listen(echo, HOST, 0, provider=PROVIDER)
    _say({"port": listener.port})
    loop = asyncio.get_running_loop()
    held: list[int] = []
    while True:
        line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
        if line == "exhaust":
            try:
                while len(held) < 1 << 20:
                    held.append(os.open(os.devnull, os.O_RDONLY))
            except OSError:
                pass
            _say({"exhausted": len(held)})
        elif line == "free":
            for fd in held:
                os.close(fd)
            _say({"freed": len(held)})
            held.clear()
        else:
            break
    listener.close()
    await listener.wait_closed()


async def client(port: int, headroom: int) -> None:
    open_now = len(os.listdir("/proc/self/fd")) - 1
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (open_now + headroom, hard))
    try:
        ep = await aiordma.connect(HOST, port, timeout=20, provider=PROVIDER)
        async with ep:
            await asyncio.wait_for(ep.send(b"x" * 100), 20)
            assert await asyncio.wait_for(ep.recv(), 20) == b"x" * 100
    except Exception as exc:
        _say({"ok": False, "error": type(exc).__name__, "message": str(exc),
              "limit_named": f"RLIMIT_NOFILE is {open_now + headroom}" in str(exc)})
        return
    _say({"ok": True})


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if sys.argv[1] == "server":
        asyncio.run(server())
    else:
        asyncio.run(client(int(sys.argv[2]), int(sys.argv[3])))


if __name__ == "__main__":
    main()
