"""pyverbs, imported lazily (``load_pyverbs``), and what this version of it can do
(``Pyverbs``): importing the ``verbs`` provider never fails on a machine without
pyverbs; opening a device then raises ``DeviceError`` with the install hint.
"""

from __future__ import annotations

import errno
from typing import Any

from ...errors import DeviceError
from . import compat

INSTALL_HINT = (
    "the 'verbs' provider needs pyverbs (rdma-core's Python bindings): install the "
    "distribution package (Debian/Ubuntu: apt install python3-pyverbs; a virtualenv sees it "
    "when created with --system-site-packages), or pip install pyverbs matching the "
    "system's rdma-core version"
)


class Pyverbs:
    """The pyverbs modules and what this version of them can do."""

    def __init__(self) -> None:
        import pyverbs
        import pyverbs.addr
        import pyverbs.cq
        import pyverbs.device
        import pyverbs.mr
        import pyverbs.pd
        import pyverbs.qp
        import pyverbs.wr
        from pyverbs.pyverbs_error import PyverbsError

        self.device: Any = pyverbs.device
        self.pd: Any = pyverbs.pd
        self.cq: Any = pyverbs.cq
        self.qp: Any = pyverbs.qp
        self.mr: Any = pyverbs.mr
        self.wr: Any = pyverbs.wr
        self.addr: Any = pyverbs.addr
        self.Error: type[BaseException] = PyverbsError
        self.version = compat.parse_version(getattr(pyverbs, "__version__", None))
        self.e = compat.import_enums()
        # rdma-core >= 57: CompChannel.fd. >= 61: Context.context is the pointer as an int
        # (before, it casts the C pointer to a Python object: never touch it there).
        self.channel_has_fd = hasattr(self.cq.CompChannel, "fd")
        self.context_ptr_property = self.version is not None and self.version >= (61,)

    def describe(self) -> str:
        ver = ".".join(map(str, self.version)) if self.version else "unknown (< 65)"
        return f"pyverbs {ver}, enums from {self.e.source}"


_pyverbs: Pyverbs | None = None


def load_pyverbs() -> Pyverbs:
    """The pyverbs modules; DeviceError with the install hint when pyverbs is missing."""
    global _pyverbs
    if _pyverbs is None:
        try:
            _pyverbs = Pyverbs()
        except ImportError as exc:
            raise DeviceError(errno.ENOENT, f"{INSTALL_HINT} ({exc})") from exc
    return _pyverbs


def text(v: Any) -> str:
    """A pyverbs string attribute (bytes in some versions) as str."""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)


def enum_value(cls: Any, value: Any, default: Any) -> Any:
    """``cls(int(value))``, or ``default`` for a value outside the enum."""
    try:
        return cls(int(value))
    except (ValueError, TypeError):
        return default


_fastpath: Any = None
_fastpath_error: str | None = None


def fastpath() -> Any | None:
    """The compiled data path (the ``fastpath`` extension module), or None where it is
    not built or does not import (``fastpath_error()`` says why)."""
    global _fastpath, _fastpath_error
    if _fastpath is None and _fastpath_error is None:
        try:
            from . import fastpath as mod
        except ImportError as exc:
            _fastpath_error = str(exc)
        else:
            _fastpath = mod
    return _fastpath


def fastpath_error() -> str | None:
    """Why ``fastpath()`` is None (None when it is not)."""
    fastpath()
    return _fastpath_error
