"""The asyncio-protocol examples, run as real processes on the provider under test."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys

import pytest
from _procs import EX, HOST
from _procs import proc_env as _env

pytestmark = pytest.mark.multiprocess


def _run(provider: str, script: str, *args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EX / script), "--host", HOST, *args],
                          capture_output=True, text=True, timeout=timeout, env=_env(provider))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
def test_protocol_echo_one_process(provider_name: str, loop: str) -> None:
    r = _run(provider_name, "protocol_echo.py", "--count", "40", "--size", "100K", "--loop", loop)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "protocol_echo ok" in r.stdout and "40 x 102400 B" in r.stdout


@pytest.mark.timeout(120)
def test_protocol_echo_detects_a_mismatch(provider_name: str) -> None:
    r = _run(provider_name, "protocol_echo.py", "--count", "5", "--size", "1K", "--corrupt")
    assert r.returncode == 1, r.stdout + r.stderr
    assert "MISMATCH" in r.stderr


@pytest.mark.timeout(120)
def test_protocol_echo_two_processes(provider_name: str) -> None:
    server = subprocess.Popen([sys.executable, str(EX / "protocol_echo.py"), "--role", "server",
                               "--host", HOST, "--port", "0"], stdout=subprocess.PIPE, text=True,
                              env=_env(provider_name))
    try:
        assert server.stdout is not None
        line = server.stdout.readline()
        m = re.search(r"listening on [^:]+:(\d+)", line)
        assert m, f"server did not start: {line!r}"
        for size in ("1", "16K", "3M"):
            r = _run(provider_name, "protocol_echo.py", "--role", "client", "--port", m.group(1),
                     "--count", "8", "--size", size)
            assert r.returncode == 0, r.stdout + r.stderr
            assert "protocol_echo ok" in r.stdout
    finally:
        server.terminate()
        assert server.wait(20) == 0  # SIGTERM: closes its clients and exits cleanly


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stack", ["rdma", "tcp"])
def test_http_h11_example(provider_name: str, stack: str) -> None:
    if importlib.util.find_spec("h11") is None:
        pytest.skip("h11 is not installed (it is in the 'test' extra)")
    r = _run(provider_name, "http_h11.py", "--stack", stack, "--requests", "20", "--size", "200K")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "http_h11 ok: 22 HTTP/1.1 requests" in r.stdout
