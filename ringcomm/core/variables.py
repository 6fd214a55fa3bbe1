"""Which ``RINGCOMM_*`` variables ringcomm knows, and the one a user likely meant by another.

Why: a misspelled setting (``RINGCOMM_ALGO`` with two letters swapped) would otherwise be
ignored without a word, and the job would run with the default it meant to change.
``ringcomm env`` and ``ringcomm.init`` name every unknown one with the closest known name.

Known are the variables of the settings table (``config.SETTINGS``) and the few read
outside it, by the test suite and the benchmark harness (``OUTSIDE_THE_TABLE``; a test
checks that every ``RINGCOMM_*`` name in the sources is one or the other).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping

from .config import SETTINGS

PREFIX = "RINGCOMM_"

#: variables read outside the settings table -> who reads them, for what
OUTSIDE_THE_TABLE = {
    "RINGCOMM_TEST_RUNTIME": "the tests: the device runtime the gpu tests run on",
    "RINGCOMM_SUITE_BACKEND": "the tests: the backend torch's own suite runs against",
    "RINGCOMM_HUNT_SEED": "the tests: the seed the disagreement hunt replays",
    "RINGCOMM_HUNT_CASES": "the tests: how many cases the disagreement hunt runs",
    "RINGCOMM_SOAK_SEED": "the tests: the seed of the fault soak",
    "RINGCOMM_GPU_SITE": "bench/gpu_check.sh: the folder its wheels are installed in",
    "RINGCOMM_BENCH_MPI_TOKEN": "ringcomm bench --peers mpi: tells its MPI ranks apart",
}


def settings_variables() -> list[str]:
    """The variables of the settings table, in its order."""
    return [s.env for s in SETTINGS if s.env is not None]


def known() -> set[str]:
    """Every ``RINGCOMM_*`` variable ringcomm or its tests read."""
    return set(settings_variables()) | set(OUTSIDE_THE_TABLE)


def likely_meant(name: str) -> str | None:
    """The setting's variable ``name`` is closest to (compared without the shared prefix,
    which would make every name look alike), or None where none is close."""
    by_suffix = {v.removeprefix(PREFIX): v for v in settings_variables()}
    close = difflib.get_close_matches(name.removeprefix(PREFIX), list(by_suffix), n=1)
    return by_suffix[close[0]] if close else None


def unknown(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The ``RINGCOMM_*`` variables set in ``environ`` (default: this process's) that
    ringcomm does not know, each with the one it likely stands for (or None), sorted."""
    environ = os.environ if environ is None else environ
    names = known()
    return {k: likely_meant(k) for k in sorted(environ)
            if k.startswith(PREFIX) and k not in names}


def unknown_message(name: str, meant: str | None) -> str:
    """What to tell a user about the unknown variable ``name``."""
    guess = f" (did you mean {meant}?)" if meant else ""
    return f"{name} is not a ringcomm setting{guess}, so ringcomm ignores it"
