"""CuPy's launch of the device allreduce kernels, checked where it can be without a GPU:
what the host hands each kernel equals what the CUDA source declares (the peer table's
layout, each kernel's parameter list and C types), the grid every rank launches is the same
and fits the SMs, and the kernel path on a runtime whose launch is not yet checked on a
GPU is taken only where ``RINGCOMM_DEVICE_ENGINE=cuda-kernel`` asks for it."""

from __future__ import annotations

import re

import numpy as np
import pytest

from ringcomm.core.algorithms import CUDA_IPC, CUDA_KERNEL
from ringcomm.core.device import kernel_geometry as geometry
from ringcomm.engines import kernels
from ringcomm.engines.kernels.cupy_launch import PEER_TABLE_BYTES, kernel_args, peer_table
from ringcomm.runtime.local import run_group

#: the C types of the kernels' parameters, as CuPy must pass them
C_TYPES = {"const PeerPointers*": np.uint64, "T*": np.uint64, "char*": np.uint64,
           "unsigned long long": np.uint64, "int": np.int32, "unsigned int": np.uint32}


def _parameters(kernel: str) -> list[tuple[str, str]]:
    """(C type, name) of each parameter of ``kernel`` in allreduce.cu."""
    match = re.search(rf"{kernel}\((.*?)\)\s*{{", kernels.source(), re.S)
    assert match, kernel
    out = []
    for part in match.group(1).split(","):
        ctype, name = " ".join(part.split()).rsplit(" ", 1)
        out.append((ctype, name))
    return out


def test_the_peer_table_is_the_sources_struct() -> None:
    declared = re.search(r"struct PeerPointers \{\s*void\* data\[kMaxRanks\];\s*"
                         r"unsigned int\* pads\[kMaxRanks\];\s*\};", kernels.source())
    assert declared, "PeerPointers changed: change peer_table with it"
    table = peer_table((0x1000, 0x2000, 0x3000), (0x10, 0x20, 0x30))
    assert table.dtype == np.uint64 and table.nbytes == PEER_TABLE_BYTES == 128
    assert table[:4].tolist() == [0x1000, 0x2000, 0x3000, 0]
    assert table[geometry.MAX_RANKS:geometry.MAX_RANKS + 4].tolist() == [0x10, 0x20, 0x30, 0]
    with pytest.raises(ValueError, match="1 to 8 ranks"):
        peer_table((1,) * 9, (2,) * 9)
    with pytest.raises(ValueError, match="data and pads"):
        peer_table((1, 2), (3,))


NAMES = {"one_shot": ["table", "out", "count", "rank", "world", "op_number"],
         "two_shot": ["table", "count", "rank", "world", "op_number"],
         "reduce_scatter": ["table", "out", "count", "rank", "world", "op_number"],
         "all_gather": ["table", "out", "nbytes", "stride", "rank", "world", "op_number"]}


@pytest.mark.parametrize("algorithm", list(NAMES))
def test_each_kernels_arguments_have_its_parameters_types(algorithm: str) -> None:
    function = algorithm if algorithm in ("reduce_scatter", "all_gather") else \
        f"{algorithm}_allreduce"
    params = _parameters(function)
    args = kernel_args(algorithm, 0xA000, None if algorithm == "two_shot" else 0xB000,
                       count=45, rank=1, world=3, op_number=(1 << 32) + 7, stride=64)
    assert [name for _, name in params] == NAMES[algorithm]
    for (ctype, name), arg in zip(params, args, strict=True):
        assert type(arg) is C_TYPES[ctype], (name, ctype, type(arg))
    values = dict(zip([name for _, name in params], (int(a) for a in args), strict=True))
    assert values["table"] == 0xA000 and values.get("count", values.get("nbytes")) == 45
    assert values["rank"] == 1 and values["world"] == 3
    assert values["op_number"] == 7  # the pads' 32-bit counter
    if algorithm == "all_gather":
        assert values["stride"] == 64
    if algorithm != "two_shot":
        with pytest.raises(ValueError, match="output of this rank's own"):
            kernel_args(algorithm, 0xA000, None, 45, 1, 3, 1)


