"""``aiordma bench --plot FILE.png``: the results against message size (needs the
``plot`` extra, matplotlib)."""

from __future__ import annotations

from .common import BW_TESTS, LAT_TESTS, Result, primary


def plot(results: list[Result], path: str, title: str) -> None:
    """Draw every test's primary figure against message size, one panel a test, each
    transport a line (memcpy dashed in the bandwidth panels), into the PNG ``path``.
    Raises SystemExit when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise SystemExit("bench: --plot needs matplotlib (pip install 'aiordma[plot]')") from None
    tests = [t for t in (*LAT_TESTS, *BW_TESTS, "msg_rate")
             if any(r.test == t and r.error is None for r in results)]
    if not tests:
        raise SystemExit("bench: nothing to plot (every test failed)")
    cols = min(4, len(tests))
    rows = (len(tests) + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, test in zip((a for row in axes for a in row), tests, strict=False):
        by_tr: dict[str, list[tuple[int, float]]] = {}
        for r in results:
            v = primary(r)
            if r.test == test and r.error is None and v:
                by_tr.setdefault(r.transport, []).append((r.size, v))
        if test in BW_TESTS:
            for r in results:
                if r.transport == "memcpy" and r.gbps:
                    by_tr.setdefault("memcpy", []).append((r.size, r.gbps))
        for tr, pts in sorted(by_tr.items(), key=lambda kv: kv[0] != "aiordma"):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o" if len(pts) > 1 else "s",
                    label=tr, linewidth=2.5 if tr == "aiordma" else 1.2,
                    linestyle="--" if tr == "memcpy" else "-")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(test)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("round trip (us)" if test in LAT_TESTS else
                      "GB/s" if test in BW_TESTS else "msgs/s")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(a for row in axes for a in row)[len(tests):]:
        ax.axis("off")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
