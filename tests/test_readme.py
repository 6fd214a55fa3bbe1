"""The README's code blocks marked ``<!-- runnable: torchrun N -->`` run as written.

Each block is saved to a file and started with ``torchrun --standalone --nproc-per-node N``
from a temporary folder, so it works from a fresh clone, not only from the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"
BLOCK = re.compile(r"<!-- runnable: torchrun (\d+) -->\n```python\n(.*?)```", re.S)
BLOCKS = [(int(n), code) for n, code in BLOCK.findall(README.read_text())]


def test_the_readme_marks_its_runnable_blocks():
    assert len(BLOCKS) >= 2, "the example and the torch.distributed snippet"


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
