"""The UCXX baselines of ``aiordma bench`` (aiordma/bench/ucxx_baseline.py).

Without ucxx: the names and their progress modes, the tests they run, the reasons a
failed probe gives, the worker protocol (server and client backends, tags per test,
the result of every test) against an in-process stand-in of ucxx's API. With ucxx
installed (``make bench-ucxx``'s venv): the real baselines for a few operations.
"""

from __future__ import annotations

import asyncio
import importlib.util
import itertools
import json
import subprocess
import sys
import types
from typing import Any

import pytest

from aiordma.bench import ucxx_baseline as ub
from aiordma.bench import worker
from aiordma.bench.common import Config
from aiordma.bench.external import BaselineUnavailable, check

HAVE_UCXX = importlib.util.find_spec("ucxx") is not None


def test_names_map_to_progress_modes() -> None:
    assert ub.progress_mode("ucxx-poll") == "polling"
    assert ub.progress_mode("ucxx-block") == "blocking"
    with pytest.raises(ValueError, match="not a UCXX baseline"):
        ub.progress_mode("ucxx-thread")


def test_only_two_sided_message_tests_run() -> None:
    cfg = Config(tests=["write_lat", "send_lat", "read_bw", "msg_rate", "send_bw"],
                 sizes=[64])
    assert ub.tests_of(cfg) == ["send_lat", "msg_rate", "send_bw"]
    assert ub.tests_of(Config(tests=["write_bw"], sizes=[64])) == []


def test_ucx_runs_over_shared_memory_only() -> None:
    assert ub.ucx_options()["TLS"] == "sm,self"


def test_probe_reasons() -> None:
    ok = "PROBE " + json.dumps({"ok": True, "reason": ""})
    assert ub.reason_from_probe(0, ok + "\n", "") is None
    bad = "PROBE " + json.dumps({"ok": False, "reason": "no sm"})
    assert ub.reason_from_probe(1, bad, "") == "no sm"
    why = ub.reason_from_probe(-11, "", "line1\nSegmentation fault\n")
    assert why is not None and "status -11" in why and "Segmentation fault" in why


def test_probe_without_ucxx_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ucxx", None)  # import ucxx raises ImportError
    d = ub.probe()
    assert d["ok"] is False
    assert "pip install 'aiordma[ucxx]'" in d["reason"]


def test_check_raises_unavailable_with_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ub, "unavailable_reason", lambda timeout=60.0: "ucxx is not importable")
    with pytest.raises(BaselineUnavailable, match="ucxx is not importable"):
        check("ucxx-block", Config(tests=["send_lat"], sizes=[64]))
    monkeypatch.setattr(ub, "unavailable_reason", lambda timeout=60.0: None)
    check("ucxx-poll", Config(tests=["send_lat"], sizes=[64]))


@pytest.mark.skipif(HAVE_UCXX, reason="ucxx is installed: the probe passes or fails on UCX")
def test_probe_process_without_ucxx() -> None:
    why = ub.unavailable_reason(timeout=60)
    assert why is not None and "aiordma[ucxx]" in why


# ----------------------------------------------------------------- a stand-in of ucxx
class _Worker:
    def __init__(self, addr: bytes) -> None:
        self.addr = addr
        self.queues: dict[int, asyncio.Queue[bytes]] = {}

    def queue(self, tag: int) -> asyncio.Queue[bytes]:
        return self.queues.setdefault(tag, asyncio.Queue())


class _Address:
    def __init__(self, b: bytes) -> None:
        self.b = b

    def tobytes(self) -> bytes:
        return self.b


class _Endpoint:
    """Tagged messages into the peer worker's queues (``Endpoint.send``/``recv``)."""

    def __init__(self, me: _Worker, peer: _Worker) -> None:
        self.me, self.peer = me, peer
        self.closed = False

    async def send(self, buf: Any, tag: int, force_tag: bool = False) -> None:
        assert force_tag and isinstance(buf, _Array)
        await asyncio.sleep(0)
        self.peer.queue(tag).put_nowait(bytes(buf.data))

    async def recv(self, buf: Any, tag: int, force_tag: bool = False) -> None:
        assert force_tag and isinstance(buf, _Array)
        data = await self.me.queue(tag).get()
        assert len(data) <= len(buf.data)
        buf.data[:len(data)] = data

    async def close(self) -> None:
        self.closed = True


class _Array:
    def __init__(self, obj: Any) -> None:
        self.data = memoryview(obj)


