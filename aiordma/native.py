"""The optional native build (``make native``, see setup.py): which modules of the hot
path are compiled with mypyc, whether this process runs them, and the class decorator
that tells mypyc how to compile a class (a no-op where mypy_extensions is absent).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import os
import warnings
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from mypy_extensions import mypyc_attr
else:
    try:
        from mypy_extensions import mypyc_attr
    except ImportError:  # a pure-Python install: the decorator only matters to mypyc

        def mypyc_attr(*args: object, **kwargs: object):
            return lambda cls: cls


__all__ = ["mypyc_attr", "MODULES", "compiled_modules", "build", "stale_modules",
           "warn_if_stale"]

#: the modules ``make native`` compiles (setup.py reads this list)
MODULES: tuple[str, ...] = (
    "aiordma.endpoint",
    "aiordma.resources",
    "aiordma.lifecycle",
    "aiordma.protocol.engine",
    "aiordma.protocol.sender",
    "aiordma.protocol.receiver",
    "aiordma.protocol.ops",
    "aiordma.protocol.state",
    "aiordma.cq_reactor",
    "aiordma.spin_policy",
    "aiordma.protocol.sendq",
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


#: the shared library of the compiled modules (setup.py's mypyc group name)
SHARED_LIB: Final = "aiordma._native__mypyc"

#: a source counts as edited after its extension only if newer by more than this (files
#: unpacked together, as by an install, may differ by a little)
STALE_AFTER_S = 2.0


def _extension_mtime(base: str) -> float | None:
    """The modification time of the extension module ``base`` + one of this Python's
    extension suffixes, or None where there is none."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        try:
            return os.path.getmtime(base + suffix)
        except OSError:
            continue
    return None


def stale_modules(root: str | None = None) -> list[str]:
    """The modules of ``MODULES`` whose compiled extension, next to the source where
    ``make native`` leaves it, is older than the source: Python imports the extension,
    so the process would run the code of before the edit. ``root`` is the directory
    that holds the ``aiordma`` package (default: this one's). Imports nothing."""
    if root is None:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    # Each module's extension is a small shim that mypyc's build leaves alone when it did
    # not change; the compiled code itself is in the group's shared library (setup.py).
    built = _extension_mtime(os.path.join(root, *SHARED_LIB.split("."))) or 0.0
    out = []
    for name in MODULES:
        base = os.path.join(root, *name.split("."))
        ext_mtime = _extension_mtime(base)
        if ext_mtime is None:
            continue
        try:
            src_mtime = os.path.getmtime(base + ".py")
        except OSError:
            continue
        if src_mtime - max(ext_mtime, built) > STALE_AFTER_S:
            out.append(name)
    return out


def warn_if_stale(root: str | None = None) -> list[str]:
    """Emit a RuntimeWarning naming the ``stale_modules(root)``, if any; return them.
    ``import aiordma`` calls it once."""
    stale = stale_modules(root)
    if stale:
        warnings.warn(
            f"aiordma: the native build is older than the sources of {', '.join(stale)}: "
            "this process runs the compiled code of before the edit (make native rebuilds "
            "it, make clean-native removes it)", RuntimeWarning, stacklevel=2)
    return stale
