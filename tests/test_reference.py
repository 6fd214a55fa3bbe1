"""docs/settings.md, docs/support.md and the generated blocks of README.md and
docs/benchmarks.md are what docs/build_reference.py makes from the code and bench/results/
today, and what they say holds where the code is asked directly."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
BUILDER = ROOT / "docs" / "build_reference.py"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_reference", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_checked_in_reference_pages_are_what_the_code_makes(builder):
    problems = builder.check()
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def test_every_setting_is_on_the_settings_page():
    from ringcomm.core.config import SETTINGS

    page = (ROOT / "docs" / "settings.md").read_text()
    for s in SETTINGS:
        if s.env:
            assert f"### `{s.env}`" in page, s.env


def test_the_values_a_setting_takes_come_from_its_parser(builder):
    from ringcomm.core.config import BY_NAME

    assert builder.valid_values(BY_NAME["transport"]) == "one of auto, ipc, tcp"
    assert builder.valid_values(BY_NAME["trace_events"]) == "a whole number of events, 1 or more"
    assert builder.valid_values(BY_NAME["inline_bytes"]) == "a whole number of bytes, 0 or more"
    assert builder.valid_values(BY_NAME["profile"]) == "any text"


def test_the_support_matrix_agrees_with_the_communicator():
    """Cells of the dtype x op table, checked against a real call at world size 1."""
    from ringcomm import ArgumentError
    from ringcomm.runtime.local import run_group

    page = (ROOT / "docs" / "support.md").read_text()
    head = next(line for line in page.splitlines() if line.startswith("| dtype |"))
    ops = [c.strip() for c in head.strip("|").split("|")][1:]
    cells = {}
    for line in page.splitlines():
        name = line.strip("|").split("|")[0].strip() if line.startswith("| ") else ""
        if name in ("float32", "int32", "bool", "complex64", "bfloat16"):
            cells[name] = dict(zip(ops, [c.strip() for c in line.strip("|").split("|")][1:],
                                   strict=True))
    assert set(cells) == {"float32", "int32", "bool", "complex64", "bfloat16"}

    def rank(comm):
        import ml_dtypes

        seen = {}
        for name in cells:
            dtype = ml_dtypes.bfloat16 if name == "bfloat16" else np.dtype(name)
            for op in ops:
                try:
                    comm.allreduce(np.ones(4, dtype), op=op)
                    seen[name, op] = "yes"
                except ArgumentError:
                    seen[name, op] = "-"
        return seen

    seen = run_group(1, rank, timeout=30)[0]
    assert {(n, op): v for n, row in cells.items() for op, v in row.items()} == seen
    assert re.search(r"dtype\s+uint16\s+is\s+not\s+supported", page)


# a measured figure: a time, a bandwidth or a ratio
FIGURE = re.compile(r"\b\d[\d,]*(?:\.\d+)?\s?(?:us|ms|GB/s|MB/s|x)\b")
GENERATED = re.compile(r"<!-- generated: .+? -->\n.*?<!-- end generated -->", re.S)


@pytest.mark.parametrize("page", ["README.md", "docs/benchmarks.md"])
def test_every_figure_quoted_comes_from_a_results_file(page):
    """Outside its generated blocks (made from bench/results/ and checked above) a page
    quotes no measured figure."""
    text = GENERATED.sub("", (ROOT / page).read_text())
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # commands
    assert not FIGURE.findall(text), FIGURE.findall(text)
    assert "<!-- generated: " in (ROOT / page).read_text()