@pytest.mark.parametrize("sms", [8, 132])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_every_rank_launches_one_grid_that_fits_the_sms(sms: int, world: int) -> None:
    for algorithm in ("one_shot", "two_shot"):
        for count, itemsize in ((1, 4), (45, 8), (1 << 20, 2), (1 << 26, 4)):
            blocks = geometry.grid_blocks(algorithm, count, itemsize, world,
                                          geometry.MAX_THREADS, sms)
            assert 1 <= blocks <= min(geometry.MAX_BLOCKS, max(1, sms // world))
            units = -(-count // geometry.vector_width(itemsize))
            if algorithm == "two_shot":
                units = -(-units // world)
            # enough threads for every unit, unless the SMs or the pad bound the grid
            assert blocks * geometry.MAX_THREADS >= units or \
                blocks == min(geometry.MAX_BLOCKS, sms // world)
    assert geometry.grid_blocks("two_shot", 1 << 26, 4, 2, 512, 132) == 66  # 132 SMs, 2 ranks


class _Gpu:
    """What CupyLauncher.problem asks of a runtime: the current device and its compute
    capability."""

    def __init__(self, capability: tuple[int, int]) -> None:
        self.capability = capability

    def current_device(self) -> int:
        return 0

    def compute_capability(self, index: int) -> tuple[int, int]:
        return self.capability


def test_cupy_says_why_it_cannot_launch(monkeypatch) -> None:
    from ringcomm.core.device.cupy_runtime import CupyRuntime
    from ringcomm.engines.kernels.cupy_launch import CupyLauncher

    assert CupyRuntime.launcher_factory is CupyLauncher
    assert not CupyRuntime.kernel_path_checked  # until a GPU run checks it
    monkeypatch.setattr(kernels, "nvrtc_problem", lambda: "")
    assert CupyLauncher.problem(_Gpu((9, 0))) == ""  # an H100
    assert CupyLauncher.problem(_Gpu((7, 5))) == (
        "GPU 0 is sm_75: the kernels need sm_80 or newer (A100, H100, ...)")
    monkeypatch.setattr(kernels, "nvrtc_problem", lambda: "no NVRTC here")
    assert CupyLauncher.problem(_Gpu((9, 0))) == "no NVRTC here"


def _said(comm):
    memory = comm.device.memory
    return str(comm.selector.group.kernel), comm.choose("allreduce", 1024, memory=memory).engine


@pytest.fixture
def unchecked_fake(monkeypatch):
    """The fake runtime as a runtime whose launch no GPU run has checked yet (as CuPy's),
    four devices, MPS off."""
    import ringcomm.testing  # noqa: F401 - registers the fake runtime
    from ringcomm.core import device
    from ringcomm.testing.fake_device import FakeRuntime

    rt = device.runtime("fake")
    monkeypatch.setattr(rt, "_devices", max(4, rt.device_count()))
    monkeypatch.setattr(rt, "mps_on", False)
    monkeypatch.setattr(FakeRuntime, "kernel_path_checked", False)
    return rt


def test_an_unchecked_launch_is_taken_only_on_request(unchecked_fake, monkeypatch):
    (why, engine), _ = run_group(2, _said, device="fake", gpus=[0, 1])
    assert engine == CUDA_IPC
    assert "not yet checked on a GPU; RINGCOMM_DEVICE_ENGINE=cuda-kernel takes it" in why
    monkeypatch.setenv("RINGCOMM_DEVICE_ENGINE", CUDA_KERNEL)
    (why, engine), _ = run_group(2, _said, device="fake", gpus=[0, 1])
    assert engine == CUDA_KERNEL and "each on its own GPU" in why
    (why, engine), _ = run_group(2, _said, device="fake")  # one GPU, no MPS: still refused
    assert engine == CUDA_IPC and "without MPS" in why


def test_the_peer_tables_are_kept_once_per_place_and_bounded(monkeypatch) -> None:
    """CuPy's launcher writes one device table per set of pointers (registered memory gives
    one per place an op's buffers lie) and reuses it; past ``MOST_TABLES`` it waits for its
    stream and frees them all, so a program that reduces ever new slices of registered
    memory does not grow its device memory without end. On the fake runtime's memory."""
    import ringcomm.testing  # noqa: F401 - registers the fake runtime
    from ringcomm.core import device
    from ringcomm.engines.kernels import cupy_launch

    rt = device.runtime("fake")
    monkeypatch.setattr(cupy_launch, "MOST_TABLES", 4)
    launcher = cupy_launch.CupyLauncher(rt)  # type: ignore[arg-type]
    stream = rt.new_stream()
    live = rt.live_allocations()
    pads = (1 << 20, 2 << 20)
    first = launcher._table((8, 16), pads, stream)
    assert launcher._table((8, 16), pads, stream) == first  # written once
    for offset in range(1, 10):
        launcher._table((8 + offset, 16 + offset), pads, stream)
        assert rt.live_allocations() - live <= 4
    table = np.zeros(cupy_launch.PEER_TABLE_BYTES // 8, np.uint64)
    rt.to_host(table, launcher._table((99, 98), pads, stream), stream)
    rt.synchronize(stream)
    assert table[:2].tolist() == [99, 98]
    launcher.release()
    assert rt.live_allocations() == live
