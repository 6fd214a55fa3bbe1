"""The device allreduce kernels' algorithm, played by their numpy mirror on the fake runtime
(``ringcomm/testing/fake_kernels.py``): right for every dtype and op at worlds 1-4 under
every schedule, and wrong, every time, with any one of its waits taken out.

The mirror follows ``ringcomm/engines/kernels/allreduce.cu`` step by step (same slices,
blocks and pad slots), so these tests are the kernels' own on a CPU; on a GPU the kernel
path's gpu tests (``tests/test_kernel_path.py``) run the real kernels against numpy.
"""

from __future__ import annotations

import functools

import kernel_cases
import numpy as np
import pytest

from ringcomm.core.device import kernel_geometry as geometry
from ringcomm.core.device import runtime
from ringcomm.core.dtypes import DTYPE_NAMES, REDUCE_OPS, finish_reduction, reduce_into
from ringcomm.testing import FakeDeviceFault, FakeRuntime
from ringcomm.testing.fake_kernels import (
    ALGORITHMS,
    STALE_BYTE,
    WAITS,
    KernelMirror,
    Launch,
    MappedRegions,
)

DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
HALVES = ("float16", "bfloat16")
# 45 elements in 2 blocks of 4 threads: several grid-stride turns per block, a slice per
# rank, and a tail after the last 16-byte vector for every dtype narrower than 16 bytes
COUNT = 45
# enough for every block of every rank's slice to have work at worlds 2-4: where a block has
# none, the start meeting of the blocks after it can hide a missing end wait
LONG = 1000


@pytest.fixture(scope="module")
def fake() -> FakeRuntime:
    rt = runtime("fake")
    assert isinstance(rt, FakeRuntime)
    return rt


def inputs(dtype_name: str, op: str, world: int, seed: int, count: int = COUNT) -> list:
    """One input per rank: values that make a wrong or stale element show (no zeros where a
    product would hide them; integers that wrap): the engine tests' own
    (``kernel_cases.inputs``)."""
    return kernel_cases.inputs(DTYPES[dtype_name], op, world, count, seed)


def host_path(values: list[np.ndarray], op: str) -> np.ndarray:
    """What ringcomm's host path gives: reduce_into rank by rank, then finish_reduction."""
    acc = values[0].copy()
    for x in values[1:]:
        reduce_into(acc, acc, x, REDUCE_OPS[op])
    finish_reduction(acc, REDUCE_OPS[op], len(values))
    return acc


def float32_accumulated(values: list[np.ndarray], op: str) -> np.ndarray:
    """float16 and bfloat16 as the kernels reduce them: in float32, rounded once."""
    acc = functools.reduce(REDUCE_OPS[op].ufunc, [x.astype(np.float32) for x in values])
    if REDUCE_OPS[op].divides:
        acc = acc / np.float32(len(values))
    return acc.astype(values[0].dtype)


def check(results: list[np.ndarray], values: list[np.ndarray], dtype_name: str, op: str,
          what: str) -> None:
    """Every rank's result has the same bits, and they are numpy's."""
    for rank, result in enumerate(results):
        np.testing.assert_array_equal(result, results[0], err_msg=f"{what}: rank {rank}")
    expected = host_path(values, op)
    got = results[0]
    if dtype_name in HALVES:
        np.testing.assert_array_equal(got, float32_accumulated(values, op), err_msg=what)
        np.testing.assert_allclose(got.astype(np.float32), expected.astype(np.float32),
                                   rtol=2e-2, atol=2e-2 * len(values), err_msg=what)
    elif op == "prod" and expected.dtype.kind == "c":
        # numpy's complex product fuses into FMAs where the CPU has them; the kernel's
        # rounds every operation: the same to the last bit or two
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=what)
    else:
        np.testing.assert_array_equal(got, expected, err_msg=what)


