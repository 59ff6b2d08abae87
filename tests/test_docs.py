"""The manual stays true: README.md's code runs as written, its configuration table
names every option and environment variable, its results tables match their data, the
docs cite only tests and files that exist, and nothing in the repository narrates how
it was built or points outside it."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import subprocess
import sys

import pytest
from _procs import proc_env
from _readme import section_code

from aiordma.bench.report import rendered_blocks
from aiordma.options import EndpointOptions

ROOT = pathlib.Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}
#: the hook's bar for the manual's length
MAX_README_LINES = 320


def _run_block(code: str, provider: str, tmp_path: pathlib.Path) -> str:
    """Run ``code`` as a script on ``provider`` (as written: on verbs, 127.0.0.1 takes
    the device's first RoCE v2 IPv4 GID); its stdout."""
    script = tmp_path / "block.py"
    script.write_text(code)
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=120, cwd=tmp_path, env=proc_env(provider))
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


@pytest.mark.timeout(150)
def test_the_quick_start_runs_as_written(provider_name: str, tmp_path: pathlib.Path) -> None:
    code = section_code(README, "Quick start")
    assert "ep.write(" in code and "ep.read(" in code and "fetch_add" in code
    assert "compare_swap" in code
    assert _run_block(code, provider_name, tmp_path) == "b'hello'\n0\n5\n"


@pytest.mark.timeout(150)
def test_the_streams_example_runs_as_written(provider_name: str, tmp_path: pathlib.Path) -> None:
    code = section_code(README, "asyncio Protocols and streams")
    assert _run_block(code, provider_name, tmp_path) == "b'HELLO\\n'\n"


def test_the_readme_is_a_manual_not_a_notebook() -> None:
    assert len(README.splitlines()) <= MAX_README_LINES
    first_screen = README.split("\n## ", 1)[0]
    assert "make echo" in first_screen and "make test" in first_screen


def _table_names(text: str, heading: str) -> set[str]:
    """The backticked names in the first column of the table after ``heading``."""
    section = text.split(heading, 1)[1]
    names: set[str] = set()
    for line in section.splitlines():
        if line.startswith("| `"):
            names.update(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", line.split("|")[1]))
    return names


def test_the_configuration_table_names_every_option_and_variable() -> None:
    config = README.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    options = {f.name for f in dataclasses.fields(EndpointOptions)} | {"timeout",
                                                                       "write_chunk_size"}
    listed = _table_names(config, "| option |")
    assert options <= listed, sorted(options - listed)
    used = set()
    for f in (ROOT / "aiordma").rglob("*.py"):
        used.update(re.findall(r"AIORDMA_[A-Z0-9_]+", f.read_text()))
    used.update(re.findall(r"AIORDMA_[A-Z0-9_]+", (ROOT / "setup.py").read_text()))
    # the test suite's and the Soft-RoCE tier's own variables: tests/rxe/README.md
    used = {v for v in used if not v.startswith(("AIORDMA_TEST_", "AIORDMA_RXE_"))}
    variables = _table_names(config, "| variable |")
    assert used <= variables, sorted(used - variables)


@pytest.mark.parametrize("name", ["README.md", "docs/benchmarks.md"])
def test_results_tables_match_their_documents(name: str) -> None:
    blocks = list(rendered_blocks((ROOT / name).read_text(), str(ROOT)))
    assert blocks, f"{name} has no results block"
    for doc, current, rendered in blocks:
        assert current == rendered, (f"{name}: the table of {doc} is stale; run python -m "
                                     f"aiordma.bench.report {doc} --update {name}")


def test_history_files_are_data() -> None:
    files = sorted((ROOT / "docs" / "history").glob("*.json"))
    assert files
    for f in files:
        d = json.loads(f.read_text())
        assert {"title", "date", "commit", "machine", "method", "columns", "rows"} <= set(d), f
        assert all(len(row) == len(d["columns"]) for row in d["rows"]), f
        assert f.name in DOCS["benchmarks.md"], f"docs/benchmarks.md does not list {f.name}"


def test_reliability_cites_tests_that_exist() -> None:
    text = DOCS["reliability.md"]
    current: str | None = None
    cited = 0
    for token in re.findall(r"`([^`]+)`", text):
        m = re.fullmatch(r"(test_\w+\.py)(?:::(test_\w+))?", token)
        if m:
            current = m.group(1)
            path = ROOT / "tests" / current
            assert path.is_file(), token
            if m.group(2):
                assert re.search(rf"def {m.group(2)}\b", path.read_text()), token
                cited += 1
        elif re.fullmatch(r"test_\w+", token):
            assert current is not None, token
            assert re.search(rf"def {token}\b", (ROOT / "tests" / current).read_text()), (
                f"{token} is not in {current}")
            cited += 1
    assert cited > 50


def _paths(text: str) -> set[str]:
    return {p for p in re.findall(r"`([\w./-]+\.(?:md|py|sh|json|png))`", text)
            if not p.startswith("/")}


def test_cited_files_exist() -> None:
    texts = {"README.md": README, "tests/rxe/README.md": (ROOT / "tests/rxe/README.md").read_text()}
    texts.update({f"docs/{k}": v for k, v in DOCS.items()})
    bases = [ROOT / d for d in ("", "aiordma", "tests", "docs", "docs/history", "examples",
                                "tests/rxe")]
    for name, text in texts.items():
        for p in _paths(text):
            assert any((b / p).exists() for b in bases), f"{name} cites {p}, which is not here"
    for m in re.findall(r"\]\(([^)]+)\)", README + DOCS["benchmarks.md"]):
        assert (ROOT / m).exists() or (ROOT / "docs" / m).exists(), m


def test_nothing_narrates_how_it_was_built() -> None:
    try:
        files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                               timeout=30, check=True).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    pattern = re.compile(r"\bsessions? ?-?[0-9]+\b|closing" r" note|\(issue [0-9]+\)|"
                         r"\.\./shared/|/work/", re.I)
    bad = []
    for name in files:
        path = ROOT / name
        if path.suffix == ".png" or not path.is_file() or name == "tests/test_docs.py":
            continue  # (this file holds the pattern)
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                bad.append(f"{name}:{n}: {line.strip()[:100]}")
    assert not bad, "\n".join(bad)
