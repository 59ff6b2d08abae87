"""The cap of TCP's retransmission back-off (aiordma/tcp_backoff.py) on the soft device's
connections and the setup connection."""

from __future__ import annotations

import socket
from typing import Any

import pytest

from aiordma import connection, doctor, tcp_backoff
from aiordma.verbs.soft import dial


def _kernel_caps() -> bool:
    with socket.socket() as s:
        try:
            s.setsockopt(socket.IPPROTO_TCP, tcp_backoff.TCP_RTO_MAX_MS, tcp_backoff.RTO_MAX_MS)
        except OSError:
            return False
        return True


CAPS = _kernel_caps()


def _rto_max(s: socket.socket) -> int:
    return s.getsockopt(socket.IPPROTO_TCP, tcp_backoff.TCP_RTO_MAX_MS)


@pytest.mark.parametrize("family", [socket.AF_INET, socket.AF_INET6])
def test_a_tcp_socket_is_capped_where_the_kernel_can(family: int) -> None:
    try:
        s = socket.socket(family, socket.SOCK_STREAM)
    except OSError:
        pytest.skip("no such address family here")
    with s:
        assert tcp_backoff.cap_backoff(s) is CAPS
        if CAPS:
            assert _rto_max(s) == tcp_backoff.RTO_MAX_MS


@pytest.mark.parametrize("family, kind", [(socket.AF_UNIX, socket.SOCK_STREAM),
                                          (socket.AF_INET, socket.SOCK_DGRAM)])
def test_other_sockets_are_left_alone(family: int, kind: int) -> None:
    with socket.socket(family, kind) as s:
        assert tcp_backoff.cap_backoff(s) is False


def test_a_refused_option_is_no_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tcp_backoff, "TCP_RTO_MAX_MS", 0x7FFF)  # no such option
    with socket.socket() as s:
        assert tcp_backoff.cap_backoff(s) is False


def test_doctor_says_which_back_off_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tcp_backoff.available() is CAPS
    assert ("capped at 1000 ms" in doctor.tcp_retransmissions().text) is CAPS
    monkeypatch.setattr(tcp_backoff, "TCP_RTO_MAX_MS", 0x7FFF)  # no such option
    assert tcp_backoff.available() is False
    assert "the system's" in doctor.tcp_retransmissions().text


@pytest.mark.skipif(not CAPS, reason="the kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
def test_device_connections_are_capped() -> None:
    with socket.socket() as s:
        dial.tune(s)
        assert s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert _rto_max(s) == tcp_backoff.RTO_MAX_MS


@pytest.mark.skipif(not CAPS, reason="the kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
def test_a_dialed_device_connection_is_capped_from_its_syn() -> None:
    class Engine:
        unix_listener = None  # no same-host Unix socket: TCP
        limit_logged = False

    with socket.socket() as ls:
        ls.bind(("127.0.0.1", 0))
        ls.listen()
        gid = socket.inet_pton(socket.AF_INET6, "::ffff:127.0.0.1")
        s, sa, err = dial.open_socket(Engine(), gid, ls.getsockname()[1])  # type: ignore[arg-type]
        with s:
            assert s.family == socket.AF_INET and sa == ls.getsockname()
            assert _rto_max(s) == tcp_backoff.RTO_MAX_MS


@pytest.mark.skipif(not CAPS, reason="the kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
def test_the_setup_connection_is_capped() -> None:
    class Writer:
        def __init__(self, sock: socket.socket) -> None:
            self.sock = sock

        def get_extra_info(self, name: str) -> Any:
            return self.sock if name == "socket" else None

    with socket.socket() as s:
        connection._keepalive(Writer(s))  # type: ignore[arg-type]
        assert s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
        assert _rto_max(s) == tcp_backoff.RTO_MAX_MS


@pytest.mark.netns
@pytest.mark.skipif(not CAPS, reason="the kernel has no TCP_RTO_MAX_MS (Linux < 6.15)")
def test_the_stall_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """``python -m aiordma.bench.tcp_stall`` measures both settings (figures, not bars)."""
    from aiordma.bench import tcp_stall
    from aiordma.bench.netns import unavailable

    reason = unavailable()
    if reason is not None:
        pytest.skip(reason)
    tcp_stall.main(["--seconds", "2", "--conns", "1", "--window", "2"])
    out = capsys.readouterr().out
    assert "back-off uncapped: longest wait" in out, out
    assert "back-off capped at 1 s: longest wait" in out, out
