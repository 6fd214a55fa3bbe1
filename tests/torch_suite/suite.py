"""torch's ``DistributedTest._DistTestBase``, set up the way upstream's
``test/distributed/test_distributed_spawn.py`` sets it up, for the backend named by
``RINGCOMM_SUITE_BACKEND`` (default: ``BACKEND``, else gloo).

Why the import dance: ``distributed_test`` decides at import time, from the backend's name,
which tests exist at all (``skip_if(BACKEND != "gloo" and BACKEND != "nccl")`` and the sets
in ``DistTestCases``), and only gloo, nccl, mpi and ucc are known there. To give ringcomm
the same tests as gloo, the module is imported with ``BACKEND=gloo`` and ringcomm is added
beside gloo in ``DistTestCases``; afterwards ``BACKEND`` is set to the real name, so every
test runs on the real backend and every check inside a test sees the real name (a test that
only works for a backend literally named gloo fails, and the runner reports it).

Spawned ranks import this module again to find the test class, so it must work as a plain
import: no side effects beyond the ones above.
"""

from __future__ import annotations

import os

import torch

TARGET = os.environ.get("RINGCOMM_SUITE_BACKEND") or os.environ.get("BACKEND") or "gloo"
os.environ["RINGCOMM_SUITE_BACKEND"] = TARGET
if TARGET == "ringcomm":
    import ringcomm  # noqa: F401 - registers the backend, also where the entry point is off
os.environ.setdefault("WORLD_SIZE", "2")

from torch.testing._internal.common_distributed import DistTestCases  # noqa: E402

for _names in (*DistTestCases.backend_feature.values(), *DistTestCases.skip_collective.values()):
    if "gloo" in _names:
        _names.add(TARGET)

os.environ["BACKEND"] = "gloo"
try:
    from torch.testing._internal.distributed import distributed_test  # noqa: E402
finally:
    os.environ["BACKEND"] = TARGET
distributed_test.BACKEND = TARGET

torch.backends.cuda.matmul.allow_tf32 = False


class TestDistBackendWithSpawn(distributed_test.TestDistBackend,
                               distributed_test.DistributedTest._DistTestBase):
    def setUp(self) -> None:
        super().setUp()
        self._spawn_processes()
        torch.backends.cudnn.flags(enabled=True, allow_tf32=False).__enter__()
