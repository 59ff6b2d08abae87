"""Real separate processes: the examples, and a peer killed mid-conversation."""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys

import pytest
from _procs import EX, HOST
from _procs import proc_env as _env

import aiordma

pytestmark = [pytest.mark.multiprocess, pytest.mark.usefixtures("soft_cma")]


def _stop(proc: subprocess.Popen[str]) -> None:
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)
        pytest.fail("the echo server did not exit within 30 s of SIGTERM")


def _start_server(provider: str, *extra: str) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, str(EX / "echo_server.py"), "--host", HOST,
                             "--port", "0", *extra], stdout=subprocess.PIPE, text=True,
                            env=_env(provider))
    assert proc.stdout is not None
    line = proc.stdout.readline()
    m = re.search(r"listening on [^:]+:(\d+)", line)
    if not m:
        proc.kill()
        pytest.fail(f"echo server did not start: {line!r}")
    return proc, int(m.group(1))


@pytest.mark.timeout(240)
def test_echo_example_two_processes_0_to_64MiB(provider_name: str) -> None:
    server, port = _start_server(provider_name)
    try:
        r = subprocess.run([sys.executable, str(EX / "echo_client.py"), "--host", HOST,
                            "--port", str(port), "--count", "3", "--size", "0,1,64,4K,17K,1M,64M"],
                           capture_output=True, text=True, timeout=200, env=_env(provider_name))
        assert r.returncode == 0, r.stdout + r.stderr
        lines = [ln for ln in r.stdout.splitlines() if ln.startswith("echo ok")]
        assert len(lines) == 7, r.stdout
        assert "67108864 B" in lines[-1]
    finally:
        _stop(server)


@pytest.mark.timeout(120)
def test_rdma_read_write_example(provider_name: str) -> None:
    r = subprocess.run([sys.executable, str(EX / "rdma_read_write.py"), "--host", HOST,
                        "--size", "8M"], capture_output=True, text=True, timeout=100,
                       env=_env(provider_name))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "rdma_read_write ok" in r.stdout


async def test_peer_killed_fails_pending_operations(provider_name: str) -> None:
    server, port = _start_server(provider_name)
    try:
        ep = await aiordma.connect(HOST, port, timeout=10, provider=provider_name)
        await ep.send(b"x")
        assert await asyncio.wait_for(ep.recv(), 10) == b"x"
        pending = asyncio.ensure_future(ep.recv())
        await asyncio.sleep(0.05)
        server.send_signal(signal.SIGKILL)
        with pytest.raises(aiordma.ConnectionClosed):
            await asyncio.wait_for(pending, 15)
        assert ep.closed
        with pytest.raises(aiordma.ConnectionClosed):
            await ep.send(b"y")
        await asyncio.wait_for(ep.wait_closed(), 15)
    finally:
        server.kill()
        server.wait(10)


async def test_peer_killed_during_large_send(provider_name: str) -> None:
    server, port = _start_server(provider_name)
    try:
        ep = await aiordma.connect(HOST, port, timeout=10, provider=provider_name)
        sends = [asyncio.ensure_future(ep.send(bytes(4 << 20))) for _ in range(4)]
        await asyncio.sleep(0.01)
        server.send_signal(signal.SIGKILL)
        results = await asyncio.wait_for(asyncio.gather(*sends, return_exceptions=True), 15)
        # each send either completed before the kill or failed as a closed connection
        assert all(r is None or isinstance(r, aiordma.ConnectionClosed) for r in results), results
        await asyncio.wait_for(ep.wait_closed(), 15)
    finally:
        server.kill()
        server.wait(10)


_LEAVE_OPEN = r'''
import asyncio, sys
import aiordma

async def main(how: str) -> None:
    async def echo(ep):
        while True:
            await ep.send(await ep.recv())

    listener = await aiordma.listen(echo, sys.argv[2], 0)
    ep = await aiordma.connect(sys.argv[2], listener.port, timeout=30)
    for i in range(5):  # completion events, some still unacknowledged (acks are batched)
        await ep.send(b"x" * i)
        assert await ep.recv() == b"x" * i
    if how == "close-not-awaited":
        close = asyncio.ensure_future(ep.close())  # asyncio.run() cancels it at exit
    # "left-open": the endpoints and the listener are simply dropped

asyncio.run(main(sys.argv[1]))
print("main returned", flush=True)
'''


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["left-open", "close-not-awaited"])
def test_process_exits_with_endpoints_not_closed(provider_name: str, how: str) -> None:
    """A program that returns from asyncio.run() without closing its endpoints still
    exits promptly and quietly: a cancelled close() destroys at once, and at exit the
    CQ events are acknowledged (otherwise ibv_destroy_cq in the GC blocks forever)."""
    r = subprocess.run([sys.executable, "-c", _LEAVE_OPEN, how, HOST], capture_output=True,
                       text=True, timeout=90, env=_env(provider_name))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "main returned" in r.stdout
    assert "Traceback" not in r.stderr and "was destroyed but it is pending" not in r.stderr, \
        r.stderr
