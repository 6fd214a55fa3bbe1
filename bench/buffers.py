"""The sweep's buffers and the results they must hold: what every backend of ``ringcomm
bench`` (and MPI's ranks, ``mpi_peer``) fills, runs a collective on, and is checked against.

Kept apart from the sweep so that the processes which only move data (MPI's ranks) use the
very same buffers and checks without importing the sweep that starts them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .adapter import collective as collective_spec

PERIOD = 5  # rank r's element k is r + 1 + k % PERIOD: small integers, exact in every dtype
CHUNK = PERIOD * (1 << 18)  # elements filled or checked at a time (bounded extra memory)


class Reference:
    """Each rank's input pattern and its expected results for one collective at one size,
    each at most one period-aligned chunk long.

    Rank ``r`` holds ``r + 1 + k % 5`` at element ``k`` of its input, so every block of
    every result repeats with period 5 as well. The table of collectives' ``reference``
    runs the same collective on blocks of ``5 + block % 5`` elements (on the blocks
    themselves when they are shorter than 10): their elements fall at the same phases of
    the pattern, so the first five elements of each small result block are the period of
    the real one, and a buffer of any length is checked without building an equally large
    expected array."""

    def __init__(self, collective: str, world: int, count: int, dtype: Any,
                 op: str | None) -> None:
        import torch

        spec = collective_spec(collective)
        k = torch.arange(CHUNK + PERIOD, dtype=torch.int64) % PERIOD
        self.inputs = [(k + r + 1).to(dtype) for r in range(world)]
        self.block = spec.block(count, world)
        self.blocks = world if spec.role(spec.result).world_blocks else 1  # per result
        short = self.block < 2 * PERIOD
        self._small = self.block if short else PERIOD + self.block % PERIOD
        wide = np.float64 if dtype.is_floating_point else np.int64
        size = spec.sizes(self._small, world)[spec.source]
        small = [(np.arange(size) % PERIOD + r + 1).astype(wide) for r in range(world)]
        self._results = [torch.from_numpy(x).to(dtype)
                         for x in spec.reference(small, op or "sum", root=0)]
        self._period = PERIOD if not short else None
        self._expected: dict[tuple[int, int], Any] = {}
        eps = {torch.float16: 1e-2, torch.bfloat16: 2e-2, torch.float32: 1e-5}
        self.rtol = eps.get(dtype, 1e-12) if dtype.is_floating_point else 0.0

    def expected(self, rank: int, block: int) -> Any:
        """Block ``block`` of ``rank``'s result, as long as one chunk of it at most."""
        key = (rank, block)
        if key not in self._expected:
            start = block * self._small
            if self._period is None:  # short blocks: the small problem is the real one
                values = self._results[rank][start:start + self._small]
            else:
                period = self._results[rank][start:start + PERIOD]
                values = period.repeat(min(self.block, CHUNK) // PERIOD + 1)
            self._expected[key] = values
        return self._expected[key]

    def fill(self, out: Any, values: Any) -> None:
        """``out`` to ``values`` repeated (``values`` one chunk of a period-5 pattern)."""
        for s in range(0, out.numel(), CHUNK):
            part = out[s:s + CHUNK]
            part.copy_(values[:part.numel()])

    def wrong(self, actual: Any, values: Any) -> int:
        """Elements of ``actual`` that differ from ``values`` repeated chunk by chunk."""
        import torch

        bad = 0
        for s in range(0, actual.numel(), CHUNK):
            part = actual[s:s + CHUNK]
            want = values[:part.numel()]
            if self.rtol:
                ok = torch.isclose(part.float() if part.itemsize < 4 else part,
                                   want.float() if want.itemsize < 4 else want,
                                   rtol=self.rtol, atol=0)
                bad += int((~ok).sum())
            else:
                bad += int((part != want).sum())
        return bad


class Buffers:
    """One collective's buffers on one rank, sized as the table of collectives says: how to
    fill them, and how to check them."""

    def __init__(self, collective: str, rank: int, world: int, count: int, dtype: Any,
                 ref: Reference, device: str = "cpu") -> None:
        import torch

        self.collective, self.rank, self.world, self.ref = collective, rank, world, ref
        spec = collective_spec(collective)
        sizes = spec.sizes(spec.block(count, world), world, rank=rank)
        make = lambda c: torch.zeros(c, dtype=dtype, device=device)  # noqa: E731
        if "data" in sizes:
            self.inp = self.out = make(sizes["data"])  # in place
        else:
            self.inp, self.out = make(sizes["input"]), make(sizes["output"])
        self.device = device

    def _host(self, t: Any) -> Any:
        return t if self.device == "cpu" else t.cpu()

    def reset(self) -> None:
        """Inputs to this rank's pattern, outputs to zeros (no pattern value is zero)."""
        host = self._host(self.inp)
        if self.collective == "broadcast" and self.rank != 0:
            host.zero_()
        else:
            self.ref.fill(host, self.ref.inputs[self.rank])
        if host is not self.inp:
            self.inp.copy_(host)
        if self.out is not self.inp:
            self.out.zero_()

    def steady(self, op: str | None) -> None:
        """Make repeated in-place allreduces leave the data as it is: sums of zeros and
        products of ones, instead of values that grow by ``world_size`` every call until
        they overflow. (min, max and avg settle after one call.)"""
        if self.collective == "allreduce" and op in ("sum", "prod"):
            self.inp.fill_(0 if op == "sum" else 1)

    def wrong(self) -> int:
        """Elements of this rank's result that differ from the expected values."""
        out, ref, b = self._host(self.out), self.ref, self.ref.block
        return sum(ref.wrong(out[j * b:(j + 1) * b], ref.expected(self.rank, j))
                   for j in range(ref.blocks))