class Job:
    """Allreduces queued on every rank of one set of mapped regions, op numbers counting
    on from the last job's (the pads are never reset)."""

    def __init__(self, rt: FakeRuntime, world: int, *, offset: int = 0,
                 data_bytes: int = 16 * COUNT, blocks: int = 2, threads: int = 4) -> None:
        self.regions = MappedRegions(rt, world, data_bytes, offset)
        self.world, self.blocks, self.threads = world, blocks, threads
        self.op_number = 0

    def run(self, ops: list[tuple[str, str, list[np.ndarray]]], *, schedule: str = "random",
            seed: int = 0, left_out: tuple[str, ...] = (),
            numbers: list[int] | None = None) -> list[list[np.ndarray]]:
        """``ops``: (algorithm, op, one input per rank) each, in order on every rank; the
        results, one per op and rank."""
        r = self.regions
        mirror = KernelMirror(r.rt, schedule=schedule, seed=seed, left_out=left_out)
        results = []
        for algorithm, op, values in ops:
            self.op_number += 1
            per_rank = []
            for rank in range(self.world):
                number = numbers[rank] if numbers else self.op_number
                out = r.outs[rank] if algorithm == "one_shot" else None
                mirror.copy_in(rank, r.data[rank], values[rank])
                mirror.launch(Launch(algorithm, rank, r.data, r.pads, values[rank].size,
                                     values[rank].dtype, REDUCE_OPS[op], number,
                                     self.blocks, self.threads, out))
                per_rank.append(mirror.copy_out(rank, r.data[rank] if out is None else out,
                                                values[rank].size, values[rank].dtype))
            results.append(per_rank)
        mirror.run()
        return results

    def close(self) -> None:
        self.regions.close()


PAIRS = [(dtype, op) for op in REDUCE_OPS for dtype in sorted(REDUCE_OPS[op].dtypes)]


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_dtype_and_op_equals_numpy(fake: FakeRuntime, algorithm: str, world: int) -> None:
    """Every (dtype, op) the host path has, as one run of back-to-back ops on one set of
    regions, under a seeded random interleaving of every rank's blocks."""
    job = Job(fake, world)
    try:
        ops = [(algorithm, op, inputs(dtype, op, world, seed))
               for seed, (dtype, op) in enumerate(PAIRS)]
        for seed, results in enumerate(job.run(ops, seed=world)):
            dtype, op = PAIRS[seed]
            check(results, ops[seed][2], dtype, op, f"{algorithm} {op} {dtype} at {world}")
    finally:
        job.close()


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_unaligned_buffers_take_the_one_element_path(fake: FakeRuntime, algorithm: str) -> None:
    """Data 4 bytes off 16-byte alignment: every dtype one element at a time, still right."""
    world = 3
    assert not geometry.aligned(geometry.PAD_BYTES + 4)
    job = Job(fake, world, offset=4)
    try:
        pairs = [(dtype, "sum") for dtype in sorted(REDUCE_OPS["sum"].dtypes)]
        ops = [(algorithm, op, inputs(dtype, op, world, seed))
               for seed, (dtype, op) in enumerate(pairs)]
        results = job.run(ops, seed=7)
        for (dtype, op), (_, _, values), per_rank in zip(pairs, ops, results, strict=True):
            check(per_rank, values, dtype, op, f"{algorithm} {dtype} unaligned")
    finally:
        job.close()


