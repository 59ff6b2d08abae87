"""Running out of file descriptors, on either side (processes of ``fd_limit_peer.py``):
a typed ``ResourceLimitError`` that names the limit, at once; no half-made endpoint;
the listener logs once per burst and serves again when descriptors are free."""

from __future__ import annotations

import asyncio
import json
import os
import select
import subprocess
import sys
from typing import Any

import pytest
from _pairs import HOST, T

import aiordma

SCRIPT = os.path.join(os.path.dirname(__file__), "fd_limit_peer.py")
pytestmark = pytest.mark.multiprocess


class Server:
    def __init__(self, provider: str) -> None:
        env = dict(os.environ, AIORDMA_PROVIDER=provider)
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     env=env, text=True)
        self.port = int(self.line()["port"])

    def line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        r, _, _ = select.select([self.proc.stdout], [], [], T)
        assert r, "the server process did not answer"
        out: dict[str, Any] = json.loads(self.proc.stdout.readline())
        return out

    def ask(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.line()

    def stop(self) -> str:
        try:
            _out, err = self.proc.communicate("quit\n", timeout=T)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _out, err = self.proc.communicate()
        return err


async def test_listener_out_of_descriptors_refuses_with_a_reason(provider_name: str) -> None:
    srv = Server(provider_name)
    try:
        assert srv.ask("exhaust")["exhausted"] > 0
        for _ in range(20):
            with pytest.raises(aiordma.ResourceLimitError, match="out of file descriptors.*"
                               "RLIMIT_NOFILE is") as ei:
                # never the 30 s step timeout: refused at once
                await asyncio.wait_for(aiordma.connect(HOST, srv.port, timeout=30,
                                                       handshake_timeout=30,
                                                       provider=provider_name), 10)
            assert isinstance(ei.value, aiordma.RDMAError)
        assert srv.ask("free")["freed"] > 0
        ep = await aiordma.connect(HOST, srv.port, timeout=T, provider=provider_name)
        async with ep:
            await asyncio.wait_for(ep.send(b"served again"), T)
            assert await asyncio.wait_for(ep.recv(), T) == b"served again"
    finally:
        err = srv.stop()
    warnings = [ln for ln in err.splitlines() if "cannot accept" in ln]
    assert len(warnings) == 1, err  # once per burst, not once per client


async def test_client_out_of_descriptors_gets_a_typed_error(provider_name: str) -> None:
    """A client process with 0..15 descriptors to spare: each attempt either works
    end to end or fails with ResourceLimitError naming the limit -- never a later
    RetryExceededError or a timeout -- and the listener keeps serving."""
    async def echo(ep: aiordma.Endpoint) -> None:
        try:
            while True:
                await ep.send(await ep.recv())
        except aiordma.ConnectionClosed:
            pass

    listener = await aiordma.listen(echo, HOST, 0, provider=provider_name)
    results: list[dict[str, Any]] = []
    try:
        for headroom in range(16):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, SCRIPT, "client", str(listener.port), str(headroom),
                stdout=asyncio.subprocess.PIPE, env=dict(os.environ, AIORDMA_PROVIDER=provider_name))
            out, _ = await asyncio.wait_for(proc.communicate(), 60)
            results.append(json.loads(out))
    finally:
        listener.close()
        await asyncio.wait_for(listener.wait_closed(), T)
    failed = [r for r in results if not r["ok"]]
    assert all(r["error"] == "ResourceLimitError" and r["limit_named"] for r in failed), failed
    assert failed and results[-1]["ok"], results
    assert listener.accepted == sum(r["ok"] for r in results)


def test_soft_qp_that_cannot_connect_fails_its_transition(provider_name: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """No descriptor for the QP's connection (either the one it opens, or the one its
    peer will open to it): ``modify`` to RTR raises ResourceLimitError and the QP stays
    in INIT, instead of a first request failing later with RETRY_EXC_ERR."""
    if provider_name != "soft":
        pytest.skip("the soft device's own connections")
    import errno

    from test_verbs_provider import Pair, Resources, bring_up

    from aiordma.verbs import QPState, open_context
    from aiordma.verbs.soft import dial

    def no_fds(*_a: object) -> None:
        raise OSError(errno.EMFILE, "Too many open files")

    ctx = open_context(provider="soft")
    res = Resources(ctx)
    try:
        p = Pair(ctx, res, connect=False)
        monkeypatch.setattr(dial.socket, "socket", no_fds)
        monkeypatch.setattr(dial.os, "dup", no_fds)
        for qp, peer in ((p.a, p.b), (p.b, p.a)):  # one opens the connection, one waits
            with pytest.raises(aiordma.ResourceLimitError, match="RLIMIT_NOFILE"):
                bring_up(ctx, qp, peer.qp_num)
            assert qp.state == QPState.INIT
        monkeypatch.undo()
        for qp, peer in ((p.a, p.b), (p.b, p.a)):
            bring_up(ctx, qp, peer.qp_num)
        assert p.a.state == p.b.state == QPState.RTS
    finally:
        res.close()
        ctx.close()
