"""Optional native build: the hot path compiled with mypyc.

``AIORDMA_MYPYC=1 python setup.py build_ext --inplace`` (``make native``) compiles the
modules listed in ``aiordma/native.py`` (``MODULES``) to C extensions next to their
sources; Python then imports the extensions instead of the ``.py`` files (``make
clean-native`` removes them). Without ``AIORDMA_MYPYC=1`` (the default, and every plain
``pip install``) aiordma is pure Python. Both builds run the same test suite.
"""

from __future__ import annotations

import ast
import os

from setuptools import setup


def native_modules() -> list[str]:
    """``aiordma.native.MODULES`` as source paths, read without importing aiordma."""
    with open(os.path.join("aiordma", "native.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and node.target.id == "MODULES" and node.value is not None):
            return [m.replace(".", "/") + ".py" for m in ast.literal_eval(node.value)]
    raise SystemExit("aiordma/native.py: no MODULES")


ext_modules = []
if os.environ.get("AIORDMA_MYPYC") == "1":
    from mypyc.build import mypycify

    # group "aiordma._native": one shared library, aiordma/_native__mypyc (native.SHARED_LIB)
    ext_modules = mypycify(native_modules(), opt_level="3", group_name="aiordma._native")

setup(ext_modules=ext_modules)
