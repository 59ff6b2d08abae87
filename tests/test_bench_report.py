"""Results as data (aiordma/bench/report.py): a results document renders as the
manual's table, and a marked block of a Markdown file is rewritten from it."""

from __future__ import annotations

import json
import pathlib

import pytest

from aiordma.bench.common import Result
from aiordma.bench.report import document, render, rendered_blocks, size_text, update


def _doc() -> dict:
    aio = Result("aiordma", "send_lat", 64, lat_median_us=50.0, cpu_us_per_op=80.0,
                 ratios={"tcp-proto": {"lat": 0.5}})
    tcp = Result("tcp-proto", "send_lat", 64, lat_median_us=100.0)
    bw = Result("aiordma", "write_bw", 1 << 20, gbps=8.0, ratios={"tcp-proto": {"gbps": 2.0}})
    tcp_bw = Result("tcp-proto", "write_bw", 1 << 20, gbps=4.0)
    bad = Result("aiordma", "read_lat", 4096, error="timed out")
    return document([aio, tcp, bw, tcp_bw, bad], machine="M", build="python", loop="uvloop",
                    provider="soft", poll_mode=None, command=["--tests", "send_lat"],
                    commit="abc1234")


def test_render() -> None:
    lines = render(_doc())
    assert lines[0].startswith("Measured ") and "commit `abc1234`" in lines[0]
    assert "poll mode default" in lines[0] and "`aiordma bench --tests send_lat`" in lines[0]
    assert lines[2] == "| test | size | aiordma | asyncio TCP (ratio) | aiordma CPU/op |"
    assert lines[4:] == ["| send_lat | 64 B | 50 us | 100 us (0.50x) | 80 us |",
                         "| write_bw | 1 MiB | 8.00 GB/s | 4.00 GB/s (2.00x) | - |",
                         "| read_lat | 4 KiB | error: timed out |"]


def test_size_text() -> None:
    assert [size_text(n) for n in (8, 4096, 1 << 20, 3 << 29, 1000)] == [
        "8 B", "4 KiB", "1 MiB", "1536 MiB", "1000 B"]


def test_update_rewrites_only_its_block(tmp_path: pathlib.Path) -> None:
    (tmp_path / "r.json").write_text(json.dumps(_doc()))
    md = tmp_path / "x.md"
    md.write_text("intro\n<!-- results: r.json -->\nstale\n<!-- /results -->\nafter\n")
    update(str(md), "r.json", str(tmp_path))
    text = md.read_text()
    assert text.startswith("intro\n<!-- results: r.json -->\nMeasured ")
    assert text.endswith("| read_lat | 4 KiB | error: timed out |\n<!-- /results -->\nafter\n")
    ((path, current, rendered),) = rendered_blocks(text, str(tmp_path))
    assert path == "r.json" and current == rendered
    with pytest.raises(ValueError, match="no <!-- results: other.json -->"):
        update(str(md), "other.json", str(tmp_path))
    md.write_text("<!-- results: r.json -->\nno end marker\n")
    with pytest.raises(ValueError, match="has no <!-- /results -->"):
        update(str(md), "r.json", str(tmp_path))
