"""Every wait, record, synchronize, close, free and host registration in ringcomm's device
code, and the test that fails when it is taken out.

The fake device runtime exists so that device code which forgets one of these fails its
tests on a CPU. This table holds that to account: each ``Site`` is one such call (its
statement, as it reads in its file) and the tests that must fail without it.
``test_device_mutations.py`` checks that the table names every such call the device code
makes, and (slow) takes each one out in turn, in a copy of the package, and runs its tests.

Run by hand, ``python tests/device_mutations.py [--discover] [PATH:LINE ...]`` takes the
sites out one at a time and says which test failed first (``--discover`` runs the whole
candidate list for each, to find a test for a new site).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "ringcomm"

# The files of the device path, and the calls in them that order device work or give
# device (or page-locked) memory back.
DEVICE_FILES = ("engines/device.py", "engines/cuda_ipc.py", "engines/staged.py",
                "core/arrays.py", "torch_backend/work.py", "runtime/devices.py",
                "core/device/kinds.py")
CALLS = re.compile(r"\.(record|wait_event|synchronize|event_synchronize|close_memory|free|"
                   r"host_register|host_unregister|close)\(")

ENGINE = "tests/test_device_engine.py::"
IPC = "tests/test_cuda_ipc.py::"
TORCH_CUDA = "tests/test_torch_cuda.py::"


@dataclass(frozen=True)
class Site:
    """One call: ``statement`` is its line, stripped, in ``path`` (under ringcomm/), the
    ``occurrence``-th line that reads so; taking it out must fail one of ``tests``. A
    ``gpu`` site is one only a GPU run can see (torch's own CUDA streams)."""

    path: str
    statement: str
    tests: tuple[str, ...]
    occurrence: int = 0
    gpu: bool = False

    @property
    def name(self) -> str:
        suffix = f"#{self.occurrence + 1}" if self.occurrence else ""
        return f"{self.path}:{self.statement}{suffix}"


def _every(engine: str, world: int) -> str:
    return f"{ENGINE}test_every_collective_on_device_memory[{world}-{engine}]"


STAGED_OFF = f"{ENGINE}test_without_a_device_runtime_device_arrays_are_staged_through_the_host"
TIGHT_RINGS = f"{ENGINE}test_staging_through_links_that_hold_its_memory[ipc-65536-16384]"
GROWN = f"{ENGINE}test_buffers_that_grow_give_the_smaller_ones_back[staged]"
RINGS = f"{ENGINE}test_staged_messages_go_through_the_page_locked_rings"
CAUGHT_BY_TORCH_CUDA = f"{TORCH_CUDA}test_wait_orders_the_callers_stream_after_the_op[world2]"

SITES: tuple[Site, ...] = (
    # the device engine and its lane
    Site("engines/device.py", "self.runtime.free(held)", (_every("cuda-ipc", 3),)),
    Site("engines/device.py", "runtime.free(held)", (_every("cuda-ipc", 1),)),
    Site("engines/device.py", "self.channel.close(failed=failed)", (_every("cuda-ipc", 2),)),
    Site("engines/device.py", "runtime.record(mark, stream)",
         (f"{ENGINE}test_a_stream_stuck_behind_a_lost_peer_does_not_settle",)),
    Site("engines/device.py", "runtime.wait_event(stream, buf.producer)",
         (_every("cuda-ipc", 2),)),
    Site("engines/device.py", "runtime.record(done, stream)", (_every("cuda-ipc", 1),)),
    Site("engines/device.py", "runtime.wait_event(mine.caller_stream, done)",
         (_every("cuda-ipc", 1),)),
    Site("engines/device.py", "runtime.synchronize(stream)",
         (f"{ENGINE}test_host_arrays_beside_device_arrays_in_one_call[cuda-ipc]",)),
    # the cuda-ipc channel
    Site("engines/cuda_ipc.py", "runtime.wait_event(stream, self._their_done[peer][slot])",
         (_every("cuda-ipc", 3),)),
    Site("engines/cuda_ipc.py", "runtime.record(self._ready[peer][slot], stream)",
         (_every("cuda-ipc", 2),)),
    Site("engines/cuda_ipc.py", "runtime.wait_event(stream, self._their_ready[peer][slot])",
         (_every("cuda-ipc", 2),)),
    Site("engines/cuda_ipc.py", "runtime.record(self._done[peer][slot], stream)",
         (_every("cuda-ipc", 3),)),
    Site("engines/cuda_ipc.py", "self.runtime.close_memory(ptr)",
         (f"{ENGINE}test_device_collectives_across_processes[cuda-ipc]",)),
    Site("engines/cuda_ipc.py", "self.runtime.free(memory)", (_every("cuda-ipc", 2),)),
    Site("engines/cuda_ipc.py", "self.runtime.free(block)", (_every("cuda-ipc", 3),)),
    # the host-staged channel
    Site("engines/staged.py", "runtime.host_register(self.address, size)",
         (_every("staged", 2),)),
    Site("engines/staged.py", "runtime.record(self._copied, stream)", (_every("staged", 2),)),
    Site("engines/staged.py",
         "runtime.event_synchronize(self._copied)  # the bytes are in host memory",
         (_every("staged", 2),)),
    Site("engines/staged.py", "self.runtime.host_register(*region)", (RINGS,)),
    Site("engines/staged.py", "self.runtime.host_unregister(address)", (RINGS,)),
    Site("engines/staged.py", "self.runtime.host_unregister(bounce.address)", (GROWN,)),
    Site("engines/staged.py", "runtime.record(self._landed, stream)", (TIGHT_RINGS,)),
    Site("engines/staged.py",
         "runtime.event_synchronize(self._landed)  # the payload may go back now",
         (TIGHT_RINGS,)),
    Site("engines/staged.py", "self.runtime.free(held)", (GROWN,)),
    Site("engines/staged.py", "self.runtime.host_unregister(bounce.address)",
         (_every("staged", 2),), occurrence=1),
    Site("engines/staged.py", "self.runtime.free(held)", (_every("staged", 2),),
         occurrence=1),
    # device buffers: the caller's stream, arrays kept alive, staging through the host
    Site("core/arrays.py", "runtime.record(self.producer, stream)", (_every("cuda-ipc", 2),)),
    Site("core/arrays.py", "oldest[0].event_synchronize(oldest[1])",
         (f"{ENGINE}test_many_arrays_dropped_right_after_their_ops_live_until_the_device_is_"
          "done[1]",)),
    Site("core/arrays.py", "runtime.wait_event(stream, device.producer)", (STAGED_OFF,)),
    Site("core/arrays.py", "runtime.synchronize(stream)", (STAGED_OFF,)),
    Site("core/arrays.py", "runtime.record(done, stream)", (STAGED_OFF,)),
    Site("core/arrays.py", "runtime.wait_event(device.caller_stream, done)", (STAGED_OFF,)),
    # torch's Work on CUDA tensors: only torch's own CUDA streams can show these
    Site("torch_backend/work.py", "runtime.wait_event(runtime.external_stream(current), done)",
         (CAUGHT_BY_TORCH_CUDA,), gpu=True),
    Site("torch_backend/work.py", "buf.runtime.event_synchronize(buf.done)",
         (CAUGHT_BY_TORCH_CUDA,), gpu=True),
    # the group's lanes
    Site("runtime/devices.py", "lane.close(settled, failed=failed)", (_every("cuda-ipc", 1),)),
)


def device_calls() -> list[tuple[str, str, int]]:
    """(path, statement, occurrence) of every call ``CALLS`` matches in ``DEVICE_FILES``."""
    found = []
    for rel in DEVICE_FILES:
        seen: dict[str, int] = {}
        for line in (PACKAGE / rel).read_text().splitlines():
            code = line.split("#", 1)[0]
            if CALLS.search(code) and not code.lstrip().startswith(("def ", "class ")):
                statement = line.strip()
                found.append((rel, statement, seen.get(statement, 0)))
                seen[statement] = seen.get(statement, 0) + 1
    return found


def mutate(site: Site, package: Path) -> None:
    """Replace ``site``'s line in the package copy at ``package`` by ``pass``."""
    path = package / site.path
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == site.statement]
    if len(hits) <= site.occurrence:
        raise LookupError(f"{site.name}: not found in {path}")
    i = hits[site.occurrence]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}pass  # taken out by the mutation test\n"
    path.write_text("".join(lines))


