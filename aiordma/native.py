"""The optional native build (``make native``, see setup.py): which modules of the hot
path are compiled with mypyc, whether this process runs them, and the class decorator
that tells mypyc how to compile a class (a no-op where mypy_extensions is absent).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # a pure-Python install: the decorator only matters to mypyc

        def mypyc_attr(*args: object, **kwargs: object):  # noqa: ANN202
            return lambda cls: cls


__all__ = ["mypyc_attr", "MODULES", "compiled_modules", "build"]

#: the modules ``make native`` compiles (setup.py reads this list)
MODULES: tuple[str, ...] = (
    "aiordma.endpoint",
    "aiordma.cq_reactor",
    "aiordma.sendq",
    "aiordma.memory",
    "aiordma.protocol.credits",
    "aiordma.verbs.wr",
    "aiordma.verbs.contract",
    "aiordma.verbs.soft.qpcore",
    "aiordma.verbs.soft.requester",
    "aiordma.verbs.soft.responder",
    "aiordma.verbs.soft.qp",
    "aiordma.verbs.soft.conn",
    "aiordma.verbs.soft.cq",
    "aiordma.verbs.soft.wire",
    "aiordma.verbs.soft.mr",
    "aiordma.verbs.soft.notify",
)


def compiled_modules() -> list[str]:
    """The modules of ``MODULES`` this process imported (or imports now) as compiled
    extensions rather than ``.py`` sources."""
    out = []
    for name in MODULES:
        mod = importlib.import_module(name)
        if not (getattr(mod, "__file__", None) or "").endswith(".py"):
            out.append(name)
    return out


def build() -> str:
    """``"mypyc"`` when every module of ``MODULES`` runs compiled, ``"python"`` when
    none does, ``"mixed"`` otherwise (a partial or stale build)."""
    n = len(compiled_modules())
    return "mypyc" if n == len(MODULES) else "python" if n == 0 else "mixed"
