"""Results as data: ``aiordma bench --save FILE.json`` writes a results document, and
this module renders it as the Markdown table of the manual and docs/benchmarks.md.

    python -m aiordma.bench.report FILE.json              # print the table
    python -m aiordma.bench.report FILE.json --update README.md docs/benchmarks.md

A results document is one JSON object: ``date`` (UTC, ISO 8601), ``machine``,
``commit`` (the checkout's ``git describe --always --dirty``, or null outside one),
``build``, ``loop``, ``provider``, ``poll_mode``, ``command`` (the bench's arguments)
and ``results`` (every ``Result.to_dict()``, ratios included).

``--update`` rewrites, in each named file, the lines between a marker line
``<!-- results: PATH -->`` (PATH relative to the repository root, the document) and the
next ``<!-- /results -->`` with the rendered table; it raises ``ValueError`` when a
file has no complete marker pair for this document. ``rendered_blocks(text)`` yields
each marked block's document path, its current lines and the lines it should have
(tests compare them, so a table cannot drift from its data).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

from .common import BW_TESTS, LAT_TESTS, Result, primary

#: the baselines the table shows, in this order, when the document has them
COLUMNS = (("tcp-proto", "asyncio TCP"), ("unix-proto", "asyncio Unix"),
           ("pyverbs", "pyverbs (busy loop)"), ("pyverbs-async", "pyverbs + asyncio"),
           ("perftest", "perftest"))
MARK = re.compile(r"^<!-- results: (\S+) -->$")
END = "<!-- /results -->"


def commit_of(root: str) -> str | None:
    """``git describe --always --dirty`` of the checkout at ``root``, or None."""
    try:
        r = subprocess.run(["git", "-C", root, "describe", "--always", "--dirty"],
                           capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


def document(results: list[Result], *, machine: str, build: str, loop: str,
             provider: str | None, poll_mode: str | None, command: list[str],
             commit: str | None) -> dict[str, Any]:
    """The results document of one bench run (see the module docstring); ``commit`` is
    ``commit_of`` the checkout, taken when the run started."""
    now = datetime.datetime.now(datetime.UTC).replace(microsecond=0)
    return {"date": now.isoformat().replace("+00:00", "Z"), "machine": machine,
            "commit": commit, "build": build, "loop": loop,
            "provider": provider or "default", "poll_mode": poll_mode or "default",
            "command": command, "results": [r.to_dict() for r in results]}


def size_text(n: int) -> str:
    """64 -> '64 B', 4096 -> '4 KiB', 1048576 -> '1 MiB'."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _unit(test: str, v: float | None) -> str:
    if v is None:
        return "-"
    if test in LAT_TESTS:
        return f"{v:.0f} us" if v >= 10 else f"{v:.1f} us"
    if test in BW_TESTS:
        return f"{v:.3f} GB/s" if v < 1 else f"{v:.2f} GB/s"
    return f"{v / 1e3:.0f}k/s"


def render(doc: dict[str, Any]) -> list[str]:
    """The Markdown lines of a document: a header line, then one row per aiordma result
    with each shown baseline's figure and aiordma's ratio to it (latency: aiordma /
    baseline, lower is better; bandwidth and rate: aiordma / baseline, higher is
    better), and the CPU per operation of both processes together."""
    results = [Result(**r) for r in doc["results"]]
    by = {(r.transport, r.test, r.size): r for r in results if r.error is None}
    cols = [(k, name) for k, name in COLUMNS if any(t == k for t, _, _ in by)]
    head = ["test", "size", "aiordma"] + [f"{name} (ratio)" for _, name in cols] + [
        "aiordma CPU/op"]
    lines = [f"Measured {doc['date'][:10]} on {doc['machine']}; commit "
             f"`{doc['commit'] or 'unknown'}`, {doc['build']} build, {doc['loop']}, "
             f"provider {doc['provider']}, poll mode {doc['poll_mode']}; `aiordma bench "
             f"{' '.join(doc['command'])}`. Ratio = aiordma / baseline: lower is better for "
             "latency (`*_lat`), higher for bandwidth and rate.", "",
             "| " + " | ".join(head) + " |",
             "|" + "|".join(["---"] * 2 + ["---:"] * (len(head) - 2)) + "|"]
    for r in results:
        if r.transport != "aiordma" or r.test == "reactor":
            continue
        if r.error is not None:
            lines.append(f"| {r.test} | {size_text(r.size)} | error: {r.error} |")
            continue
        row = [r.test, size_text(r.size), _unit(r.test, primary(r))]
        for k, _name in cols:
            b = by.get((k, r.test, r.size))
            ratio = r.ratios.get(k, {}).get(
                "lat" if r.test in LAT_TESTS else "gbps" if r.test in BW_TESTS else "rate")
            figure = _unit(r.test, primary(b) if b else None)
            row.append(f"{figure} ({ratio:.2f}x)" if ratio else figure)
        row.append("-" if r.cpu_us_per_op is None else f"{r.cpu_us_per_op:.0f} us")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def _load(root: str, path: str) -> dict[str, Any]:
    with open(os.path.join(root, path)) as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def rendered_blocks(text: str, root: str) -> Iterator[tuple[str, list[str], list[str]]]:
    """(document path, current lines, rendered lines) of each marked block of ``text``."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = MARK.match(line)
        if not m:
            continue
        try:
            end = lines.index(END, i + 1)
        except ValueError:
            raise ValueError(f"{m.group(0)} has no {END} after it") from None
        yield m.group(1), lines[i + 1:end], render(_load(root, m.group(1)))


def update(path: str, doc_path: str, root: str) -> None:
    """Rewrite the blocks of ``path`` that show ``doc_path`` (see the module docstring)."""
    with open(path) as f:
        text = f.read()
    lines = text.splitlines()
    found = False
    for src, current, new in list(rendered_blocks(text, root)):
        if src != doc_path:
            continue
        found = True
        start = lines.index(f"<!-- results: {src} -->")
        lines[start + 1:start + 1 + len(current)] = new
    if not found:
        raise ValueError(f"{path}: no <!-- results: {doc_path} --> ... {END} block")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m aiordma.bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("document", help="a results document (aiordma bench --save)")
    p.add_argument("--update", nargs="+", metavar="FILE", default=[],
                   help="rewrite the marked results blocks of these files")
    a = p.parse_args(argv)
    root = os.getcwd()
    doc_path = os.path.relpath(os.path.abspath(a.document), root)
    if not a.update:
        print("\n".join(render(_load(root, doc_path))))
    for path in a.update:
        update(path, doc_path, root)
    return 0


if __name__ == "__main__":
    sys.exit(main())
