"""Where torch sees a GPU but CuPy cannot be had, CUDA tensors still work (torch copies them
through host memory) and the communicator says so once, with what to install."""

from __future__ import annotations

import logging

import pytest
import torch

from ringcomm.core.device.cupy_runtime import cupy_problem
from ringcomm.plan.settings import Settings
from ringcomm.runtime import devices

pytestmark = pytest.mark.skipif(not cupy_problem(), reason="CuPy can be used here")


def test_a_gpu_without_cupy_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                         caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(devices, "_SAID_NO_CUPY", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine says
    with caplog.at_level(logging.WARNING, logger="ringcomm"):
        for _ in range(3):
            assert devices.device_runtime(Settings.local(device="off")) is None
    said = [r.getMessage() for r in caplog.records if "device engines cannot run" in
            r.getMessage()]
    assert len(said) == 1, said
    assert "CuPy" in said[0] and "copied through host memory by torch" in said[0]


def test_nothing_is_said_without_a_gpu(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(devices, "_SAID_NO_CUPY", [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with caplog.at_level(logging.WARNING, logger="ringcomm"):
        devices.device_runtime(Settings.local(device="off"))
    assert not caplog.records
