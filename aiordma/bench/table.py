"""The console report of ``aiordma bench``: each (transport, test, size) reduced to its
median round (``median_of_rounds``), aiordma's ratio to every baseline of the same test
and size (``add_ratios``), and the tables printed at the end of a run
(``format_table``). The results document and the manual's Markdown table are
``report.py``'s.
"""

from __future__ import annotations

from .common import (
    ALL_TESTS,
    BW_TESTS,
    EXTERNAL_BASELINES,
    LAT_TESTS,
    REFERENCE,
    SOCKET_BASELINES,
    Result,
    fmt_size,
    primary,
)


def median_of_rounds(rounds: list[list[Result]]) -> list[Result]:
    """Per (transport, test, size): the round whose primary figure is the median (each
    result keeps the figures of all rounds in ``extra["rounds"]``)."""
    if len(rounds) == 1:
        return rounds[0]
    groups: dict[tuple[str, str, int], list[Result]] = {}
    for rnd in rounds:
        for r in rnd:
            groups.setdefault((r.transport, r.test, r.size), []).append(r)
    out = []
    for rs in groups.values():
        ok = [r for r in rs if r.error is None and primary(r) is not None]
        if not ok:
            out.append(rs[0])
            continue
        ok.sort(key=lambda r: primary(r) or 0.0)
        pick = ok[(len(ok) - 1) // 2]
        pick.extra = dict(pick.extra, rounds=[primary(r) for r in rs])
        out.append(pick)
    return out


def add_ratios(results: list[Result]) -> None:
    """For each aiordma result, ratios to the baselines of the same test and size:
    ``lat`` (median, lower is better), ``gbps``, ``rate`` (higher is better), ``cpu``
    (CPU per operation, lower is better), ``memcpy`` (fraction of the copy ceiling)."""
    index = {(r.transport, r.test, r.size): r for r in results if r.error is None}
    mem = {r.size: r for r in results if r.transport == "memcpy" and r.error is None}
    for r in results:
        if r.transport != "aiordma" or r.error is not None:
            continue
        for (tr, test, size), b in index.items():
            if tr == "aiordma" or test != r.test or size != r.size:
                continue
            d: dict[str, float] = {}
            if r.lat_median_us and b.lat_median_us:
                d["lat"] = r.lat_median_us / b.lat_median_us
            if r.test not in LAT_TESTS and r.gbps and b.gbps:
                d["gbps"] = r.gbps / b.gbps
            if r.msgs_per_s and b.msgs_per_s:
                d["rate"] = r.msgs_per_s / b.msgs_per_s
            if r.cpu_us_per_op and b.cpu_us_per_op:
                d["cpu"] = r.cpu_us_per_op / b.cpu_us_per_op
            r.ratios[tr] = d
        m = mem.get(r.size)
        if m is not None and r.test in BW_TESTS and r.gbps and m.gbps:
            r.ratios["memcpy"] = {"gbps": r.gbps / m.gbps}


def _f(v: float | None, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _rate(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1e6:
        return f"{v / 1e6:.2f}M"
    if v >= 1e3:
        return f"{v / 1e3:.1f}k"
    return f"{v:.0f}"


def _ratio_key(test: str) -> str:
    return "lat" if test in LAT_TESTS else "gbps" if test in BW_TESTS else "rate"


def format_table(results: list[Result], baselines: list[str]) -> str:
    """The run's table (each result, its ratio to the reference: ``tcp-proto`` where it
    ran, else the first baseline that did), then a summary of aiordma against each
    baseline, the cost rows and the reactor micro-benchmark's, where they ran."""
    lines: list[str] = []
    w = lines.append
    # the ratio column: tcp-proto when it ran, else the first baseline that ran
    ran = {r.transport for r in results if r.error is None}
    reference = next((b for b in (REFERENCE, *baselines) if b in ran and b != "memcpy"),
                     REFERENCE)
    head = (f"{'test':10s} {'size':>5s} {'transport':13s} {'median':>8s} {'p99':>8s} {'min':>8s}"
            f" {'GB/s':>8s} {'msgs/s':>8s} {'cpu/op':>8s}  ratio to {reference}")
    w("Latencies are round trips in microseconds; GB/s = 1e9 B/s of payload; cpu/op = CPU "
      "microseconds per operation, both processes (every thread) together.")
    w("ratio: lat = median/baseline (lower is better), bw and msgs/s = aiordma/baseline "
      "(higher is better), cpu = cpu/op ratio.")
    w("")
    w(head)
    w("-" * len(head))
    order = {t: i for i, t in enumerate((*ALL_TESTS, "memcpy"))}
    tr_order = {t: i for i, t in enumerate(("aiordma", *SOCKET_BASELINES, *EXTERNAL_BASELINES,
                                            "memcpy", "reactor-fake", "reactor-future",
                                            "reactor-soft"))}
    rows = sorted(results, key=lambda r: (order.get(r.test, 99), r.size,
                                          tr_order.get(r.transport, 99)))
    prev = None
    for r in rows:
        if r.test in ("reactor", "cost") or r.test.startswith("comm_") or r.test == "rechunk":
            continue
        if prev is not None and (r.test, r.size) != prev:
            w("")
        prev = (r.test, r.size)
        if r.error:
            w(f"{r.test:10s} {fmt_size(r.size):>5s} {r.transport:13s} ERROR {r.error}")
            continue
        lat = r.test in LAT_TESTS
        gb = r.gbps if (not lat and r.test != "msg_rate") else None
        ratio = ""
        ref = r.ratios.get(reference)
        if ref:
            k = _ratio_key(r.test)
            ratio = f"{_f(ref.get(k), '.2f')}x"
            if "cpu" in ref:
                ratio += f" (cpu {ref['cpu']:.2f}x)"
        if "memcpy" in r.ratios:
            ratio += f" memcpy {r.ratios['memcpy']['gbps'] * 100:.0f}%"
        w(f"{r.test:10s} {fmt_size(r.size):>5s} {r.transport:13s} "
          f"{_f(r.lat_median_us if lat else None):>8s} {_f(r.lat_p99_us if lat else None):>8s} "
          f"{_f(r.lat_min_us if lat else None):>8s} {_f(gb, '.3f'):>8s} "
          f"{_rate(r.msgs_per_s):>8s} {_f(r.cpu_us_per_op):>8s}  {ratio}")
    # summary: the primary figure of each transport and the aiordma ratios
    aio = [r for r in rows if r.transport == "aiordma" and r.error is None
           and r.test in (*LAT_TESTS, *BW_TESTS, "msg_rate")]
    if aio:
        socks = [b for b in baselines if b in SOCKET_BASELINES or b in EXTERNAL_BASELINES]
        w("")
        w("Summary: aiordma vs each baseline (median us for *_lat, GB/s for *_bw, msgs/s for "
          "msg_rate; ratio = aiordma / baseline)")
        head2 = f"{'test':10s} {'size':>5s} {'aiordma':>9s}" + "".join(
            f" {b:>13s} {'ratio':>6s}" for b in socks) + ("  memcpy%" if "memcpy" in baselines else "")
        w(head2)
        w("-" * len(head2))
        idx = {(r.transport, r.test, r.size): r for r in results if r.error is None}
        for r in aio:
            k = _ratio_key(r.test)
            v = primary(r)
            fmt = (lambda x: _f(x, ".1f")) if k == "lat" else (
                (lambda x: _f(x, ".3f")) if k == "gbps" else _rate)
            line = f"{r.test:10s} {fmt_size(r.size):>5s} {fmt(v):>9s}"
            for b in socks:
                br = idx.get((b, r.test, r.size))
                bv = primary(br) if br else None
                rv = r.ratios.get(b, {}).get(k)
                rs = f"{rv:.2f}x" if rv else "-"
                line += f" {fmt(bv):>13s} {rs:>6s}"
            if "memcpy" in baselines:
                m = r.ratios.get("memcpy")
                line += f"  {m['gbps'] * 100:6.1f}%" if m else "       -"
            w(line)
    cost = [r for r in results if r.test == "cost"]
    if cost:
        from .cost import format_rows

        lines.extend(format_rows(cost))
    reactor = [r for r in results if r.test == "reactor"]
    if reactor:
        w("")
        w("Reactor micro-benchmark (one process; target <= 3 us per completion at batch >= 16)")
        head3 = (f"{'variant':15s} {'batch':>5s} {'compl/s':>9s} {'us/compl':>9s} "
                 f"{'cpu us/compl':>12s} {'compl/wake':>10s}")
        w(head3)
        w("-" * len(head3))
        for r in reactor:
            if r.error:
                w(f"{r.transport:15s} {r.size:5d} ERROR {r.error}")
                continue
            cpw = r.extra.get("completions_per_wakeup")
            w(f"{r.transport:15s} {r.size:5d} {_rate(r.msgs_per_s):>9s} {_f(r.lat_mean_us, '.2f'):>9s} "
              f"{_f(r.cpu_us_per_op, '.2f'):>12s} {_f(cpw, '.1f'):>10s}")
    return "\n".join(lines)
