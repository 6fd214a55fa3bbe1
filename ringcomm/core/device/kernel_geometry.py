"""Where the device kernels put things: the signal pad's slots, each rank's slice, each
block's units, the grid. One description for every side that must agree with
``ringcomm/engines/kernels/allreduce.cu``: the channel that sizes grids and the launchers
(``ringcomm.engines.kernel``, ``kernels.cupy_launch``), and the numpy mirror of the kernels
(``ringcomm.testing.fake_kernels``). A test compares the constants here with the CUDA
source's.

Why the mirror takes these from here rather than computing its own: a slice or a block
assignment that differed from the kernel's would make the mirror test another algorithm.
"""

from __future__ import annotations

from collections.abc import Iterator

MAX_RANKS = 8  # kMaxRanks
MAX_BLOCKS = 128  # kMaxBlocks
MAX_THREADS = 512  # kMaxThreads
VECTOR_BYTES = 16  # kVectorBytes: one vector load
PHASES = ("start", "end")  # kPhaseStart, kPhaseEnd: a pad row each
FLAG_BYTES = 4  # one unsigned int
ABORT_WORD = len(PHASES) * MAX_BLOCKS * MAX_RANKS  # kAbortWord: after the flags
PAD_WORDS = ABORT_WORD + VECTOR_BYTES // FLAG_BYTES  # kPadWords: the abort word, padded
PAD_BYTES = PAD_WORDS * FLAG_BYTES  # 8 KiB + 16 B: a multiple of 16, so data stays aligned


def pad_slot(phase: str, block: int, rank: int) -> int:
    """The word of a pad that block ``block`` of rank ``rank`` writes at ``phase``
    (``pad_slot`` in the kernel)."""
    return (PHASES.index(phase) * MAX_BLOCKS + block) * MAX_RANKS + rank


def reached(seen: int, op_number: int) -> bool:
    """Whether a flag that says ``seen`` has reached op ``op_number``: the kernel's
    ``(int)(seen - op_number) >= 0``, right across the 32-bit counter's wrap."""
    return (seen - op_number) % (1 << 32) < (1 << 31)


def vector_width(itemsize: int) -> int:
    """Elements in one 16-byte vector load (``vector_width<T>()``): 1 for 16-byte items."""
    return max(1, VECTOR_BYTES // itemsize)


def aligned(pointer: int) -> bool:
    """Whether ``pointer`` takes vector loads. A one-shot loads vectors where every data
    buffer and its output are aligned, a two-shot where every data buffer is (each rank maps
    them at the same offsets, so every rank cuts the same slices); else one element at a
    time."""
    return pointer % VECTOR_BYTES == 0


def two_shot_slice(units: int, rank: int, world: int) -> tuple[int, int]:
    """The units ``[lo, hi)`` rank ``rank`` reduces and writes everywhere: ceil(units /
    world) each, the last ones shorter or empty (``slice_of``). The elements after the last
    whole vector belong to rank ``world - 1``."""
    per = -(-units // world)
    lo = min(per * rank, units)
    return lo, min(lo + per, units)


def grid_stride(first: int, end: int, block: int, blocks: int,
                threads: int) -> Iterator[tuple[int, int]]:
    """The units of ``[first, end)`` that block ``block`` handles, one ``(lo, hi)`` range per
    turn of the kernel's grid-stride loop: turn ``k`` gives its threads units
    ``first + (k * blocks + block) * threads`` onwards, one each."""
    step = blocks * threads
    lo = first + block * threads
    while lo < end:
        yield lo, min(lo + threads, end)
        lo += step


def grid_blocks(algorithm: str, count: int, itemsize: int, world: int, threads: int,
                multiprocessors: int) -> int:
    """Blocks per rank for one launch: enough for every thread to get a unit (of the whole
    array for the one-shot, of a rank's slice for the two-shot, of its block for the
    reduce-scatter, of its bytes for the all-gather, whose ``itemsize`` is 1), at most
    ``MAX_BLOCKS`` (the pad's rows), and at most ``multiprocessors // world``, so that
    every block of every rank can be resident at once (ranks that share a GPU share its
    SMs; a block that waits on a peer's block that cannot be scheduled would spin for
    ever). Every rank must launch the same grid (block b meets block b): every input here
    is agreed (``multiprocessors``: the least of the ranks' devices')."""
    units = -(-count // vector_width(itemsize))
    if algorithm == "two_shot":
        units = -(-units // world)
    wanted = max(1, -(-units // threads))
    return max(1, min(wanted, MAX_BLOCKS, multiprocessors // world))


def check_output(algorithm: str, data: tuple[int, ...], out: int | None, count: int,
                 stride: int) -> None:
    """What every launch's output must hold (both launchers check): the two-shot writes in
    place; every other kernel writes to an output of this rank's own, never a data buffer
    (every peer reads those while the kernel runs); the all-gather's ranks' blocks in it
    (``stride`` bytes apart) do not overlap."""
    if algorithm == "two_shot":
        return
    if out is None or out in data:
        raise ValueError(f"the {algorithm} writes to an output of this rank's own, never a "
                         "data buffer, which every peer reads during the kernel")
    if algorithm == "all_gather" and stride < count:
        raise ValueError(f"the all-gather's stride ({stride} B) is shorter than a rank's "
                         f"{count} B")


def check_launch(world: int, blocks: int, threads: int) -> None:
    """What every launch must hold (the host checks before launching; the mirror too):
    the pads have room for ``blocks`` and ``world``, and a block has a thread per rank to
    meet with."""
    if not 1 <= world <= MAX_RANKS:
        raise ValueError(f"the kernels serve 1 to {MAX_RANKS} ranks, not {world}")
    if not 1 <= blocks <= MAX_BLOCKS:
        raise ValueError(f"blocks must be 1 to {MAX_BLOCKS} (the pad's rows), not {blocks}")
    if not world <= threads <= MAX_THREADS:
        raise ValueError(f"threads per block must be {world} (one per rank, to meet) to "
                         f"{MAX_THREADS}, not {threads}")
