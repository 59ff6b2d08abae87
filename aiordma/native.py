"""The compiled build (setup.py): what is compiled, with which compiler, and what this
process runs.

* ``EXTENSIONS`` -- Cython modules: C code on C data (``.pyx``/``.pxd`` files in the
  package). ``setup.py`` builds them by default (``pip install``, ``make native``) where
  a C compiler, Cython and the C headers each one needs are found; one left out leaves
  its pure-Python path in charge, and the build records why (``BUILD_INFO``).
* ``MODULES`` -- Python modules of the per-message path compiled as they are by mypyc,
  one group (``MYPYC_GROUP``) built by default too where mypy (a build requirement in
  pyproject.toml) and a C compiler are found; all of them or none, the build records
  why (``AIORDMA_MYPYC``: ``auto``, ``1`` required, ``0`` never). mypyc uses the type
  hints to compile classes and attribute access; it measured about half the
  instructions per message of the pure sources, where Cython compiling the same Python
  modules measured no gain (docs/history/compilers-2026-12-01.json). Cython serves where
  the code is written for C.

``build()`` says which compiled pieces this process runs and why the others do not;
``mypyc_attr`` tells mypyc how to compile a class (a no-op where mypy_extensions is
absent).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.machinery
import importlib.util
import json
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


__all__ = ["mypyc_attr", "MODULES", "MYPYC_GROUP", "EXTENSIONS", "Build", "compiled_modules", "build",
           "stale_modules", "warn_if_stale"]

#: The Cython extension modules setup.py builds, as ``(tag, module, C headers it
#: needs)``: the source is the module's ``.pyx`` (its ``.pxd`` beside it); ``tag`` names
#: it in ``build()``. Add a module here to build it; setup.py reads this literal.
EXTENSIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    # the verbs provider's queue accounting (verbs/ibverbs/queues.pyx): the provider needs
    # it, and the compiled posts and polls below account for their work requests in it
    ("queues", "aiordma.verbs.ibverbs.queues", ()),
    # the verbs provider's posts and polls through libibverbs (verbs/ibverbs/fastpath.pyx)
    ("verbs", "aiordma.verbs.ibverbs.fastpath", ("infiniband/verbs.h",)),
    # the soft provider's per-packet path (verbs/soft/_core.pyx): the provider needs it
    ("soft", "aiordma.verbs.soft._core", ()),
    # the message engine (protocol/engine.pyx): every endpoint needs it
    ("engine", "aiordma.protocol.engine", ()),
)

#: What setup.py's last build of this tree compiled and left out, and why: a JSON file
#: in the package, ``{"extensions": {module: "" or why it was left out}}`` (the mypyc
#: group under ``MYPYC_GROUP``).
BUILD_INFO: Final = "_build.json"

#: setup.py's name of the mypyc group (its key in ``BUILD_INFO``)
MYPYC_GROUP: Final = "aiordma._native"

#: the modules mypyc compiles (setup.py reads this literal)
MODULES: tuple[str, ...] = (
    "aiordma.endpoint",
    "aiordma.onesided",
    "aiordma.receiving",
    "aiordma.sending",
    "aiordma.resources",
    "aiordma.lifecycle",
    "aiordma.protocol.state",
    "aiordma.cq_reactor",
    "aiordma.wr_table",
    "aiordma.poll_schedule",
    "aiordma.spin_policy",
    "aiordma.memory",
    "aiordma.waiters",
    "aiordma.verbs.wr",
    "aiordma.verbs.contract",
    "aiordma.verbs.soft.wire",
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


def _modules_build() -> str:
    n = len(compiled_modules())
    return "mypyc" if n == len(MODULES) else "python" if n == 0 else "mixed"


@dataclasses.dataclass(frozen=True)
class Build:
    """What this process runs compiled.

    ``modules``: how ``MODULES`` run -- ``"mypyc"`` (all compiled), ``"python"`` (none)
    or ``"mixed"`` (a partial or stale build); ``modules_why``: when not all compiled,
    why the build left them out, where it said (else ``""``). ``extensions``: per
    ``EXTENSIONS`` tag, ``""`` when the compiled module is imported, else why not.
    ``tags`` holds ``modules`` and the tags of the compiled extensions (what a test run
    that requires a build names)."""

    modules: str
    extensions: dict[str, str]
    modules_why: str = ""

    @property
    def tags(self) -> frozenset[str]:
        return frozenset({self.modules} | {t for t, why in self.extensions.items() if not why})

    @property
    def label(self) -> str:
        """Short: ``modules`` and the compiled extensions' tags, e.g. ``mypyc+verbs``."""
        return "+".join([self.modules] + [t for t, why in self.extensions.items() if not why])

    def compiled(self, tag: str) -> bool:
        """Whether the extension ``tag`` runs compiled."""
        return self.extensions.get(tag) == ""

    def __str__(self) -> str:
        first = f"{self.modules} ({self.modules_why})" if self.modules_why else self.modules
        parts = [first] + [f"{tag}: {'compiled' if not why else why}"
                                  for tag, why in self.extensions.items()]
        return "; ".join(parts)


def _build_info(root: str) -> dict[str, str]:
    """``BUILD_INFO``'s ``extensions`` (empty when there is none or it is unreadable)."""
    try:
        with open(os.path.join(root, "aiordma", BUILD_INFO)) as f:
            got = json.load(f).get("extensions", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def extension_status(module: str, root: str | None = None) -> str:
    """``""`` when the Cython extension ``module`` imports as a compiled module, else
    why not: left out by the build (its reason), not built, or failing to import."""
    root = root or _root()
    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(
            tuple(importlib.machinery.EXTENSION_SUFFIXES)):
        why = _build_info(root).get(module)
        if why:
            return f"not compiled: {why}"
        return ("not compiled (no build of this tree: make native, or pip install with a C "
                "compiler)")
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return f"compiled but not importable: {exc}"
    return ""


def build() -> Build:
    """What this process runs compiled (``Build``); imports the compiled modules."""
    modules = _modules_build()
    why = ""
    if modules != "mypyc":
        left = _build_info(_root()).get(MYPYC_GROUP)
        why = f"not compiled: {left}" if left else ""
    return Build(modules, {tag: extension_status(mod) for tag, mod, _ in EXTENSIONS}, why)


def _root() -> str:
    """The directory that holds the ``aiordma`` package."""
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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
    """The modules of ``MODULES`` and ``EXTENSIONS`` whose compiled extension, next to
    the source where the build leaves it, is older than the source (``.py``, or ``.pyx``
    and ``.pxd``): Python imports the extension, so the process would run the code of
    before the edit. ``root`` is the directory that holds the ``aiordma`` package
    (default: this one's). Imports nothing."""
    if root is None:
        root = _root()
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
    for _tag, name, _headers in EXTENSIONS:
        base = os.path.join(root, *name.split("."))
        ext_mtime = _extension_mtime(base)
        if ext_mtime is None:
            continue
        srcs = [m for m in (_mtime(base + ".pyx"), _mtime(base + ".pxd")) if m is not None]
        if srcs and max(srcs) - ext_mtime > STALE_AFTER_S:
            out.append(name)
    return out


def _mtime(path: str) -> float | None:
    try:
        return os.path.getmtime(path)
    except OSError:
        return None


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
