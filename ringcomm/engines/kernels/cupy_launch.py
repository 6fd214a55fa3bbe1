"""CuPy's launch of the device allreduce kernels (``allreduce.cu``): each instantiation
compiled once per process and device with NVRTC through ``cupy.RawModule`` (CuPy also keeps
the binary in its kernel cache on disk), the table of every rank's pointers written once
per mapping into device memory, and one launch per op on the lane's stream.

What the host hands the kernel is fixed by the CUDA source, so it is built here by pure
functions that a CPU test checks against that source (``peer_table``: the ``PeerPointers``
struct; ``kernel_args``: each kernel's parameter list), and the grid comes from
``kernel_geometry.grid_blocks``, which every rank evaluates on agreed inputs.

Registered as ``CupyRuntime.launcher_factory`` when this module is imported (by
``ringcomm.engines.kernel``): the core runtime knows nothing of the kernels' source.
Not yet run on a GPU: ``CupyRuntime.kernel_path_checked`` stays False, so the selector takes
the kernel path on CuPy only where ``RINGCOMM_DEVICE_ENGINE=cuda-kernel`` asks for it.
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np

from ...core.device import kernel_geometry as geometry
from ...core.device.cupy_runtime import CupyRuntime
from ...core.device.runtime import Allocation, Stream
from ...core.dtypes import ReduceOp, dtype_name, reduce_op
from . import ALL_GATHER, OPTIONS, kernel_name, source

#: ``struct PeerPointers { void* data[kMaxRanks]; unsigned int* pads[kMaxRanks]; }``
PEER_TABLE_BYTES = 2 * geometry.MAX_RANKS * 8
#: the peer tables a launcher keeps (one per place an op's buffers lie) before it frees them
MOST_TABLES = 256


def peer_table(data: tuple[int, ...], pads: tuple[int, ...]) -> np.ndarray:
    """The bytes of a ``PeerPointers``: every rank's data pointer, then every rank's pad
    pointer, each array ``kMaxRanks`` long (unused entries zero), as 64-bit pointers."""
    if len(data) != len(pads) or not 1 <= len(data) <= geometry.MAX_RANKS:
        raise ValueError(f"a peer table holds 1 to {geometry.MAX_RANKS} ranks' data and pads, "
                         f"not {len(data)} and {len(pads)}")
    table = np.zeros(2 * geometry.MAX_RANKS, np.uint64)
    table[:len(data)] = data
    table[geometry.MAX_RANKS:geometry.MAX_RANKS + len(pads)] = pads
    return table


def kernel_args(algorithm: str, table: int, out: int | None, count: int, rank: int,
                world: int, op_number: int, stride: int = 0) -> tuple[np.generic, ...]:
    """A launch's arguments in the kernel's parameter order and C types (CuPy passes a
    numpy scalar as its own type): ``one_shot_allreduce(const PeerPointers* table, T* out,
    unsigned long long count, int rank, int world, unsigned int op_number)`` and
    ``reduce_scatter`` alike; ``two_shot_allreduce`` the same without ``out``;
    ``all_gather(table, char* out, unsigned long long nbytes, unsigned long long stride,
    int rank, int world, unsigned int op_number)``. Op numbers are the pads' 32-bit
    counters."""
    number = np.uint32(op_number % (1 << 32))
    tail = (np.int32(rank), np.int32(world), number)
    if algorithm == "two_shot":
        return (np.uint64(table), np.uint64(count), *tail)
    if algorithm not in ("one_shot", "reduce_scatter", "all_gather"):
        raise ValueError(f"algorithm {algorithm!r}: one_shot, two_shot, reduce_scatter or "
                         "all_gather")
    if out is None:
        raise ValueError(f"the {algorithm} writes to an output of this rank's own")
    if algorithm == "all_gather":
        return (np.uint64(table), np.uint64(out), np.uint64(count), np.uint64(stride), *tail)
    return (np.uint64(table), np.uint64(out), np.uint64(count), *tail)


_FUNCTIONS: dict[tuple[int, str], Any] = {}  # (device, kernel name) -> compiled RawKernel
_COMPILING = threading.Lock()  # ranks that are threads of one process compile once
_LEFT_FOR_EXIT: list[Allocation] = []  # tables a failed channel could not free


class CupyLauncher:
    """The kernels' launch for one channel (``DeviceRuntime.kernel_launcher``)."""

    def __init__(self, runtime: CupyRuntime) -> None:
        self.runtime = runtime
        self._tables: dict[tuple[tuple[int, ...], tuple[int, ...]], Allocation] = {}

    @classmethod
    def problem(cls, runtime: CupyRuntime) -> str:
        """Why CuPy cannot run the kernels here ("" where it can): NVRTC, which
        ``cupy.RawModule`` compiles with, must load (the CUDA toolkit's, or the
        ``nvidia-cuda-nvrtc`` wheel's), and the GPU must be sm_80 or newer (bfloat16's
        conversion, ``cvt.rn.bf16.f32``; the architectures CI compiles for)."""
        from . import nvrtc_problem

        if problem := nvrtc_problem():
            return problem
        device = runtime.current_device()
        major, minor = runtime.compute_capability(device)
        if major < 8:
            return (f"GPU {device} is sm_{major}{minor}: the kernels need sm_80 or newer "
                    "(A100, H100, ...)")
        return ""

    def prepare(self, algorithm: str, dtype: np.dtype, op: ReduceOp | None) -> None:
        """Compile ``algorithm``'s kernel for ``dtype`` and ``op`` now, if it is not yet
        (NVRTC takes a while): before the op's first launch, while no peer waits."""
        self._function(algorithm, dtype, op)

    def _function(self, algorithm: str, dtype: np.dtype, op: ReduceOp | None) -> Any:
        name = kernel_name(algorithm) if op is None else \
            kernel_name(algorithm, dtype_name(dtype), op.name)
        key = (self.runtime.current_device(), name)
        function = _FUNCTIONS.get(key)
        if function is None:
            import cupy

            with _COMPILING:
                function = _FUNCTIONS.get(key)
                if function is None:
                    module = cupy.RawModule(code=source(), options=OPTIONS,
                                            name_expressions=[name])
                    function = _FUNCTIONS[key] = module.get_function(name)
        return function

    def _table(self, data: tuple[int, ...], pads: tuple[int, ...], stream: Stream) -> int:
        """The device copy of the peer table for these mappings, written once (on
        ``stream``, so the launch after it reads it written). Registered memory gives a
        table per place an op's buffers lie: past ``MOST_TABLES`` the stream is waited for
        (no kernel reads a table any more) and they are all freed."""
        held = self._tables.get((data, pads))
        if held is None:
            runtime = self.runtime
            if len(self._tables) >= MOST_TABLES:
                runtime.synchronize(stream)
                self.release()
            held = self._tables[(data, pads)] = runtime.malloc(PEER_TABLE_BYTES)
            runtime.from_host(held.ptr, peer_table(data, pads), stream)
        return held.ptr

    def launch_kernel(self, *, stream: Stream, algorithm: str, rank: int,
                      data: tuple[int, ...], pads: tuple[int, ...], count: int,
                      dtype: np.dtype, op: ReduceOp | None, op_number: int, blocks: int,
                      threads: int, out: int | None = None, stride: int = 0) -> None:
        """Queue one rank's kernel of one op on ``stream`` (the fake's ``Launch`` fields)."""
        world = len(data)
        geometry.check_launch(world, blocks, threads)
        geometry.check_output(algorithm, data, out, count, stride)
        if algorithm == ALL_GATHER:
            op = None  # bytes: one kernel for every dtype
        else:  # the pairs the host path has: the only kernels there are
            reduce_op(op, dtype)  # type: ignore[arg-type]
        function = self._function(algorithm, dtype, op)
        args = kernel_args(algorithm, self._table(data, pads, stream), out, count, rank,
                           world, op_number, stride)
        with self.runtime._cupy_stream(stream):
            function((blocks,), (threads,), args)

    def release(self, *, free: bool = True) -> None:
        """Free the peer tables (the channel's stream has finished with them by its close);
        with ``free=False`` (device work may never end: a free would wait for it) keep
        them to the process's exit."""
        tables, self._tables = self._tables, {}
        if not free:
            _LEFT_FOR_EXIT.extend(tables.values())
            return
        for held in tables.values():
            self.runtime.free(held)


CupyRuntime.launcher_factory = CupyLauncher
