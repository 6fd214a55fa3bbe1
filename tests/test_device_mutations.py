"""Taking out any one wait, record, synchronize, close or free of ringcomm's device code
fails a test: the fake runtime is as strict as the design says.

``device_mutations.SITES`` names every such call of the device path and the tests that must
fail without it. The first test keeps the table whole (a new call needs a row, a row whose
call is gone goes); the slow ones take each call out in turn, in a copy of the package that
the tests then import, and run its tests. The two calls only torch's own CUDA streams can
see are checked that way on a GPU machine (``bench/gpu_check.sh`` runs the tests marked
``gpu``).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from device_mutations import FAILED, PACKAGE, SITES, Site, device_calls, imported_from, run_mutated


def test_the_table_names_every_such_call_of_the_device_code():
    found = set(device_calls())
    named = {(s.path, s.statement, s.occurrence) for s in SITES}
    assert not found - named, f"calls no test is named for: {sorted(found - named)}"
    assert not named - found, f"rows whose call is gone: {sorted(named - found)}"
    assert all(site.tests for site in SITES)


def test_the_tests_of_a_mutant_import_the_mutant(tmp_path: Path):
    shutil.copytree(PACKAGE, tmp_path / "ringcomm",
                    ignore=shutil.ignore_patterns("__pycache__"))
    assert imported_from(tmp_path) == str(tmp_path / "ringcomm" / "__init__.py")


def _param(site: Site):
    marks = [pytest.mark.gpu, pytest.mark.skipif(
        not torch.cuda.is_available(), reason="only torch's CUDA streams can see it")] \
        if site.gpu else []
    return pytest.param(site, id=site.name, marks=marks)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("site", [_param(s) for s in SITES])
def test_taking_the_call_out_fails_its_test(site: Site):
    code, output = run_mutated(site, site.tests, timeout=840)
    # a hang fails the test by its own timeout (pytest-timeout): the outer one is no catch
    assert code is not None and code not in (0, 5) and FAILED.search(output), \
        f"{site.name} taken out, and {', '.join(site.tests)} still passed:\n{output[-3000:]}"
