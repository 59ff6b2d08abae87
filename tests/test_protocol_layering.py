"""aiordma/protocol/ is sans-IO: it imports only the stdlib pieces it needs and
aiordma.errors (no asyncio, no sockets, no provider)."""

from __future__ import annotations

import ast
from pathlib import Path

import aiordma.protocol

ALLOWED = {"__future__", "struct", "enum", "dataclasses", "errno", "typing", "aiordma.errors",
           "hashlib", "hmac", "secrets",  # (auth.py: pure computation, no I/O)
           "collections", "collections.abc", "itertools",
           "aiordma.verbs.wr",  # (the work request and completion records: plain data)
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
