"""aiordma/protocol/ is sans-IO: it imports only the stdlib pieces it needs and
aiordma.errors (no asyncio, no sockets, no provider); its compiled engine (the .pyx and
.pxi files) also C's and CPython's declarations, and the verbs layer's C structs."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import aiordma.protocol

ALLOWED = {"__future__", "struct", "enum", "dataclasses", "errno", "typing", "aiordma.errors",
           "hashlib", "hmac", "secrets",  # (auth.py: pure computation, no I/O)
           "collections", "collections.abc", "itertools",
           "aiordma.verbs.wr",  # (the work request and completion records: plain data)
           "aiordma.verbs.enums",  # (their verbs values)
           "aiordma.native"}  # (mypyc_attr: how mypyc compiles a class; no I/O, no provider)
PACKAGE = Path(aiordma.protocol.__file__).parent


def test_protocol_imports_only_pure_modules() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:  # relative: must stay inside the package
                    assert node.level == 1, f"{path.name}: import leaves aiordma.protocol"
                    continue
                names = [node.module or ""]
            else:
                continue
            for name in names:
                assert name in ALLOWED, f"{path.name} imports {name}"


#: what the compiled engine's Cython may cimport beyond ALLOWED: C and CPython
#: declarations, and the verbs layer's C structs of work requests and completions
C_ALLOWED = {"cython", "aiordma.verbs.cverbs"}
C_PREFIXES = ("libc.", "cpython.")


def test_the_compiled_engine_imports_only_pure_modules() -> None:
    files = sorted(PACKAGE.glob("*.pyx")) + sorted(PACKAGE.glob("*.pxi"))
    assert files
    pattern = re.compile(r"^(?:from\s+(\S+)\s+c?import|c?import\s+(\S+))", re.M)
    for path in files:
        for m in pattern.finditer(path.read_text()):
            name = m.group(1) or m.group(2)
            if name.startswith("."):
                assert not name.startswith(".."), f"{path.name}: import leaves aiordma.protocol"
                continue
            assert (name in ALLOWED or name in C_ALLOWED or name.startswith(C_PREFIXES)), \
                f"{path.name} imports {name}"
