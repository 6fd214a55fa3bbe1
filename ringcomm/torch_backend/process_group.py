"""ringcomm as a ``torch.distributed`` backend: ``dist.init_process_group("ringcomm")``.

    import torch.distributed as dist
    dist.init_process_group("ringcomm")     # env://, tcp://, file:// or store=, as for gloo
    dist.all_reduce(t)                      # and every other collective, DDP, new_group...

Why it is thin: every collective already exists in ``Communicator``; a method here turns
torch's arguments into buffers (``tensors``: through the buffer kinds of
``ringcomm.core.tensors``, so a CPU tensor is used in place, a CUDA tensor taken as device
memory (by a device engine as it is, staged by its kind for the others), anything else
copied once and written back), maps the ``ReduceOp``, starts the op and
wraps what comes back in a ``torch.distributed.Work`` (``work``). Ranks meet through the
c10d store torch hands the backend (``registration``), so every init method torch has
works, and each ``new_group`` gets a communicator of its own.

A call torch says its caller waits for at once (``opts.asyncOp`` False, as in
``dist.all_reduce(t)``) runs as a blocking call, on the caller's thread where nothing is
queued, and its contiguous CPU tensors go to the communicator as views of their memory by
address, made once (``HostViews``); a blocking allreduce of one such tensor takes the board
engine's fast entry (``Communicator.allreduce_now``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from ..core.tensors import HostViews
from ..errors import ArgumentError, CommError, CommTimeout
from ..runtime.communicator import Communicator
from ..runtime.registration import Registration
from ..runtime.work import Work as CommWork
from .tensors import CallBuffers, check, movable, one, reduce_op, same
from .work import FinishedWork, RingcommWork, torch_style

BACKEND_NAME = "ringcomm"
_MONITORED_TAG = 2**31 - 16  # monitored_barrier's messages, apart from the user's tags
# where every buffer the group makes lives: said each time, since a program may have made
# another device torch's default (torch.set_default_device)
_HOST = torch.device("cpu")


class RingcommProcessGroup(dist.ProcessGroup):
    """A ``torch.distributed`` process group whose ops run on a ringcomm ``Communicator``.

    Created by torch through the registered backend; ``comm`` is the communicator (its
    ``transport.describe()`` tells how the ranks are connected).
    """

    def __init__(self, comm: Communicator) -> None:
        # (rank, size): a constructor torch has and its stub does not list
        super().__init__(comm.rank, comm.world_size)  # type: ignore[call-arg]
        self.comm = comm
        self._views = HostViews()
        # the handle of every blocking allreduce that ran to its end on the caller's thread:
        # torch only waits on it (``dist.all_reduce`` returns no handle when it blocks), and
        # one made per call cost a few microseconds of the smallest calls
        self._ran_here = FinishedWork("allreduce", None)
        self._group_name = ""
        self._group_desc = ""

    # -- identity
    def getBackendName(self) -> str:  # noqa: N802 - torch's name
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return (f"<RingcommProcessGroup {self._group_name or '?'} rank {self.comm.rank} of "
                f"{self.comm.world_size}>")

    def register_memory(self, tensor: torch.Tensor) -> Registration:
        """Register a CUDA tensor with the group's communicator, so the kernel path's ops
        on it run where it lies (``Communicator.register``: collective, held until its
        ``deregister`` or the group's end; a registration that holds nothing says why where
        the group has no kernel path). Our DDP registers its buckets through this."""
        return self.comm.register(tensor)

    # -- lifecycle
    def shutdown(self) -> None:
        """Called by ``destroy_process_group``: stop the worker, close sockets and files."""
        self._views = HostViews()  # a program that keeps the group (a DDP model) keeps no view
        self.comm.close()

    def abort(self) -> None:
        """Called by ``torch.distributed.distributed_c10d._abort_process_group``: end what is
        in flight, tell the peers, release everything (``Communicator.abort``); never
        raises."""
        self._views = HostViews()
        self.comm.abort("torch.distributed aborted the process group")

    def _start(self, opts: Any, method: Callable[..., Any], *args: Any,
               **kwargs: Any) -> CommWork:
        """Start one communicator op for torch. torch says whether its caller waits at once
        (``opts.asyncOp`` is False in ``dist.all_reduce(t)``): then the op runs as a
        blocking call (on this thread when nothing is queued: no hand-off to the worker and
        back) and comes back as a finished Work; its failure is raised by ``wait``, as an
        async op's would be. Bad arguments raise here either way."""
        if getattr(opts, "asyncOp", True):
            return method(*args, async_op=True, **kwargs)
        name = getattr(method, "__name__", "op")
        try:
            result = method(*args, async_op=False, **kwargs)
        except ArgumentError:
            raise
        except CommError as err:
            return CommWork.finished(name, self.comm.timeout, error=err)
        return CommWork.finished(name, self.comm.timeout, result)

    def _buffers(self, opts: Any) -> CallBuffers:
        """The buffers of a call: with the host views where its ops will run on this thread
        from start to end (``opts.asyncOp`` False, every op of it started through ``_start``,
        and nothing queued before them: ``Communicator.idle``), which is what lets it use
        them."""
        blocking = not getattr(opts, "asyncOp", True)
        return CallBuffers(self._views if blocking and self.comm.idle else None)

    def _work(self, name: str, parts: Sequence[CommWork], result: Any,
              call: CallBuffers | None = None) -> dist.Work:
        """The torch handle of ``parts``: a ``FinishedWork`` when all of them already ran (on
        this thread; their buffers wrote their results back as each op ended); else a
        ``RingcommWork`` that completes when the last part does. ``call``: the buffers made
        for the parts, whose CUDA tensors' streams the handle orders (see ``work``)."""
        device = call.device if call is not None else ()
        if not all(part.is_completed() for part in parts):
            return RingcommWork(name, parts, result, self.comm.timeout, device)
        error: BaseException | None = None
        source = -1
        for part in parts:
            failed = part.exception()
            if error is None and failed is not None:
                error = torch_style(failed, self.comm.timeout)
            if part.source is not None:
                source = part.source
        return FinishedWork(name, result if error is None else None, error, source, device)

    # torch's stub gives ProcessGroup's collectives the overloads of its Python API; c10d
    # calls a backend written in Python with (tensors..., opts) only. The overrides below
    # take that form, hence their `type: ignore[override]` (and `[assignment]` for aliases).

    # -- reductions
    def allreduce(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        op = reduce_op(opts)
        if len(tensors) == 1 and opts is not None and not opts.asyncOp:
            # dist.all_reduce(t), the commonest call, taken the short way: a view of its
            # memory, and the op runs here from start to end, or not at all
            view = self._views.tensor(tensors[0])
            if view is not None:
                try:
                    if self.comm.allreduce_now_on(view, op):
                        return self._ran_here
                except ArgumentError:
                    raise
                except CommError as err:  # raised by wait, as an async op's would be
                    return FinishedWork("allreduce", None,
                                        torch_style(err, self.comm.timeout))
        if any(t.is_sparse for t in tensors):
            return self._sparse_allreduce(tensors, op)
        call = self._buffers(opts)
        bufs = [call.of(t, f"tensors[{i}]", reduce=True, write=True)
                for i, t in enumerate(tensors)]
        parts = [self._start(opts, self.comm.allreduce, b, op) for b in bufs]
        return self._work("allreduce", parts, tensors, call)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None
                            ) -> dist.Work:
        """One allreduce per dtype, over that dtype's tensors laid end to end."""
        op = reduce_op(opts)
        groups: dict[torch.dtype, list[torch.Tensor]] = {}
        for i, t in enumerate(tensors):
            check(t, f"tensors[{i}]", reduce=True)
            groups.setdefault(t.dtype, []).append(t)
        call = CallBuffers()
        parts = [self._start(opts, self.comm.allreduce,
                             call.joined(same_dtype, "tensors", reduce=True, write=True), op)
                 for same_dtype in groups.values()]
        return self._work("allreduce_coalesced", parts, tensors, call)

    def reduce(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        call = self._buffers(opts)
        buf = call.of(one(tensors, "tensors"), "tensor", reduce=True, write=True)
        part = self._start(opts, self.comm.reduce, buf, root=opts.rootRank, op=reduce_op(opts))
        return self._work("reduce", [part], tensors, call)

    def reduce_scatter(  # type: ignore[override]  # c10d's form, see above
            self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any = None) -> dist.Work:
        out, inputs = one(output_tensors, "output_tensors"), one(input_lists, "input_lists")
        self._check_world(inputs, "input_list")
        same(inputs, "input_list", out.numel(), out.dtype)
        call = self._buffers(opts)
        src = call.joined(inputs, "input_list", reduce=True)
        dst = call.of(out, "output", reduce=True, write=True, read=False)
        part = self._start(opts, self.comm.reduce_scatter, dst, src, reduce_op(opts))
        return self._work("reduce_scatter", [part], output_tensors, call)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                              opts: Any = None) -> dist.Work:
        call = self._buffers(opts)
        part = self._reduce_scatter_tensor(opts, call, output, input, reduce_op(opts))
        return self._work("reduce_scatter_tensor", [part], [output], call)

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # see above

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        call, op = self._buffers(opts), reduce_op(opts)
        parts = [self._reduce_scatter_tensor(opts, call, o, i, op)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work("reduce_scatter_tensor_coalesced", parts, outputs, call)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced  # type: ignore[assignment]

    def _reduce_scatter_tensor(self, opts: Any, call: CallBuffers, output: torch.Tensor,
                               input: torch.Tensor, op: str) -> CommWork:  # noqa: A002
        self._check_numel(input, output.numel() * self.comm.world_size, "input",
                          "world_size * output.numel()")
        src = call.of(input, "input", reduce=True)
        dst = call.of(output, "output", reduce=True, write=True, read=False)
        return self._start(opts, self.comm.reduce_scatter, dst, src, op)

    # -- data movement
    def broadcast(  # type: ignore[override]  # c10d's form, see above
            self, tensors: list[torch.Tensor], opts: Any) -> dist.Work:
        call = self._buffers(opts)
        root = opts.rootRank
        is_root = self.comm.rank == root
        bufs = [call.of(t, f"tensors[{i}]", write=not is_root, read=is_root)
                for i, t in enumerate(tensors)]
        parts = [self._start(opts, self.comm.broadcast, b, root=root) for b in bufs]
        return self._work("broadcast", parts, tensors, call)

    def allgather(  # type: ignore[override]  # c10d's form, see above
            self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
            opts: Any = None) -> dist.Work:
        call = self._buffers(opts)
        parts = []
        for i, (outputs, inp) in enumerate(zip(output_lists, input_list, strict=True)):
            self._check_world(outputs, f"output_lists[{i}]")
            same(outputs, f"output_lists[{i}]", inp.numel(), inp.dtype)
            src = call.of(inp, f"input_list[{i}]")
            dst = call.joined(outputs, f"output_lists[{i}]", read=False, write=True)
            parts.append(self._start(opts, self.comm.allgather, dst, src))
        return self._work("allgather", parts, output_lists, call)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          opts: Any = None) -> dist.Work:
        call = self._buffers(opts)
        part = self._all_gather_tensor(opts, call, output, input)
        return self._work("all_gather_into_tensor", [part], [output], call)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None
                                        ) -> dist.Work:
        call = self._buffers(opts)
        parts = [self._all_gather_tensor(opts, call, o, i)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work("all_gather_into_tensor_coalesced", parts, outputs, call)

    all_gather_single_coalesced = allgather_into_tensor_coalesced  # type: ignore[assignment]

    def _all_gather_tensor(self, opts: Any, call: CallBuffers, output: torch.Tensor,
                           input: torch.Tensor) -> CommWork:  # noqa: A002
        self._check_numel(output, input.numel() * self.comm.world_size, "output",
                          "world_size * input.numel()")
        src = call.of(input, "input")
        dst = call.of(output, "output", write=True, read=False)
        return self._start(opts, self.comm.allgather, dst, src)

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None
                            ) -> dist.Work:
        """``output_lists[r][i]`` receives rank ``r``'s ``input_list[i]``: one all-gather of
        the inputs laid end to end."""
        self._check_world(output_lists, "output_tensor_lists")
        for r, outputs in enumerate(output_lists):
            if len(outputs) != len(input_list):
                raise ArgumentError(f"output_tensor_lists[{r}] has {len(outputs)} tensors for "
                                    f"{len(input_list)} inputs; it needs one per input")
            for i, (o, t) in enumerate(zip(outputs, input_list, strict=True)):
                same([o], f"output_tensor_lists[{r}][{i}]", t.numel(), t.dtype)
        call = CallBuffers()
        src = call.joined(input_list, "input_tensor_list")
        dst = call.joined([o for outputs in output_lists for o in outputs],
                          "output_tensor_lists", read=False, write=True)
        part = self.comm.allgather(dst, src, async_op=True)
        return self._work("allgather_coalesced", [part], output_lists, call)

    def gather(  # type: ignore[override]  # c10d's form, see above
            self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor],
            opts: Any) -> dist.Work:
        call = CallBuffers()
        root = opts.rootRank
        inp = one(input_list, "input_tensors")
        src = call.of(inp, "input")
        dst = None
        if self.comm.rank == root:
            outputs = one(output_lists, "output_tensors")
            self._check_world(outputs, "gather_list")
            same(outputs, "gather_list", inp.numel(), inp.dtype)
            dst = call.joined(outputs, "gather_list", read=False, write=True)
        part = self._start(opts, self.comm.gather, dst, src, root=root)
        return self._work("gather", [part], output_lists, call)

    def scatter(  # type: ignore[override]  # c10d's form, see above
            self, output_tensors: list[torch.Tensor], input_lists: list[list[torch.Tensor]],
            opts: Any) -> dist.Work:
        call = self._buffers(opts)
        root = opts.rootRank
        out = one(output_tensors, "output_tensors")
        src = None
        if self.comm.rank == root:
            inputs = one(input_lists, "input_tensors")
            self._check_world(inputs, "scatter_list")
            same(inputs, "scatter_list", out.numel(), out.dtype)
            src = call.joined(inputs, "scatter_list")
        dst = call.of(out, "output", write=True, read=False)
        part = self._start(opts, self.comm.scatter, dst, src, root=root)
        return self._work("scatter", [part], output_tensors, call)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """Tensor ``j`` of ``input_tensors`` goes to rank ``j``; sizes may differ."""
        self._check_world(input_tensors, "input_tensor_list")
        self._check_world(output_tensors, "output_tensor_list")
        dtype = input_tensors[0].dtype
        for what, ts in (("input_tensor_list", input_tensors),
                         ("output_tensor_list", output_tensors)):
            for i, t in enumerate(ts):
                if t.dtype != dtype:
                    raise ArgumentError(f"{what}[{i}] is {t.dtype}, not {dtype}: all tensors "
                                        "of an all_to_all must have one dtype")
        call = CallBuffers()
        scale = movable(dtype)
        src = call.joined(input_tensors, "input_tensor_list")
        dst = call.joined(output_tensors, "output_tensor_list", read=False, write=True)
        part = self._start(opts, self.comm.alltoall, dst, src,
                           in_splits=[t.numel() * scale for t in input_tensors],
                           out_splits=[t.numel() * scale for t in output_tensors])
        return self._work("all_to_all", [part], output_tensors, call)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,  # noqa: A002
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:
        """Splits count rows (sizes along dim 0); empty splits mean equal ones."""
        call = self._buffers(opts)
        src = call.of(input, "input")
        dst = call.of(output, "output", write=True, read=False)
        in_splits = self._rows(input, input_split_sizes, "input")
        out_splits = self._rows(output, output_split_sizes, "output")
        part = self._start(opts, self.comm.alltoall, dst, src, in_splits=in_splits,
                           out_splits=out_splits)
        return self._work("all_to_all_single", [part], [output], call)

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # c10d's form, see above

    def barrier(self, opts: Any = None) -> dist.Work:
        return self._work("barrier", [self._start(opts, self.comm.barrier)], [])

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        """Gloo's debugging barrier, for callers that reach the group directly
        (``dist.monitored_barrier`` itself accepts only gloo groups): rank 0 hears from
        every other rank within ``timeout`` and names those it did not hear from (the first
        one, or all with ``wait_all_ranks``), then releases them."""
        comm, rank = self.comm, self.comm.rank
        limit = timeout.total_seconds() if timeout is not None else comm.timeout
        ms = int(limit * 1000)
        token = torch.zeros(1, dtype=torch.uint8, device=_HOST)
        if rank != 0:
            for work in (comm.send(token, 0, _MONITORED_TAG, async_op=True),
                         comm.recv(token, 0, _MONITORED_TAG, async_op=True)):
                try:
                    work.wait(max(limit, 0.0))
                except CommTimeout as err:
                    raise CommTimeout(f"Rank {rank} failed to pass monitoredBarrier in {ms} ms",
                                      rank=rank, op="monitored_barrier") from err
            return
        start = time.monotonic()
        passed: list[int] = []
        failed: list[int] = []
        for src in range(1, comm.world_size):
            left = limit if wait_all_ranks else limit - (time.monotonic() - start)
            if left <= 0 and not wait_all_ranks:
                done = ", ".join(map(str, passed)) or "none"
                raise CommTimeout(f"Rank 0 timed out in monitoredBarrier after {ms} ms. "
                                  f"Ranks that passed it: {done}", rank=0,
                                  op="monitored_barrier")
            try:
                comm.recv(torch.zeros(1, dtype=torch.uint8, device=_HOST), src, _MONITORED_TAG,
                          async_op=True).wait(max(left, 0.0))
                passed.append(src)
            except CommTimeout as err:
                if not wait_all_ranks:
                    raise CommTimeout(f"Rank {src} failed to pass monitoredBarrier in {ms} ms",
                                      rank=0, op="monitored_barrier", peer=src) from err
                failed.append(src)
        if failed:
            raise CommTimeout(f"Ranks {', '.join(map(str, failed))} failed to pass "
                              f"monitoredBarrier in {ms} ms", rank=0, op="monitored_barrier")
        for dst in range(1, comm.world_size):
            comm.send(token, dst, _MONITORED_TAG)

    # -- point to point
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        call = CallBuffers()
        buf = call.of(one(tensors, "tensors"), "tensor")
        return self._work("send", [self.comm.send(buf, dst, tag, async_op=True)], tensors, call)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        call = CallBuffers()
        buf = call.of(one(tensors, "tensors"), "tensor", write=True, read=False)
        part = self.comm.recv(buf, src, tag, async_op=True)
        return self._work("recv", [part], tensors, call)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        call = CallBuffers()
        buf = call.of(one(tensors, "tensors"), "tensor", write=True, read=False)
        part = self.comm.recv(buf, None, tag, async_op=True)
        return self._work("recv from any source", [part], tensors, call)

    # -- helpers
    def _sparse_allreduce(self, tensors: list[torch.Tensor], op: str) -> dist.Work:
        """Sparse COO all-reduce (sum), as gloo does it: every rank's indices and values are
        gathered (padded to the longest), then summed and coalesced."""
        if op != "sum":
            raise ArgumentError(f"sparse all_reduce supports only SUM, got {op}")
        t = one(tensors, "tensors")
        world = self.comm.world_size
        sparse = t.coalesce()
        indices, values = sparse.indices(), sparse.values()
        counts = torch.zeros(world, dtype=torch.int64, device=_HOST)
        self.comm.allgather(counts, torch.tensor([indices.shape[1]], device=_HOST))
        most = int(counts.max())
        mine_i = torch.zeros((indices.shape[0], most), dtype=torch.int64, device=_HOST)
        mine_i[:, : indices.shape[1]] = indices
        mine_v = torch.zeros((most, *values.shape[1:]), dtype=values.dtype, device=_HOST)
        mine_v[: values.shape[0]] = values
        all_i = torch.empty((world, *mine_i.shape), dtype=torch.int64, device=_HOST)
        all_v = torch.empty((world, *mine_v.shape), dtype=values.dtype, device=_HOST)
        self.comm.allgather(all_i, mine_i)
        self.comm.allgather(all_v, mine_v)
        idx = torch.cat([all_i[r, :, : int(counts[r])] for r in range(world)], dim=1)
        val = torch.cat([all_v[r, : int(counts[r])] for r in range(world)])
        total = torch.sparse_coo_tensor(idx, val, sparse.shape, device=_HOST).coalesce()
        with torch.no_grad():
            t.copy_(total)
        return self._work("sparse allreduce", [], [t])

    def _check_world(self, tensors: Sequence[Any], what: str) -> None:
        if len(tensors) != self.comm.world_size:
            raise ArgumentError(f"{what} has {len(tensors)} entries but the group has "
                                f"{self.comm.world_size} ranks; pass one per rank")

    def _check_numel(self, t: torch.Tensor, want: int, what: str, wantn: str) -> None:
        if t.numel() != want:
            raise ArgumentError(f"{what} has {t.numel()} elements but must have {wantn} = "
                                f"{want}")

    def _rows(self, t: torch.Tensor, splits: Sequence[int], what: str) -> list[int] | None:
        """Row splits of ``t`` (dim 0) as element counts of its flat buffer; None: equal."""
        rows = t.shape[0] if t.dim() > 0 else 1
        numel = t.numel() * movable(t.dtype)
        if not splits:
            if rows % self.comm.world_size:
                raise ArgumentError(f"{what} has {rows} rows, not divisible by the "
                                    f"{self.comm.world_size} ranks: pass split sizes")
            return None
        if len(splits) != self.comm.world_size or sum(splits) != rows:
            raise ArgumentError(f"{what} split sizes {list(splits)} must be "
                                f"{self.comm.world_size} row counts adding up to {rows}")
        per_row = numel // rows if rows else 0
        return [int(s) * per_row for s in splits]
