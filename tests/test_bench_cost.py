"""``aiordma bench --tests cost``: the harness runs both clients and counts their Python
calls (valgrind's instruction counts are left to the benchmark itself: minutes)."""

from __future__ import annotations

import pytest

from aiordma.bench import cost
from aiordma.bench.common import Config


@pytest.fixture
def no_valgrind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cost.shutil, "which", lambda name: None)
    monkeypatch.setattr(cost, "CALLS_N", 200)


@pytest.mark.usefixtures("no_valgrind")
def test_both_clients_run_and_count_calls(provider_name: str) -> None:
    cfg = Config(tests=["cost"], sizes=[64], loop="asyncio", provider=provider_name)
    results = cost.bench(cfg)
    assert [r.transport for r in results] == ["aiordma", "tcp-proto"]
    for r in results:
        assert r.error is None, r.error
        assert r.extra["python_calls_per_rt"] > 0
        assert r.extra["instructions_note"] == "valgrind not installed"
    aio, tcp = results
    assert aio.extra["python_calls_ratio"] == pytest.approx(
        aio.extra["python_calls_per_rt"] / tcp.extra["python_calls_per_rt"])
    rows = "\n".join(cost.format_rows(results))
    assert "aiordma" in rows and "tcp-proto" in rows and "valgrind not installed" in rows


def test_rows_show_instructions_and_their_ratio() -> None:
    from aiordma.bench.common import Result

    aio = Result("aiordma", "cost", 64, note="client, blocking",
                 extra={"instructions_per_rt": 30000.0, "python_calls_per_rt": 5.0,
                        "instructions_ratio": 2.5})
    tcp = Result("tcp-proto", "cost", 64, note="client",
                 extra={"instructions_per_rt": 12000.0, "python_calls_per_rt": 4.0})
    rows = cost.format_rows([aio, tcp])
    assert any("30,000" in r and "2.50x" in r for r in rows)
    assert any("12,000" in r for r in rows)


def test_pyverbs_async_runs_on_verbs_only() -> None:
    cfg = Config(tests=["cost"], sizes=[64], loop="asyncio", provider="soft")
    with pytest.raises(ValueError, match="verbs provider"):
        cost.bench(cfg, ["pyverbs-async"])


def test_pyverbs_async_client_runs_beside_aiordma(provider_name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """On verbs, ``--baselines pyverbs-async`` adds the bare asyncio program over pyverbs
    as a third client (the other baselines are not the cost test's); its server connects
    one QP, so each of its three client runs gets a server of its own. (callgrind is
    stood in for: each counted run runs its client plainly, "counting" 1000 per round
    trip.)"""
    if provider_name != "verbs":
        pytest.skip("pyverbs-async: the verbs provider's baseline")
    import subprocess

    def run_plainly(args: list[str], timeout: float) -> int:
        subprocess.run(args, check=True, timeout=timeout, env=cost._env(),
                       capture_output=True)
        return int(args[6]) * 1000  # (the client's round trips)

    monkeypatch.setattr(cost, "CALLS_N", 100)
    monkeypatch.setattr(cost, "N1", 20)
    monkeypatch.setattr(cost, "N2", 60)
    monkeypatch.setattr(cost, "_instructions", run_plainly)
    monkeypatch.setattr(cost.shutil, "which", lambda name: "/bin/true")
    cfg = Config(tests=["cost"], sizes=[64], loop="asyncio", provider="verbs")
    results = cost.bench(cfg, ["tcp-proto", "pyverbs-async", "ucxx-poll"])
    assert [r.transport for r in results] == ["aiordma", "tcp-proto", "pyverbs-async"]
    for r in results:
        assert r.error is None, r.error
        assert r.extra["python_calls_per_rt"] > 0
        assert r.extra["instructions_per_rt"] == 1000
    assert results[2].extra["aiordma_instructions_ratio"] == 1.0
    rows = "\n".join(cost.format_rows(results))
    assert "pyverbs-async" in rows and "(aiordma: 1.00x this)" in rows


def test_a_baseline_row_shows_aiordma_against_it() -> None:
    from aiordma.bench.common import Result

    pva = Result("pyverbs-async", "cost", 64, note="client, polls its CQ from the loop",
                 extra={"instructions_per_rt": 20000.0, "python_calls_per_rt": 30.0,
                        "aiordma_instructions_ratio": 1.25})
    (row,) = [r for r in cost.format_rows([pva]) if "pyverbs-async" in r]
    assert "20,000" in row and "(aiordma: 1.25x this)" in row
