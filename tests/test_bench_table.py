"""``aiordma.bench.table``: the median round, the ratios to each baseline and the console
table of a bench run, on results made by hand."""

from __future__ import annotations

from aiordma.bench.common import Result
from aiordma.bench.table import add_ratios, format_table, median_of_rounds


def _lat(transport: str, us: float, cpu: float | None = None) -> Result:
    return Result(transport, "send_lat", 64, ops=10, lat_median_us=us, lat_p99_us=us * 2,
                  lat_min_us=us / 2, cpu_us_per_op=cpu)


def test_the_median_round_is_kept_with_every_rounds_figure() -> None:
    rounds = [[_lat("aiordma", 30.0)], [_lat("aiordma", 10.0)], [_lat("aiordma", 20.0)]]
    [r] = median_of_rounds(rounds)
    assert r.lat_median_us == 20.0 and r.extra["rounds"] == [30.0, 10.0, 20.0]
    assert median_of_rounds([[_lat("aiordma", 5.0)]])[0].lat_median_us == 5.0


def test_a_round_that_failed_is_not_the_median() -> None:
    bad = Result("aiordma", "send_lat", 64, error="boom")
    [r] = median_of_rounds([[bad], [_lat("aiordma", 7.0)]])
    assert r.error is None and r.lat_median_us == 7.0


def test_ratios_to_each_baseline_of_the_same_test_and_size() -> None:
    aio = _lat("aiordma", 30.0, cpu=60.0)
    tcp = _lat("tcp-proto", 20.0, cpu=20.0)
    other_size = Result("tcp-proto", "send_lat", 4096, lat_median_us=1.0)
    bw = Result("aiordma", "send_bw", 1 << 20, gbps=2.0)
    mem = Result("memcpy", "memcpy", 1 << 20, gbps=8.0)
    bw_tcp = Result("tcp-proto", "send_bw", 1 << 20, gbps=4.0)
    add_ratios([aio, tcp, other_size, bw, mem, bw_tcp])
    assert aio.ratios == {"tcp-proto": {"lat": 1.5, "cpu": 3.0}}
    assert bw.ratios == {"tcp-proto": {"gbps": 0.5}, "memcpy": {"gbps": 0.25}}
    assert tcp.ratios == {}  # only aiordma's results get ratios


def test_the_table_names_the_reference_and_each_ratio() -> None:
    results = [_lat("aiordma", 30.0, cpu=60.0), _lat("tcp-proto", 20.0, cpu=20.0),
               Result("unix-proto", "send_lat", 64, error="refused")]
    add_ratios(results)
    text = format_table(results, ["tcp-proto", "unix-proto"])
    assert "ratio to tcp-proto" in text
    row = next(ln for ln in text.splitlines() if ln.startswith("send_lat") and "aiordma" in ln)
    assert "1.50x (cpu 3.00x)" in row
    assert any("unix-proto" in ln and "ERROR refused" in ln for ln in text.splitlines())
    assert "Summary: aiordma vs each baseline" in text