def run_mutated(site: Site, tests: tuple[str, ...], *, first_failure: bool = True,
                timeout: float = 600.0, select: str | None = None) -> tuple[int | None, str]:
    """Run ``tests`` against a copy of the package with ``site`` taken out: pytest's exit
    status (None: timed out) and its output."""
    with tempfile.TemporaryDirectory(prefix="ringcomm-mutant-") as tmp:
        copy = Path(tmp) / "ringcomm"
        shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
        mutate(site, copy)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [tmp, *filter(None, [os.environ.get("PYTHONPATH")])]),
            "PYTHONDONTWRITEBYTECODE": "1"}
        argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                "--rootdir", str(ROOT), "-c", str(ROOT / "pyproject.toml"),
                *(["-x"] if first_failure else []), *(["-m", select] if select else []),
                *(str(ROOT / t) for t in tests)]
        try:
            done = subprocess.run(argv, cwd=tmp, env=env, capture_output=True, text=True,
                                  timeout=timeout)
        except subprocess.TimeoutExpired as err:
            return None, str(err.stdout or "")
        return done.returncode, done.stdout + done.stderr


def imported_from(tmp: Path) -> str:
    """Where ``import ringcomm`` comes from when run as ``run_mutated`` runs the tests."""
    env = {**os.environ, "PYTHONPATH": str(tmp)}
    done = subprocess.run([sys.executable, "-c", "import ringcomm; print(ringcomm.__file__)"],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=60)
    return done.stdout.strip()


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.M)

CANDIDATES = (
    "tests/test_device_engine.py", "tests/test_cuda_ipc.py", "tests/test_buffers.py",
    "tests/test_gpu_check.py",
)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("sites", nargs="*", help="PATH:STATEMENT names (default: every site)")
    p.add_argument("--discover", action="store_true",
                   help="run the candidate tests for each call found in the device code")
    args = p.parse_args(argv)
    if args.discover:
        sites = [Site(path, statement, CANDIDATES, occurrence)
                 for path, statement, occurrence in device_calls()]
    else:
        sites = list(SITES)
    if args.sites:
        sites = [s for s in sites if any(s.name.startswith(n) for n in args.sites)]
    missed = 0
    for site in sites:
        started = time.monotonic()
        code, output = run_mutated(site, site.tests,
                                   select="not slow" if args.discover else None)
        failed = FAILED.findall(output)
        seconds = time.monotonic() - started
        caught = code not in (0, 5) and (code is None or failed)
        missed += not caught
        print(f"{'caught' if caught else 'MISSED'} {site.name} ({seconds:.0f} s): "
              f"{failed[:1] or ('timed out' if code is None else f'exit {code}')}",
              flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
