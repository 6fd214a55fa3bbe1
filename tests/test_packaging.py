"""What installing ringcomm puts on a machine, and what its sdist lets one test.

The wheel is built the way pip builds one from an sdist: the sdist from a copy of this tree,
then the wheel from the unpacked sdist, so a file the sdist lacks is missing from the wheel
too. Both are built by calling setuptools' build hooks directly (no index, no isolation),
which also shows every warning setuptools prints.
"""

from __future__ import annotations

import configparser
import email
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from email.message import Message
from pathlib import Path

import pytest
from test_imports import BLOCK

ROOT = Path(__file__).resolve().parent.parent
NAME = "ringcomm-0.1.0"
BUILD = "import sys, setuptools.build_meta as backend; print(backend.build_{kind}(sys.argv[1]))"
# the tree's folders of importable code, and the names they install as
INSTALLED_AS = {"ringcomm": "ringcomm", "ddp": "ringcomm_ddp", "bench": "ringcomm_bench"}
# what the tests, the Makefile and the README need beside tests/ and examples/
SDIST_ROOT_FILES = ["LICENSE", "README.md", "Makefile", "constraints.txt", "pyproject.toml",
                    "MANIFEST.in"]
# not copied from the tree: what builds and runs leave there
LEFT_BY_RUNS = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info",
                                      "__pycache__", ".*_cache", ".hypothesis", "*.log",
                                      "retry")


@dataclass
class Built:
    sdist: list[str]  # member names, without the leading "ringcomm-0.1.0/"
    sdist_dir: Path  # the sdist unpacked
    wheel: list[str]
    wheel_zip: Path
    output: str  # everything both builds printed

    def read(self, name: str) -> str:
        with zipfile.ZipFile(self.wheel_zip) as z:
            return z.read(name).decode()

    def metadata(self) -> Message:
        return email.message_from_string(self.read(f"{NAME}.dist-info/METADATA"))


