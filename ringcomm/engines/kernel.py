"""The kernel path's engine (``cuda-kernel``): an allreduce of device memory as one kernel
per op over regions every rank of the group maps, the ranks meeting through flags in those
regions' signal pads (``ringcomm/engines/kernels/allreduce.cu``).

One owner of its memory and launches (``KernelChannel``), made once per communicator at
set-up, where the group's verdict allows it (``ringcomm.plan.kernel_path``;
``ringcomm.runtime.devices.open_lanes``): each rank allocates its region (``[signal pad |
data]``, the pad cleared once and never again: its flags count ops) and an output for the
one-shot, publishes them through the group's device exchange, reads every peer's, and gives
them back at close. An op copies the caller's data into this rank's region (in pieces of
the region's size, each piece one launch with the next op number, the same on every rank
since every rank runs the same ops in the same order), launches the kernel the selector
chose, and copies the result back, all on the lane's stream in the caller's stream order
(``stage_in``/``stage_out``, as the other device engines).

Where it runs: on the fake runtime, the kernels' numpy mirror is the launch
(``ringcomm.testing.fake_kernels.MirrorGroup``), for ranks that are threads of one
process; the fake's memory is shared by them, so a peer's region is used at its own
address. CuPy's launch (``RawModule``, regions exported and opened with CUDA IPC, in-place
registration of user memory) is not written yet: ``CupyRuntime.kernel_launch`` says so,
and no group on CuPy makes this engine.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..core.algorithms import ALLREDUCE_KERNELS, CUDA_KERNEL
from ..core.arrays import Buffer
from ..core.device import kernel_geometry as geometry
from ..core.device.runtime import Allocation, DeviceRuntime, Stream
from ..core.dtypes import ReduceOp
from ..schedules.schedule import Schedule
from .base import Engine
from .context import OpContext
from .device import DeviceLane, held, stage_in, stage_out
from .device_channel import Exchange

#: data bytes of each rank's region: an allreduce larger than this runs as several launches
REGION_BYTES = 1 << 20
_REGIONS_KEY = "kernel-regions"
_BLOCKS = 2  # the fake's grid: enough blocks to interleave, few steps per op
_THREADS = geometry.MAX_THREADS


class KernelChannel:
    """This rank's region, output and view of every peer's, and the group's launcher
    (module docstring). Collective: every rank of the group makes it at set-up."""

    name = CUDA_KERNEL

    def __init__(self, runtime: DeviceRuntime, exchange: Exchange, rank: int, world: int,
                 deadline: float, region_bytes: int | None = None) -> None:
        region_bytes = REGION_BYTES if region_bytes is None else region_bytes
        if region_bytes <= 0 or region_bytes % geometry.VECTOR_BYTES:
            raise ValueError(f"region_bytes {region_bytes}: a positive multiple of "
                             f"{geometry.VECTOR_BYTES}")
        self.runtime = runtime
        self.rank, self.world = rank, world
        self.capacity = region_bytes
        self.op_number = 0  # launches so far: the next one's number is one more
        self._held: list[Allocation] = []
        self.launcher: Any = None
        try:
            self.region = self._malloc(geometry.PAD_BYTES + region_bytes)
            self.out = self._malloc(region_bytes)
            stream = runtime.new_stream()
            runtime.from_host(self.region.ptr, np.zeros(geometry.PAD_WORDS, np.uint32), stream)
            runtime.synchronize(stream)
            exchange.publish(_REGIONS_KEY, json.dumps(
                {"pid": os.getpid(), "region": self.region.ptr}).encode())
            records = [json.loads(exchange.read(_REGIONS_KEY, r, deadline))
                       for r in range(world)]
            strangers = [r for r, record in enumerate(records) if record["pid"] != os.getpid()]
            if strangers:  # the verdict keeps such groups off this engine
                raise ValueError(f"rank(s) {strangers} are other processes: the kernel path's "
                                 "launch here serves ranks of one process only")
            self.pads = tuple(int(record["region"]) for record in records)
            self.data = tuple(pad + geometry.PAD_BYTES for pad in self.pads)
            self.key = (int(records[0]["pid"]), self.pads[0])
            self.launcher = runtime.kernel_launcher(self.key, world)
        except BaseException:
            self._free()
            raise

    def _malloc(self, nbytes: int) -> Allocation:
        allocation = self.runtime.malloc(nbytes)
        self._held.append(allocation)
        return allocation

    def allreduce(self, algorithm: str, ptr: int, count: int, dtype: np.dtype, op: ReduceOp,
                  stream: Stream, ctx: OpContext) -> None:
        """``count`` elements at ``ptr`` reduced over the group in place, piece by piece:
        each piece copied into this rank's region, one launch of ``algorithm``, the result
        copied back (the one-shot's from this rank's output, the two-shot's from the
        region it wrote in place)."""
        runtime = self.runtime
        per = self.capacity // dtype.itemsize
        mine = self.data[self.rank]
        for first in range(0, count, per):
            n = min(per, count - first)
            at = ptr + first * dtype.itemsize
            runtime.copy(mine, at, n * dtype.itemsize, stream)
            runtime.synchronize(stream)  # the fake's launch reads memory as it is now
            self.op_number += 1
            self._launch(algorithm, n, dtype, op, ctx)
            source = self.out.ptr if algorithm == "kernel-oneshot" else mine
            runtime.copy(at, source, n * dtype.itemsize, stream)
        runtime.synchronize(stream)  # the next op's launch writes the region again

    def _launch(self, algorithm: str, count: int, dtype: np.dtype, op: ReduceOp,
                ctx: OpContext) -> None:
        one_shot = algorithm == "kernel-oneshot"
        self.launcher.launch_kernel(
            algorithm="one_shot" if one_shot else "two_shot", rank=self.rank, data=self.data,
            pads=self.pads, count=count, dtype=dtype, op=op, op_number=self.op_number,
            blocks=_BLOCKS, threads=_THREADS, out=self.out.ptr if one_shot else None,
            deadline=ctx.deadline)

    def _free(self) -> None:
        for allocation in self._held:
            self.runtime.free(allocation)
        self._held.clear()

    def close(self, *, failed: bool = False) -> None:
        """Give the region and output back (no peer maps them: the ranks share one
        process's memory) and let go of the launcher."""
        try:
            self._free()
        finally:
            if self.launcher is not None:
                self.launcher.release()
                self.launcher = None

    def abandon(self) -> None:
        """After a failure whose device work may never end: let go of the launcher, keep
        the memory (freeing it would wait for that work)."""
        if self.launcher is not None:
            self.launcher.release()
            self.launcher = None

    def describe(self) -> str:
        return (f"{self.name}: one kernel per allreduce over {self.world} mapped regions of "
                f"{self.capacity} B, {self.op_number} launches so far")


class KernelEngine(Engine):
    """Allreduces of device memory on the kernel path (module docstring): the schedule it
    is handed has no steps, only the algorithm (``kernel-oneshot``, ``kernel-twoshot``)."""

    name = CUDA_KERNEL

    def __init__(self, lane: DeviceLane, rank: int, world_size: int) -> None:
        assert isinstance(lane.channel, KernelChannel)
        self.lane = lane
        self.channel = lane.channel
        self.runtime = lane.runtime
        self.moves = frozenset({lane.runtime.memory})
        self.rank = rank
        self.world_size = world_size

    def run(self, schedule: Schedule, buffers: Mapping[str, Buffer], ctx: OpContext) -> None:
        if schedule.collective != "allreduce" or schedule.algorithm not in ALLREDUCE_KERNELS:
            raise ValueError(f"the {self.name} engine runs {', '.join(ALLREDUCE_KERNELS)} "
                             f"allreduces, not {schedule.algorithm} {schedule.collective}")
        assert ctx.reduce is not None
        with held(self.lane) as (device, lifted):
            pointers = stage_in(self.lane, buffers, self.name, device, lifted)
            data = buffers["data"]
            self.channel.allreduce(schedule.algorithm, pointers["data"], data.count, ctx.dtype,
                                   ctx.reduce, self.lane.stream, ctx)
            stage_out(self.lane, device, lifted, {"data"})

    def describe(self) -> str:
        return f"{self.channel.describe()} on {self.runtime.name} ({self.runtime.memory})"
