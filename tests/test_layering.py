"""The layers of docs/design.md: imports only go downward; pyverbs only in the verbs provider;
no asyncio in the sans-IO protocol package; no provider imports above aiordma/verbs/."""

from __future__ import annotations

import ast
import pathlib

PKG = pathlib.Path(__file__).resolve().parent.parent / "aiordma"

# Lower number = lower layer. A module may import only modules of its own or a lower
# layer (leaf modules such as errors are layer 0).
LAYERS: dict[str, int] = {
    "errors": 0,
    "tcp_backoff": 0,  # the cap of TCP's back-off (the soft device's and the setup connections)
    "native": 0,  # the build shim; build() imports its MODULES only when called
    "verbs": 1,
    "protocol": 1,
    "memory": 2,
    "waiters": 2,  # the futures the endpoint's operations await, made and resolved cheaply
    "options": 2,
    "acceptor": 2,
    "cq_reactor": 3,
    "wr_table": 3,  # who receives a completion: the reactor's wr_id handlers and engines
    "poll_schedule": 3,  # the reactor's poll modes (it imports CQReactor for types only)
    "spin_policy": 2,
    "device": 4,
    "liveness": 4,
    "resources": 5,
    "lifecycle": 5,
    "endpoint": 6,
    "onesided": 6,  # the endpoint's one-sided operations (it imports Endpoint for types only)
    "receiving": 6,  # the waits of the endpoint's receives (likewise)
    "sending": 6,  # the send side's slow paths (likewise)
    "connection": 7,
    "listener": 7,
    "transport": 8,
    "rdma_transport": 8,
    "flow_control": 8,  # the transports' write flow control (asyncio's)
    "rdma_server": 8,
    "streams": 9,
    "dask": 10,  # the rdma:// backend of distributed, over the public API
    "__init__": 10,
    "__main__": 11,
    "bench": 11,
    "doctor": 11,
}


def _module_key(path: pathlib.Path) -> str:
    rel = path.relative_to(PKG)
    return rel.parts[0].removesuffix(".py")


def _imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute dotted target, line) for every import in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    rel = path.relative_to(PKG.parent).with_suffix("")
    pkg_parts = list(rel.parts[:-1]) if rel.name != "__init__" else list(rel.parts[:-1])
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:
                    out += [(f"{mod}.{a.name}", node.lineno) for a in node.names]
                    continue
            else:
                mod = node.module or ""
            out.append((mod, node.lineno))
    return out


def _files() -> list[pathlib.Path]:
    return sorted(PKG.rglob("*.py"))


def test_imports_only_go_downward() -> None:
    bad = []
    for f in _files():
        src = _module_key(f)
        if src not in LAYERS:
            bad.append(f"{f}: module {src!r} has no layer in tests/test_layering.py")
            continue
        for target, line in _imports(f):
            if not target.startswith("aiordma."):
                continue
            dst = target.split(".")[1]
            if dst == src:
                continue
            if dst not in LAYERS:
                bad.append(f"{f}:{line}: imports unknown module {target}")
            elif LAYERS[dst] > LAYERS[src] and src != "__init__":
                bad.append(f"{f}:{line}: {src} (layer {LAYERS[src]}) imports {target} "
                           f"(layer {LAYERS[dst]})")
    assert not bad, "\n".join(bad)


#: the benchmark harness: its ``pyverbs`` baselines are the bare pyverbs programs aiordma
#: is measured against (they reuse the verbs provider's compatibility shims), so the two
#: provider rules below do not bind it; it sits above everything else (layer 10)
BENCH = PKG / "bench"


def _library_files() -> list[pathlib.Path]:
    return [f for f in _files() if BENCH not in f.parents]


def test_pyverbs_only_in_the_verbs_provider() -> None:
    allowed = PKG / "verbs" / "ibverbs"
    bad = [f"{f}:{line}: {t}" for f in _library_files() for t, line in _imports(f)
           if t.split(".")[0] == "pyverbs" and allowed not in f.parents and f != allowed.with_suffix(".py")]
    assert not bad, "\n".join(bad)


def test_protocol_is_sans_io() -> None:
    forbidden = {"asyncio", "socket", "selectors", "threading", "aiordma.verbs"}
    records = {"aiordma.verbs.wr"}  # work requests and completions: plain records
    bad = [f"{f}:{line}: {t}" for f in (PKG / "protocol").rglob("*.py") for t, line in _imports(f)
           if t not in records and any(t == x or t.startswith(x + ".") for x in forbidden)]
    assert not bad, "\n".join(bad)


def test_no_provider_imports_above_verbs() -> None:
    bad = [f"{f}:{line}: {t}" for f in _library_files()
           if "verbs" not in f.relative_to(PKG).parts[:1]
           for t, line in _imports(f)
           if t.startswith("aiordma.verbs.soft") or t.startswith("aiordma.verbs.ibverbs")]
    assert not bad, "\n".join(bad)


def test_asyncio_only_above_the_reactor() -> None:
    low = ("errors", "verbs", "protocol", "memory", "options")
    bad = [f"{f}:{line}" for f in _files() if _module_key(f) in low
           for t, line in _imports(f) if t == "asyncio"]
    assert not bad, "event-loop code below cq_reactor: " + ", ".join(bad)
