"""The registry of algorithm names: one row per algorithm, the one list every other list of
names comes from.

An algorithm's name travels on the wire (a header carries its code, so ranks that run
different algorithms raise ``DesyncError``), is forced by ``RINGCOMM_ALGO`` and
``algorithm=``, is printed by ``ringcomm schedule`` and named in traces and errors. Kept in
one table, a new algorithm is one row here plus its schedule builder in the table of
collectives (``ringcomm.plan.collectives``), which refuses a builder whose name has no row.

Each row says which engine runs it (``links``: messages between pairs of ranks; ``board``:
the shared memory of one host's ranks; ``nccl``: NCCL's own collective) and whether the
cost model prices it as an allreduce candidate. The device engines (``nccl``, ``cuda-ipc``,
``staged``) run the same messages on device memory, so every algorithm of the links is
theirs too (``engines_of``). A row's
wire code is its position: rows are only ever appended.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

LINKS = "links"  # the link executor: messages over each pair's link
BOARD = "board"  # the shared board: posts and takes in memory all local ranks map
CUDA_IPC = "cuda-ipc"  # device memory of one host's ranks, mapped by each other
STAGED = "staged"  # device memory through page-locked host memory and the links
NCCL = "nccl"  # device memory through NCCL's communicator (CuPy's cupy.cuda.nccl)
# device memory of one host's ranks, one kernel per op over regions every rank maps, the
# ranks meeting through flags in device memory (``ringcomm.plan.kernel_path``)
CUDA_KERNEL = "cuda-kernel"
# in the selector's order of preference (NCCL only where asked for: RINGCOMM_DEVICE_ENGINE)
DEVICE_ENGINES: tuple[str, ...] = (NCCL, CUDA_IPC, STAGED)


@dataclass(frozen=True)
class AlgorithmName:
    """One algorithm as everything outside its schedule builder knows it."""

    name: str
    engine: str  # LINKS or BOARD
    allreduce: bool  # a candidate allreduce of the cost model (and of RINGCOMM_ALGO)
    summary: str


# In wire order: code = position + 1 (0 means no algorithm). Append only.
_ROWS = (
    AlgorithmName("ring", LINKS, True,
                  "ring reduce-scatter then ring all-gather, pipelined in segments"),
    AlgorithmName("tree", LINKS, True, "binary tree: reduce up, broadcast down, pipelined"),
    AlgorithmName("dbtree", LINKS, True, "double binary tree: each tree carries half"),
    AlgorithmName("hd", LINKS, True, "recursive halving then doubling (Rabenseifner)"),
    AlgorithmName("rd", LINKS, True,
                  "recursive doubling: log2 n exchanges of everything (small messages)"),
    AlgorithmName("chain", LINKS, False, "a pipelined chain from or towards the root"),
    AlgorithmName("binomial", LINKS, False, "a binomial tree from the root"),
    AlgorithmName("direct", LINKS, False, "each block straight to or from the root"),
    AlgorithmName("pairwise", LINKS, False, "pairwise exchange of blocks"),
    AlgorithmName("dissemination", LINKS, False, "log2(n) rounds of empty messages"),
    AlgorithmName("hier", LINKS, True,
                  "two levels: reduce inside each host, allreduce among the hosts' leaders, "
                  "broadcast inside each host"),
    AlgorithmName("board", BOARD, False,
                  "one post per rank on the shared board, every rank reads every post"),
    AlgorithmName("twoshot", BOARD, False,
                  "on the shared board, piece by piece: each rank folds its chunk from "
                  "everyone's post, then takes everyone's folded chunk"),
    AlgorithmName("nccl", NCCL, False,
                  "NCCL's own collective, on the nccl engine (device memory)"),
    AlgorithmName("kernel-oneshot", CUDA_KERNEL, False,
                  "one kernel: every rank reduces every rank's mapped data into its own "
                  "output (device memory, small messages)"),
    AlgorithmName("kernel-twoshot", CUDA_KERNEL, False,
                  "one kernel, in place: each rank reduces its 1/p slice from every rank and "
                  "writes it into every rank's buffer (device memory, large messages)"),
    AlgorithmName("kernel-direct", CUDA_KERNEL, False,
                  "one kernel: each rank reads its block of every rank's mapped data and "
                  "reduces it (reduce-scatter), or every rank's mapped data into its output "
                  "(all-gather) (device memory)"),
)

ALGORITHMS = MappingProxyType({row.name: row for row in _ROWS})
WIRE_NAMES: tuple[str, ...] = ("-", *(row.name for row in _ROWS))  # code -> name
WIRE_CODES = MappingProxyType({name: code for code, name in enumerate(WIRE_NAMES)})

# The allreduce algorithms that run over links, in the order the cost model tries them,
# and those of the shared board (taken by size where a group has one, never priced).
ALLREDUCE_OVER_LINKS: tuple[str, ...] = tuple(r.name for r in _ROWS if r.allreduce)
ALLREDUCE_ON_BOARD: tuple[str, ...] = ("board", "twoshot")
# the allreduce algorithms of the kernel path (cuda-kernel engine): one launch each, no steps
ALLREDUCE_KERNELS: tuple[str, ...] = ("kernel-oneshot", "kernel-twoshot")
# the kernel path's one algorithm of each other collective it runs
KERNEL_DIRECT = "kernel-direct"
KERNEL_COLLECTIVES = frozenset({"reduce_scatter", "allgather"})
# the collectives NCCL has a call of its own for: the ``nccl`` algorithm's
NCCL_OWN = frozenset({"allreduce", "reduce_scatter", "allgather", "broadcast", "reduce"})


def engines_of(name: str) -> tuple[str, ...]:
    """The engines that run algorithm ``name``: the board's on the board only; every other
    over the links and on each device engine, which walk the same messages."""
    row = ALGORITHMS[name]
    if row.engine != LINKS:  # the board's, NCCL's own: where they run only
        return (row.engine,)
    return (LINKS, *DEVICE_ENGINES)
