"""The rdma:// comm backend of distributed (aiordma.dask) on the provider under test.

distributed's own generic comm checks (``check_client_server``, ``check_deserialize``,
... of ``distributed.comm.tests.test_comms``, found by ``tests/_dask.py``) run against
``rdma://``, then what is particular to this backend: the entry point, zero-copy
frames, frames cut into pieces, failures mid-message, options from Dask's config.
Skipped where distributed is not installed.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import pytest

pytest.importorskip("distributed", minversion="2024.12.1")  # (aiordma[dask])
np = pytest.importorskip("numpy")

import dask  # noqa: E402
from _dask import HOST, upstream_comm_tests  # noqa: E402
from distributed.comm import (  # noqa: E402
    CommClosedError,
    connect,
    listen,
    registry,
)
from distributed.comm.core import Comm  # noqa: E402
from distributed.protocol import to_serialize  # noqa: E402
from distributed.utils_test import gen_test  # noqa: E402

import aiordma.dask  # noqa: E402,F401  (registers the backend)
from aiordma.dask import RDMABackend, RDMAComm  # noqa: E402
from aiordma.dask import frames as fr  # noqa: E402

pytestmark = pytest.mark.dask
ADDR = f"rdma://{HOST}"
#: gen_test's bound on each test, Dask's connect timeout and aiordma's per-step handshake
#: timeout: the defaults, or more in the (emulated) Soft-RoCE guest, where
#: check_client_server's 20 concurrent connections, set up one after another by the
#: listener's loop, took 160 s (so a step of one could outlast aiordma's 10 s)
_GUEST = bool(os.environ.get("AIORDMA_RXE_GUEST"))
GEN: dict[str, Any] = {"timeout": 30, "config": {}}
if _GUEST:
    GEN = {"timeout": 400, "config": {"distributed__comm__timeouts__connect": "300s",
                                      "distributed__comm__rdma": {"handshake_timeout": 120}}}


@pytest.fixture(scope="module")
def upstream() -> ModuleType:
    return upstream_comm_tests()


async def _abort_leftovers() -> None:
    """Abort the comms a check left open and wait for their endpoints' teardown (TCP's
    dangling comms are closed by their finalizers at once; ours need their loop, and the
    soft device's thread lives as long as its endpoints)."""
    eps = [c.endpoint for c in list(Comm._instances)
           if isinstance(c, RDMAComm) and c.endpoint is not None]
    for c in list(Comm._instances):
        if isinstance(c, RDMAComm):
            c.abort()
    for ep in eps:
        assert ep is not None
        await ep.wait_closed()


async def _pair(upstream: ModuleType, **kwargs: Any) -> tuple[RDMAComm, RDMAComm]:
    a, b = await upstream.get_comm_pair(ADDR, **kwargs)
    assert isinstance(a, RDMAComm) and isinstance(b, RDMAComm)
    return a, b


# ---------------------------------------------------------------- distributed's checks
@gen_test(**GEN)
async def test_client_server(upstream: ModuleType) -> None:
    await upstream.check_client_server(ADDR, upstream.tcp_eq(HOST))


def test_client_server_any_interface(upstream: ModuleType) -> None:
    """Listening on every interface, contacted at the host's external address. The soft
    device must then listen there too (``AIORDMA_SOFT_ADDR``, fixed when this process
    opened it): without that, this test runs itself in a child process that has it."""
    if (os.environ.get("AIORDMA_PROVIDER", "soft") == "soft"
            and os.environ.get("AIORDMA_SOFT_ADDR") != "0.0.0.0"):
        env = dict(os.environ, AIORDMA_SOFT_ADDR="0.0.0.0")
        test = f"{__file__}::test_client_server_any_interface"
        proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               test], env=env, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout + proc.stderr
        return
    gen_test(**GEN)(_any_interface)(upstream)


async def _any_interface(upstream: ModuleType) -> None:
    await upstream.check_client_server("rdma://", upstream.tcp_eq("0.0.0.0"),
                                       upstream.tcp_eq(upstream.EXTERNAL_IP4))


@gen_test(**GEN)
async def test_comm_closed_implicit(upstream: ModuleType) -> None:
    await upstream.check_comm_closed_implicit(ADDR)


@gen_test(**GEN)
async def test_comm_closed_explicit(upstream: ModuleType) -> None:
    await upstream.check_comm_closed_explicit(ADDR)


@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound on HOST with nobody listening: connecting is refused."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        yield s.getsockname()[1]


@gen_test(**GEN)
async def test_connect_timeout(upstream: ModuleType, closed_port: int) -> None:
    await upstream.check_connect_timeout(f"{ADDR}:{closed_port}")


@gen_test(**GEN)
async def test_many_listeners(upstream: ModuleType) -> None:
    await upstream.check_many_listeners(ADDR)


@gen_test(**GEN)
async def test_deserialize(upstream: ModuleType) -> None:
    await upstream.check_deserialize(ADDR)


@gen_test(**GEN)
async def test_deserialize_roundtrip(upstream: ModuleType) -> None:
    try:
        await upstream.check_deserialize_roundtrip(ADDR)
    finally:
        await _abort_leftovers()


@gen_test(**GEN)
async def test_deserialize_eoferror(upstream: ModuleType) -> None:
    await upstream.check_deserialize_eoferror(ADDR)


@gen_test(**GEN)
async def test_repr(upstream: ModuleType) -> None:
    a, b = await _pair(upstream)
    assert a.local_address in repr(b)
    assert b.local_address in repr(a)
    await upstream.check_repr(a, b)


