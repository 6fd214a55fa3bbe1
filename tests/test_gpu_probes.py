"""The probes ``bench/gpu_check.sh`` runs, as tests marked ``gpu``: on CuPy and a GPU, or on
the fake runtime with ``RINGCOMM_TEST_RUNTIME=fake`` (``gpu_check --fake`` sets it).

Each goes through ringcomm's device runtime seam, so what passes here is what the device
engines stand on: memory and an interprocess event crossing two processes, and a /dev/shm
mapping page-locked and written by device copies.
"""

from __future__ import annotations

import pytest

from ringcomm_bench import gpu_probe

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]


def test_device_memory_and_an_event_cross_two_processes(gpu_device):
    got = gpu_probe.ipc(gpu_device, timeout=90)
    assert got["exit_codes"] == {"exporter": 0, "importer": 0}, got
    assert got["exporter_live_allocations"] == 0 and got["ok"]


def test_a_dev_shm_mapping_is_page_locked_and_written_by_the_device(gpu_device, gpu_runtime):
    before = gpu_runtime.live_allocations()
    got = gpu_probe.host_register(gpu_device)
    assert got["ok"], got
    assert gpu_runtime.live_allocations() == before


def test_versions_name_the_runtime_and_its_device(gpu_device, gpu_runtime):
    got = gpu_probe.versions(gpu_device)
    assert got["runtime"] == gpu_runtime.name and got["available"] is True
    assert set(gpu_runtime.describe()) <= set(got)