@pytest.mark.parametrize("schedule", ["low_ranks_first", "high_ranks_first"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_right_when_one_rank_runs_far_ahead(fake: FakeRuntime, algorithm: str,
                                             schedule: str) -> None:
    """The schedules the wait tests below use, with every wait in: right, op after op."""
    for world in (2, 3, 4):
        job = Job(fake, world, blocks=3)
        try:
            ops = [(algorithm, "sum", inputs("float32", "sum", world, seed)) for seed in range(3)]
            for (_, _, values), results in zip(ops, job.run(ops, schedule=schedule), strict=True):
                check(results, values, "float32", "sum", f"{algorithm} at {world}")
        finally:
            job.close()


def wrong(results: list[list[np.ndarray]], ops: list) -> bool:
    """Whether any rank's result of any op differs from numpy's."""
    return any(not np.array_equal(result, host_path(values, "sum"))
               for (_, _, values), per_rank in zip(ops, results, strict=True)
               for result in per_rank)


@pytest.mark.parametrize("wait", WAITS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_each_wait_is_needed(fake: FakeRuntime, algorithm: str, wait: str) -> None:
    """Take one wait out of the kernel and a rank reads data that is not there yet (start:
    a peer's input before it is copied in; two-shot end: a slice before its owner wrote it)
    or no longer there (one-shot end: a peer's buffer already holding its next input):
    wrong, under both one-sided schedules, at every world of 2 or more."""
    for world in (2, 3, 4):
        for schedule in ("low_ranks_first", "high_ranks_first"):
            job = Job(fake, world, data_bytes=4 * LONG)
            try:
                ops = [(algorithm, "sum", inputs("float32", "sum", world, seed, LONG))
                       for seed in range(2)]
                results = job.run(ops, schedule=schedule, left_out=(wait,))
                assert wrong(results, ops), f"{algorithm} without {wait} at {world}, {schedule}"
            finally:
                job.close()


@pytest.mark.parametrize("wait", WAITS)
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_missing_wait_shows_under_random_interleavings_too(fake: FakeRuntime, algorithm: str,
                                                              wait: str) -> None:
    """Not only under the one-sided schedules: most random interleavings catch it."""
    world, caught = 3, 0
    for seed in range(10):
        job = Job(fake, world, data_bytes=4 * LONG)
        try:
            ops = [(algorithm, "sum", inputs("float32", "sum", world, i, LONG)) for i in range(2)]
            caught += wrong(job.run(ops, seed=seed, left_out=(wait,)), ops)
        finally:
            job.close()
    assert caught >= 5, f"{algorithm} without {wait}: caught by {caught} of 10 seeds"


def test_the_pads_count_ops_and_are_never_reset(fake: FakeRuntime) -> None:
    """After n ops each pad slot a block wrote holds n: the op's number is the flag, so the
    next op needs nothing cleared; one-shot and two-shot share the pads."""
    world, blocks = 3, 2
    job = Job(fake, world, blocks=blocks)
    try:
        ops = [(algorithm, "max", inputs("int32", "max", world, seed))
               for seed, algorithm in enumerate(ALGORITHMS * 2)]
        job.run(ops, seed=3)
        for rank, pad in enumerate(job.regions.pads):
            words = job.regions.pad_words(pad)
            for phase in WAITS:
                for block in range(blocks):
                    for peer in range(world):
                        assert words[geometry.pad_slot(phase, block, peer)] == len(ops), (
                            rank, phase, block, peer)
            assert int(words.sum()) == len(WAITS) * blocks * world * len(ops)
    finally:
        job.close()


def test_op_numbers_wrap_around(fake: FakeRuntime) -> None:
    """The counters are 32 bits: ops numbered across 2**32 meet as any others."""
    world = 2
    job = Job(fake, world)
    try:
        for pad in job.regions.pads:  # every flag; the abort word stays clear
            job.regions.pad_words(pad)[:geometry.ABORT_WORD] = (1 << 32) - 2
        job.op_number = (1 << 32) - 2
        ops = [(algorithm, "sum", inputs("float32", "sum", world, seed))
               for seed, algorithm in enumerate(ALGORITHMS * 2)]
        for (_, _, values), results in zip(ops, job.run(ops, seed=1), strict=True):
            check(results, values, "float32", "sum", "across the wrap")
    finally:
        job.close()


def test_ranks_that_disagree_on_the_op_number_hang(fake: FakeRuntime) -> None:
    """A rank a number ahead waits for flags no peer will write: on a GPU a spin for ever,
    here a FakeDeviceFault naming the waits (why the host numbers ops the same everywhere)."""
    job = Job(fake, 2)
    try:
        ops = [("two_shot", "sum", inputs("float32", "sum", 2, 0))]
        with pytest.raises(FakeDeviceFault, match="device hang.*rank 1 block 0 at start of op 2"):
            job.run(ops, numbers=[1, 2])
    finally:
        job.close()


def test_the_abort_word_ends_a_wait_that_would_never_end(fake: FakeRuntime) -> None:
    """What the host does when it gives up on an op (a peer lost, the deadline passed): it
    sets the abort word of its rank's pad, and that rank's blocks stop waiting and return
    (without their result, where they had not met their peers yet), so the kernel ends
    instead of spinning for ever. Here both ranks' are set: rank 0 waits at the end for a
    rank 1 that gave up at the start."""
    job = Job(fake, 2)
    try:
        for pad in job.regions.pads:
            job.regions.pad_words(pad)[geometry.ABORT_WORD] = 1
        values = inputs("float32", "sum", 2, 0)
        ((_, one),) = job.run([("one_shot", "sum", values)], numbers=[1, 2])  # no hang
        # rank 1 waited at the start for an op 2 no peer runs: it returned reducing nothing
        assert one.tobytes() == np.full(values[1].nbytes, STALE_BYTE, np.uint8).tobytes()
    finally:
        job.close()


def test_launches_the_kernels_cannot_take_are_refused(fake: FakeRuntime) -> None:
    job = Job(fake, 2)
    r = job.regions
    f32 = np.dtype(np.float32)
    try:
        def launch(**changes: object) -> None:
            fields = dict(algorithm="one_shot", rank=0, data=r.data, pads=r.pads, count=4,
                          dtype=f32, op=REDUCE_OPS["sum"], op_number=1, blocks=2, threads=4,
                          out=r.outs[0])
            fields.update(changes)
            KernelMirror(fake).launch(Launch(**fields))  # type: ignore[arg-type]

        launch()
        with pytest.raises(ValueError, match="never a data buffer"):
            launch(out=r.data[1])
        with pytest.raises(ValueError, match="blocks must be"):
            launch(blocks=geometry.MAX_BLOCKS + 1)
        with pytest.raises(ValueError, match="one per rank"):
            launch(threads=1)
        with pytest.raises(ValueError, match="1 to 8 ranks"):
            launch(data=(r.data[0],) * 9, pads=(r.pads[0],) * 9)
        with pytest.raises(Exception, match="not defined for complex64"):
            launch(dtype=np.dtype(np.complex64), op=REDUCE_OPS["max"])
    finally:
        job.close()


# ----------------------------------------------------------------------------- reduce-scatter
# and all-gather: one kernel each, the same meetings


def scatter_gather(fake: FakeRuntime, algorithm: str, world: int, per_rank: list[np.ndarray],
                   *, schedule: str = "random", seed: int = 0, left_out: tuple[str, ...] = (),
                   offset: int = 0, ops: int = 2, op: str = "sum") -> list[list[np.ndarray]]:
    """``ops`` launches of ``algorithm`` back to back on one set of regions, each rank's
    data holding ``per_rank[rank]`` (the reduce-scatter: its ``world`` blocks; the
    all-gather: its bytes, stride = its length), changed from op to op (``_nth``); every
    rank's output of each op."""
    size = per_rank[0].nbytes
    out_bytes = size // world if algorithm == "reduce_scatter" else size * world
    regions = MappedRegions(fake, world, max(size, out_bytes), offset)
    mirror = KernelMirror(fake, schedule=schedule, seed=seed, left_out=left_out)
    results: list[list[np.ndarray]] = []
    try:
        for number in range(1, ops + 1):
            outs = []
            for rank in range(world):
                values = _nth(per_rank[rank], number)
                mirror.copy_in(rank, regions.data[rank], values)
                if algorithm == "reduce_scatter":
                    count, dtype, rop, stride = values.size // world, values.dtype, \
                        REDUCE_OPS[op], 0
                else:
                    count, dtype, rop, stride = size, np.dtype(np.uint8), None, size
                mirror.launch(Launch(algorithm, rank, regions.data, regions.pads, count, dtype,
                                     rop, number, 3, 4, regions.outs[rank], stride))
                outs.append(mirror.copy_out(rank, regions.outs[rank], out_bytes // dtype.itemsize,
                                            dtype))
            results.append(outs)
        mirror.run()
    finally:
        regions.close()
    return results


def _nth(values: np.ndarray, number: int) -> np.ndarray:
    """Op ``number``'s input: the first op's bytes, each xor the op's number (a different
    input every op, so reading the next op's input shows)."""
    return (values.view(np.uint8) ^ np.uint8(number - 1)).view(values.dtype)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_reduce_scatter_of_every_dtype_and_op_equals_numpy(fake: FakeRuntime,
                                                          world: int) -> None:
    """Rank r's output is block r of every rank's input, reduced as the allreduce kernels
    reduce (float32 accumulation for the halves), under random interleavings."""
    for seed, (dtype, op) in enumerate(PAIRS):
        values = inputs(dtype, op, world, seed, COUNT * world)
        (results,) = scatter_gather(fake, "reduce_scatter", world, values, seed=seed, ops=1,
                                    op=op)
        for rank, got in enumerate(results):
            block = [v[rank * COUNT:(rank + 1) * COUNT] for v in values]
            check([got], block, dtype, op, f"reduce_scatter {op} {dtype} rank {rank}")


@pytest.mark.parametrize("offset", [0, 4])
@pytest.mark.parametrize("nbytes", [1, 45, 64, 1000])
def test_all_gather_puts_every_ranks_bytes_in_rank_order(fake: FakeRuntime, nbytes: int,
                                                         offset: int) -> None:
    """Every rank's output is every rank's bytes in rank order: 16 bytes at a time where
    aligned, byte by byte otherwise (4 bytes off, or a length that is no multiple of 16)."""
    for world in (1, 2, 3, 4):
        rng = np.random.default_rng(nbytes + world)
        values = [rng.integers(0, 256, nbytes, dtype=np.uint8) for _ in range(world)]
        for number, results in enumerate(scatter_gather(fake, "all_gather", world, values,
                                                        seed=world, offset=offset), 1):
            for got in results:
                assert got.tobytes() == b"".join(_nth(v, number).tobytes() for v in values)


def test_reduce_scatter_unaligned_takes_the_one_element_path(fake: FakeRuntime) -> None:
    world = 3
    values = inputs("float32", "sum", world, 5, COUNT * world)
    for number, results in enumerate(scatter_gather(fake, "reduce_scatter", world, values,
                                                    offset=4), 1):
        for rank, got in enumerate(results):
            check([got], [_nth(v, number)[rank * COUNT:(rank + 1) * COUNT] for v in values],
                  "float32", "sum", f"unaligned rank {rank}")


@pytest.mark.parametrize("wait", WAITS)
@pytest.mark.parametrize("algorithm", ["reduce_scatter", "all_gather"])
def test_each_wait_of_reduce_scatter_and_all_gather_is_needed(fake: FakeRuntime, algorithm: str,
                                                              wait: str) -> None:
    """Without the start meeting a rank reads a peer's input before it is copied in; without
    the end meeting a peer's data already holds its next op's input: wrong, under one of the
    one-sided schedules, at every world of 2 or more (the second op's inputs differ)."""
    for world in (2, 3, 4):
        caught = False
        for schedule in ("low_ranks_first", "high_ranks_first"):
            rng = np.random.default_rng(world)
            if algorithm == "reduce_scatter":
                values = inputs("float32", "sum", world, world, LONG * world)
            else:
                values = [rng.integers(0, 256, 4 * LONG, dtype=np.uint8) for _ in range(world)]
            firsts = scatter_gather(fake, algorithm, world, values, schedule=schedule,
                                    left_out=(wait,), ops=2)
            clean = scatter_gather(fake, algorithm, world, values, schedule=schedule, ops=2)
            caught |= any(not np.array_equal(a, b) for got, want in zip(firsts, clean,
                                                                        strict=True)
                          for a, b in zip(got, want, strict=True))
        assert caught, f"{algorithm} without {wait} at {world}"
