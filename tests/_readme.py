"""The README's code blocks, for the tests that run them (tests/test_docs.py, and
tests/wheel_check.py against the installed wheel)."""

from __future__ import annotations

import re


def python_blocks(text: str) -> list[str]:
    """The ```python blocks of a Markdown text, in order."""
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


def section_code(readme: str, heading: str) -> str:
    """The first ```python block after the ``## heading`` line of ``readme``."""
    return python_blocks(readme.split(f"\n## {heading}\n", 1)[1])[0]