def _fake_ucxx() -> types.ModuleType:
    """ucxx's API as the baselines use it; each ``init`` starts a worker of its own
    (server and client share one process here)."""
    m = types.ModuleType("ucxx")
    workers: dict[bytes, _Worker] = {}
    ids = itertools.count(1)
    state: dict[str, Any] = {"current": None, "inits": []}

    def init(options: dict[str, str], progress_mode: str) -> None:
        w = _Worker(b"worker-%d" % next(ids))
        workers[w.addr] = w
        state["current"] = w
        state["inits"].append((options, progress_mode))

    async def create_endpoint_from_worker_address(addr: _Address,
                                                  endpoint_error_handling: bool) -> _Endpoint:
        assert endpoint_error_handling is False  # shared memory has no peer-failure check
        peer = workers[addr.b]
        me = next(w for w in workers.values() if w is not peer)  # the other of the two
        return _Endpoint(me, peer)

    def get_worker_address() -> _Address:
        return _Address(state["current"].addr)

    m.init = init  # type: ignore[attr-defined]
    m.get_worker_address = get_worker_address  # type: ignore[attr-defined]
    m.get_ucx_address_from_buffer = _Address  # type: ignore[attr-defined]
    m.create_endpoint_from_worker_address = (  # type: ignore[attr-defined]
        create_endpoint_from_worker_address)
    m.state = state  # type: ignore[attr-defined]
    return m


@pytest.fixture
def fake_ucxx(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    m = _fake_ucxx()
    lib = types.ModuleType("ucxx._lib")
    arr = types.ModuleType("ucxx._lib.arr")
    arr.Array = _Array  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ucxx", m)
    monkeypatch.setitem(sys.modules, "ucxx._lib", lib)
    monkeypatch.setitem(sys.modules, "ucxx._lib.arr", arr)
    return m


async def test_worker_protocol_gives_one_result_per_test_and_size(
        fake_ucxx: types.ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """The real worker server and client with the UCXX backends: every (test, size)
    gives a result with its figures, server and client agree on the tags."""
    cfg = Config(tests=["send_lat", "msg_rate", "send_bw"], sizes=[64, 4096], iters=30,
                 warmup=5, window=4, rate_window=8, max_seconds=2.0, loop="asyncio")
    server = asyncio.get_running_loop().create_task(worker.serve("ucxx-block", cfg))
    info: dict[str, Any] | None = None
    out = ""
    for _ in range(200):  # the READY line, within 2 s
        await asyncio.sleep(0.01)
        out += capsys.readouterr().out
        if "READY " in out:
            info = json.loads(out.split("READY ", 1)[1].splitlines()[0])
            break
    assert info is not None, out
    rc = await asyncio.wait_for(worker.client("ucxx-block", cfg, info), 30)
    await asyncio.wait_for(server, 30)
    out = capsys.readouterr().out
    results = [json.loads(ln[len("RESULT "):]) for ln in out.splitlines()
               if ln.startswith("RESULT ")]
    assert rc == 0, out
    assert [(r["test"], r["size"]) for r in results] == cfg.items()
    for r in results:
        assert r["transport"] == "ucxx-block" and r["error"] is None
        assert r["ops"] > 0 and r["msgs_per_s"] > 0 and r["cpu_us_per_op"] is not None
        if r["test"] == "send_lat":
            assert r["lat_median_us"] > 0 and r["window"] == 1
        else:
            assert r["window"] == cfg.window_for(r["test"])
    assert [mode for _, mode in fake_ucxx.state["inits"]] == ["blocking", "blocking"]


# ----------------------------------------------------------------- the real baseline
@pytest.mark.multiprocess
@pytest.mark.skipif(not HAVE_UCXX, reason="ucxx is not installed (make bench-ucxx installs "
                                          "it into build/ucxx-venv)")
def test_real_ucxx_baselines_run_a_few_operations() -> None:
    why = ub.unavailable_reason()
    if why is not None:
        pytest.skip(f"UCXX cannot run here: {why}")
    p = subprocess.run([sys.executable, "-m", "aiordma", "bench", "--no-aiordma",
                        "--tests", "send_lat,msg_rate", "--sizes", "64", "--iters", "20",
                        "--warmup", "2", "--max-seconds", "1", "--loop", "asyncio",
                        "--baselines", "ucxx-poll,ucxx-block", "--json"],
                       capture_output=True, text=True, timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(ln) for ln in p.stdout.splitlines() if ln.startswith("{")]
    got = {(r["transport"], r["test"]) for r in rows if r["error"] is None and r["ops"] > 0}
    assert got == {(b, t) for b in ("ucxx-poll", "ucxx-block")
                   for t in ("send_lat", "msg_rate")}, p.stderr[-3000:]
