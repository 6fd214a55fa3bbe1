"""The README's code blocks marked ``<!-- runnable: torchrun N -->`` run as written, and what
it says of itself holds: it stays a front page, its links lead somewhere, the default it
quotes is the code's.

Each block is saved to a file and started with ``torchrun --standalone --nproc-per-node N``
from a temporary folder, so it works from a fresh clone, not only from the repository. Its
measured figures are generated blocks, checked by ``tests/test_reference.py``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
TEXT = README.read_text()
BLOCK = re.compile(r"<!-- runnable: torchrun (\d+) -->\n```python\n(.*?)```", re.S)
BLOCKS = [(int(n), code) for n, code in BLOCK.findall(TEXT)]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_readme_marks_its_runnable_blocks():
    assert len(BLOCKS) >= 2, "the torch.distributed snippet and the direct API's example"


@pytest.mark.timeout(150)
@pytest.mark.parametrize("ranks,code", BLOCKS, ids=[f"block{i}" for i in range(len(BLOCKS))])
def test_a_runnable_readme_block_runs(tmp_path, ranks, code):
    script = tmp_path / "block.py"
    script.write_text(code)
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run([str(torchrun), "--standalone", "--nproc-per-node", str(ranks),
                           str(script)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=140)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}"


def test_the_readme_is_a_front_page():
    """What a user needs, readable in ten minutes; the rest lives in docs/."""
    assert len(TEXT.splitlines()) <= 350


def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", ["README.md", "docs/architecture.md", "docs/benchmarks.md"])
def test_every_link_of_a_page_leads_somewhere(page):
    """Files (and pictures) the page links exist; an anchor names a heading of its page."""
    path = ROOT / page
    text = path.read_text()
    missing = []
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        if not linked.exists():
            missing.append(target)
            continue
        if anchor and linked.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", linked.read_text(), re.M)
            if anchor not in {_anchor(h) for h in headings}:
                missing.append(target)
    assert not missing, f"{page} links to what is not there: {missing}"


def test_the_default_timeout_the_readme_quotes_is_inits():
    from ringcomm.core.config import BY_NAME

    default = BY_NAME["timeout"].default
    assert f"default {default:g} s" in TEXT


def test_the_readme_names_what_ringcomm_needs():
    """The install section names every dependency of pyproject.toml."""
    from importlib.metadata import requires

    needed = [re.split(r"[<>=!~ ;\[]", r, maxsplit=1)[0] for r in requires("ringcomm") or []
              if "extra ==" not in r]
    install = TEXT[TEXT.index("## Install"):TEXT.index("## Quick starts")]
    assert needed and all(name in install for name in needed), needed