def _build(kind: str, source: Path, out: Path) -> tuple[Path, str]:
    proc = subprocess.run([sys.executable, "-c", BUILD.format(kind=kind), str(out)],
                          cwd=source, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out / proc.stdout.strip().splitlines()[-1], proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Built:
    tmp = tmp_path_factory.mktemp("packaging")
    tree = tmp / "tree"
    shutil.copytree(ROOT, tree, ignore=LEFT_BY_RUNS)
    sdist_path, sdist_output = _build("sdist", tree, tmp)
    with tarfile.open(sdist_path) as tar:
        names = tar.getnames()
        safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # 3.10.12+
        tar.extractall(tmp / "unpacked", **safe)
    sdist_dir = tmp / "unpacked" / NAME
    wheel_path, wheel_output = _build("wheel", sdist_dir, tmp)
    with zipfile.ZipFile(wheel_path) as z:
        wheel = z.namelist()
    sdist = [n.removeprefix(f"{NAME}/") for n in names if n.startswith(f"{NAME}/")]
    return Built(sdist, sdist_dir, wheel, wheel_path, sdist_output + wheel_output)


@pytest.mark.timeout(90)
def test_bench_and_ddp_install_under_names_of_ours(built):
    """A top-level ``bench`` or ``ddp`` in site-packages would clash with other
    distributions of those names: the folders install as ``ringcomm_bench`` and
    ``ringcomm_ddp``."""
    top = {name.split("/")[0] for name in built.wheel}
    assert top == {"ringcomm", "ringcomm_ddp", "ringcomm_bench", f"{NAME}.dist-info"}
    assert {"ringcomm_bench/cli.py", "ringcomm_bench/__main__.py"} <= set(built.wheel)
    assert {"ringcomm_ddp/__init__.py", "ringcomm_ddp/module.py"} <= set(built.wheel)
    assert not [n for n in built.wheel if "/results/" in n]  # measured figures stay home


@pytest.mark.timeout(90)
def test_the_wheel_has_every_module_of_the_tree(built):
    """The packages are listed by hand in pyproject.toml (the harness's folder is renamed on
    install, which package discovery cannot do): a new module or subpackage must be there."""
    in_tree = {f"{INSTALLED_AS[top]}/{path.relative_to(ROOT / top).as_posix()}"
               for top in INSTALLED_AS for path in (ROOT / top).rglob("*.py")
               if "__pycache__" not in path.parts}
    assert in_tree - set(built.wheel) == set()


@pytest.mark.timeout(90)
def test_the_wheel_and_the_sdist_carry_the_kernel_sources(built):
    """The device kernels' CUDA C is package data, read and compiled where it is used."""
    sources = {path.relative_to(ROOT).as_posix()
               for path in (ROOT / "ringcomm").rglob("*.cu")}
    assert "ringcomm/engines/kernels/allreduce.cu" in sources
    assert sources - set(built.wheel) == set()
    assert sources - set(built.sdist) == set()


@pytest.mark.timeout(90)
def test_the_board_round_is_compiled_into_the_wheel_from_the_sdists_source(built):
    """The sdist carries the C source and the stub; the wheel, built from the sdist where
    a C compiler is found (as here), carries the compiled round beside them."""
    assert {"ringcomm/transport/_board_round.c",
            "ringcomm/transport/_board_round.pyi"} <= set(built.sdist)
    assert "ringcomm/transport/_board_round.pyi" in built.wheel
    assert [n for n in built.wheel if n.startswith("ringcomm/transport/_board_round.")
            and n.endswith(".so")], "no compiled board round in the wheel"


@pytest.mark.timeout(90)
def test_the_wheel_is_typed_and_licensed(built):
    assert "ringcomm/py.typed" in built.wheel  # type checkers read the annotations (PEP 561)
    meta = built.metadata()
    assert meta["License-Expression"] == "MIT"
    assert meta.get_all("License-File") == ["LICENSE"]
    license_text = built.read(f"{NAME}.dist-info/licenses/LICENSE")
    assert license_text.startswith("MIT License") and "ringcomm contributors" in license_text
    classifiers = meta.get_all("Classifier")
    # an SPDX expression replaces the license classifiers; setuptools refuses both together
    assert not [c for c in classifiers if c.startswith("License ::")]
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert {f"Programming Language :: Python :: 3.{v}" for v in (10, 11, 12)} <= set(classifiers)
    assert set(meta.get_all("Provides-Extra")) == {"bench", "teach", "test", "cuda", "cuda13",
                                                   "mpi"}


@pytest.mark.timeout(90)
def test_the_builds_warn_of_nothing_deprecated(built):
    """``project.license`` as a table made setuptools warn on every install."""
    assert "deprecat" not in built.output.lower(), built.output[-3000:]


@pytest.mark.timeout(90)
def test_the_wheel_declares_the_command_and_the_torch_backend(built):
    entry_points = configparser.ConfigParser()
    entry_points.read_string(built.read(f"{NAME}.dist-info/entry_points.txt"))
    assert dict(entry_points["console_scripts"]) == {"ringcomm": "ringcomm.cli:main"}
    # `import torch` calls it, so init_process_group("ringcomm") works without importing us
    assert dict(entry_points["torch.backends"]) == {"ringcomm": "ringcomm.torch_entry:_autoload"}


@pytest.mark.timeout(90)
def test_the_sdist_carries_what_its_tests_need(built):
    """Every module under tests/ and examples/ (the helpers, torch_suite, the examples the
    tests run) and the files beside them, so the unpacked sdist's tests can run."""
    needed = {path.relative_to(ROOT).as_posix() for top in ("tests", "examples")
              for path in (ROOT / top).rglob("*.py") if "__pycache__" not in path.parts}
    assert {"tests/conftest.py", "tests/mp_helpers.py", "tests/torch_suite/run.py"} <= needed
    assert (needed | set(SDIST_ROOT_FILES)) - set(built.sdist) == set()
    assert not [n for n in built.sdist if n.startswith("bench/results")]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_unpacked_sdists_tests_are_collected(built):
    """Collection imports every test module and its helpers: it fails on a missing one."""
    proc = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q",
                           "-p", "no:cacheprovider"], cwd=built.sdist_dir,
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert " tests collected" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.timeout(60)
def test_bench_without_its_extra_names_the_extra(tmp_path):
    """No traceback: the user is told which extra to install, before any rank starts."""
    code = BLOCK.format(top="rich") + "from ringcomm.cli import main\nmain(['bench', '--quick'])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=50)
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "missing: rich" in proc.stderr
    assert "pip install -e '.[bench]' in ringcomm's checkout" in proc.stderr
