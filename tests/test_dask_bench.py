"""aiordma.dask.bench: tcp:// against rdma:// (a short run, and the table's arithmetic)."""

from __future__ import annotations

import pytest

pytest.importorskip("distributed", minversion="2024.12.1")  # (aiordma[dask])
pytest.importorskip("numpy")

from _dask import HOST  # noqa: E402

from aiordma.dask import bench  # noqa: E402

pytestmark = [pytest.mark.dask, pytest.mark.multiprocess]


def test_short_run_gives_both_schemes_and_ratios(provider_name: str,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIORDMA_PROVIDER", provider_name)
    rows = bench.run(("tcp", "rdma"), sizes=[512 * 1024], iters=5, bw_iters=2,
                     max_seconds=1, cluster_mib=0, host=HOST)
    got = {(r["test"], r["transport"]) for r in rows}
    assert got == {(t, s) for t in ("comm_rtt", "comm_bw") for s in ("tcp", "rdma")}
    for r in rows:
        assert r["ops"] >= 1 and r["seconds"] > 0
        if r["transport"] == "rdma":
            assert r["ratios"]["tcp"]["speedup"] > 0
    table = bench.format_table(rows)
    assert "rdma vs tcp" in table and "512 KiB" in table


def test_ratios_and_table() -> None:
    rows = [
        {"transport": "tcp", "test": "comm_rtt", "size": 64, "lat_median_us": 300.0},
        {"transport": "rdma", "test": "comm_rtt", "size": 64, "lat_median_us": 100.0},
        {"transport": "tcp", "test": "comm_bw", "size": 1 << 20, "gbps": 1.0},
        {"transport": "rdma", "test": "comm_bw", "size": 1 << 20, "gbps": 2.5},
        {"transport": "tcp", "test": "rechunk", "size": 8, "seconds": 4.0,
         "extra": {"checksum": 1.0}},
        {"transport": "rdma", "test": "rechunk", "size": 8, "seconds": 2.0,
         "extra": {"checksum": 2.0}},
    ]
    bench.add_ratios(rows)
    assert [r.get("ratios", {}).get("tcp", {}).get("speedup") for r in rows] == [
        None, 3.0, None, 2.5, None, 2.0]
    table = bench.format_table(rows)
    assert "3.00x" in table and "2.50x" in table and "1 MiB" in table
    assert "checksums differ" in table


def test_median_of_rounds() -> None:
    def rtt(us: float) -> dict:
        return {"transport": "rdma", "test": "comm_rtt", "size": 64, "lat_median_us": us}

    [row] = bench.median_of_rounds([[rtt(300.0)], [rtt(100.0)], [rtt(200.0)]])
    assert row["lat_median_us"] == 200.0 and row["extra"]["rounds"] == [300.0, 100.0, 200.0]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="unknown scheme"):
        bench.run(("udp",), cluster_mib=0)
    with pytest.raises(ValueError, match="positive"):
        bench.run(("tcp",), iters=0)
    with pytest.raises(ValueError, match="positive"):
        bench.run(("tcp",), rounds=0)
    with pytest.raises(ValueError, match="not a size"):
        bench.parse_size("lots")
    assert bench.parse_size("16M") == 16 << 20 and bench.parse_size("64") == 64