@gen_test(**GEN)
async def test_addresses(upstream: ModuleType) -> None:
    a, b = await _pair(upstream)
    await upstream.check_addresses(a, b)


# ---------------------------------------------------------------- this backend
def test_entry_point_resolves_the_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    from importlib.metadata import entry_points

    if not list(entry_points(group="distributed.comm.backends", name="rdma")):
        pytest.skip("aiordma is not installed (no entry points): run from a checkout")
    monkeypatch.delitem(registry.backends, "rdma")
    backend = registry.get_backend("rdma")
    assert isinstance(backend, RDMABackend)
    assert backend.resolve_address("localhost:123") == "127.0.0.1:123"
    assert backend.get_address_host("10.1.2.3:99") == "10.1.2.3"
    assert backend.get_address_host_port("[::1]:99") == ("::1", 99)


@gen_test(**GEN)
async def test_numpy_frames_are_not_staged(upstream: ModuleType) -> None:
    """A large writable frame goes from the sender's array into a buffer of its own at
    the receiver: no staging copy on either side; what arrives is equal and writable."""
    a, b = await _pair(upstream)
    x = np.arange(3 << 20, dtype="u4").reshape(1024, -1)  # 12 MiB
    before = [c.endpoint.statistics() for c in (a, b)]  # type: ignore[union-attr]
    await a.write({"x": to_serialize(x), "small": b"abc"})
    msg = await b.read()
    after = [c.endpoint.statistics() for c in (a, b)]  # type: ignore[union-attr]
    assert msg["small"] == b"abc"
    np.testing.assert_array_equal(msg["x"], x)
    assert msg["x"].flags.writeable
    assert after[1]["rndv_staged"] == before[1]["rndv_staged"]
    assert after[0]["staging_registrations"] == before[0]["staging_registrations"]
    a.abort()
    b.abort()


@gen_test(**GEN)
async def test_writes_in_flight_share_memory(upstream: ModuleType) -> None:
    """Writes return before the peer reads: the same array, and a slice of it, in
    flight together are all sent from the memory they lie in (a region one write
    registered serves the others and stays until the last is done), then released."""
    a, b = await _pair(upstream)
    x = np.arange(1 << 20, dtype="f8")  # 8 MiB
    before = a.endpoint.statistics()  # type: ignore[union-attr]
    for part in (x, x[1000:], x):
        await a.write({"x": to_serialize(part)})
    for part in (x, x[1000:], x):
        np.testing.assert_array_equal((await b.read())["x"], part)
    assert a.endpoint.statistics()["staging_registrations"] == before["staging_registrations"]  # type: ignore[union-attr]
    for _ in range(100):  # the last completions reach the writer after the reader is done
        if not a._sending:
            break
        await asyncio.sleep(0.01)
    assert not a._sending and len(a._tx) == 0
    a.abort()
    b.abort()


@gen_test(**GEN)
async def test_frames_cut_into_pieces(upstream: ModuleType,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A frame longer than a piece travels in several aiordma messages (both sides
    of this test cut at the patched size), zero-copy or staged alike."""
    monkeypatch.setattr(fr, "PIECE", 1 << 20)
    a, b = await _pair(upstream)
    arr = np.random.default_rng(1).integers(0, 255, (5 << 20) + 12345, dtype="u1")
    blob = arr.tobytes()  # read-only: copied into staging at the sender
    await a.write({"x": to_serialize(arr), "y": to_serialize(blob)})
    msg = await b.read()
    np.testing.assert_array_equal(msg["x"], arr)
    assert bytes(msg["y"]) == blob
    a.abort()
    b.abort()


@gen_test(**GEN)
async def test_cancelled_read_closes_the_comm(upstream: ModuleType) -> None:
    a, b = await _pair(upstream)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(a.read(), 0.05)
    assert a.closed()
    with pytest.raises(CommClosedError):
        await b.read()
    assert b.closed()
    await b.close()


@gen_test(**GEN)
async def test_peer_abort_fails_reads_and_writes(upstream: ModuleType) -> None:
    a, b = await _pair(upstream)
    b.abort()
    with pytest.raises(CommClosedError):
        await a.read()
    with pytest.raises(CommClosedError):
        await a.write({"op": "late"})
    assert a.closed()


@gen_test(**GEN)
async def test_malformed_head_closes_the_comm(upstream: ModuleType) -> None:
    a, b = await _pair(upstream)
    assert a.endpoint is not None
    await a.endpoint.send(b"\x05\x00")  # not a head: shorter than its frame count
    with pytest.raises(CommClosedError, match="frame count"):
        await b.read()
    assert b.closed()
    a.abort()


@gen_test(**GEN)
async def test_options_from_dask_config(upstream: ModuleType) -> None:
    with dask.config.set({"distributed.comm.rdma": {"eager_size": 4096}}):
        a, b = await _pair(upstream)
    assert a.endpoint is not None and b.endpoint is not None
    assert a.endpoint.eager_payload == b.endpoint.eager_payload == 4096 - 8
    await a.write({"x": b"y" * 10000})
    assert (await b.read())["x"] == b"y" * 10000
    a.abort()
    b.abort()
    with dask.config.set({"distributed.comm.rdma": ["eager_size"]}):
        with pytest.raises(TypeError, match="mapping"):
            await connect(f"{ADDR}:1", timeout=1)


@gen_test(**GEN)
async def test_require_encryption_refuses_the_scheme() -> None:
    with pytest.raises(RuntimeError, match="encryption required"):
        await connect(f"{ADDR}:1", timeout=1, require_encryption=True)
    with pytest.raises(RuntimeError, match="encryption required"):
        listen(ADDR, lambda comm: None, require_encryption=True)
