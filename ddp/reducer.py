"""The Reducer: averages gradients across ranks while backward is still computing them.

Each parameter gets one post-accumulate-grad hook. When a parameter's gradient is final for
this backward pass, its hook copies it into the parameter's slot of a bucket (or, with
``gradient_as_bucket_view``, the gradient already *is* that slot); the bucket's last gradient
launches an asynchronous allreduce of the whole bucket. Buckets launch strictly in index
order on every rank: a later bucket that fills first waits for the earlier ones, because
ranks must issue collectives in the same order or they sum different buckets. A callback
queued on the autograd engine runs when backward ends: it waits for every bucket and writes
the averaged gradients to ``param.grad``.

Besides the gradients, ranks agree each step on a few small numbers, summed in the same
collective when the first bucket can carry them exactly (float32/float64 and no comm hook),
otherwise in one small allreduce of their own launched before the first bucket
(``buckets.ControlSlots``): how many ranks take part, the total batch size, how many ranks
saw the gradient order change, and which parameters any rank used.

Bucket order is observed, not guessed. The first layout follows reverse registration
order; after the first step rank 0 rebuilds it from the order its gradients actually came
in and broadcasts it, so the first bucket holds the first gradients and its allreduce starts
as early as it can. Every later step each rank compares the order it saw with the previous
one; a rank that sees a change says so in the next step's bookkeeping, so all ranks learn it
at the end of the same step and all rebuild there, or none does. Each layout's fingerprint
is compared across ranks. ``logging.getLogger("ddp")`` says at debug level when and why.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.autograd import Variable

from .buckets import (
    CONTROL_DTYPES,
    Bucket,
    ControlSlots,
    GradBucket,
    assign_buckets,
    layout_fingerprint,
)
from .consistency import describe, verify_layout_across_ranks, verify_same_across_ranks
from .graph import parameters_reached

log = logging.getLogger("ddp")

AVERAGES = ("ranks", "samples")
BUCKET_ORDERS = ("observed", "registration")
MIB = 1024 * 1024

CommHook = Callable[[Any, GradBucket], torch.futures.Future]


@dataclass
class StepRecord:
    """What one synchronised backward pass did, for tests and measurements (times are
    ``time.perf_counter()``)."""

    ready_order: list[int]  # parameter indices in the order their gradients became final
    ready_times: list[float]  # the same order
    launch_order: list[int]  # bucket indices in the order their allreduce was launched
    launch_times: list[float]  # per bucket index: when its allreduce was called
    ready_before_launch: list[int]  # per bucket: gradients computed before its launch
    finish_time: float  # averaged gradients written
    shadow: bool  # a joined rank shadowing the others' step


class _Step:
    """The state of one synchronised backward pass (or of a joined rank's shadow of one)."""

    def __init__(self, reducer: Reducer, shadow: bool, local_batch: int) -> None:
        buckets = reducer._buckets
        self.shadow = shadow
        self.local_batch = local_batch
        self.copy_scale = 1  # what gradients are multiplied by on their way into the bucket
        self.pending = [0 if shadow else len(b.param_indices) for b in buckets]
        self.ready = [False] * len(reducer._params)
        self.next_launch = 0
        self.futures: list[torch.futures.Future | None] = [None] * len(buckets)
        self.flats = ([torch.zeros_like(b.flat) for b in buckets] if shadow
                      else [b.flat for b in buckets])
        self.unused: list[int] = []
        self.finalize_queued = False
        self.control_mode = "none"
        self.control = torch.zeros(0)
        self.control_future: torch.futures.Future | None = None
        self.control_total: list[float] | None = None
        self.ready_order: list[int] = []
        self.ready_times: list[float] = []
        self.launch_order: list[int] = []
        self.launch_times = [0.0] * len(buckets)
        self.ready_before_launch = [0] * len(buckets)


class Reducer:
    """Buckets, per-parameter hooks and launch order for averaging gradients across ranks.

    Usable on its own: construct it over the parameters (the same, in the same order, on
    every rank) and run backward; ``param.grad`` holds the average over ranks when
    ``backward()`` returns. ``DistributedDataParallel`` wraps it and calls
    ``prepare_for_backward`` after each forward, which is what ``find_unused_parameters``
    and ``average="samples"`` need.

    Example::

        >>> reducer = Reducer(model.parameters(), bucket_cap_mb=4)
        >>> loss_fn(model(x), y).backward()   # gradients averaged over the ranks
        >>> opt.step()

    Construction is collective: every rank gathers every rank's parameter names, shapes and
    dtypes and compares them with rank 0's (``ValueError`` naming the first difference), then
    the bucket layout's fingerprint.
    """

    def __init__(self, params: Iterable[torch.Tensor], process_group: Any = None, *,
                 bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0,
                 find_unused_parameters: bool = False, gradient_as_bucket_view: bool = False,
                 static_graph: bool = False, average: str = "ranks",
                 bucket_order: str = "observed", param_names: Sequence[str] | None = None,
                 verify: bool = True) -> None:
        params = list(params)
        names = (list(param_names) if param_names is not None
                 else [f"parameter {i}" for i in range(len(params))])
        if len(names) != len(params):
            raise ValueError(f"{len(params)} parameters but {len(names)} names")
        if average not in AVERAGES:
            raise ValueError(f"average must be one of {AVERAGES}, got {average!r}")
        if bucket_order not in BUCKET_ORDERS:
            raise ValueError(f"bucket_order must be one of {BUCKET_ORDERS}, got {bucket_order!r}")
        if not bucket_cap_mb > 0 or not first_bucket_mb > 0:
            raise ValueError(f"bucket sizes must be positive, got bucket_cap_mb={bucket_cap_mb} "
                             f"and first_bucket_mb={first_bucket_mb}")
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:  # no default group yet
            raise RuntimeError("ddp: call torch.distributed.init_process_group first")
        self.group: dist.ProcessGroup = group
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if verify:  # before any local check, so a rank that differs cannot strand the others
            verify_same_across_ranks([describe(n, p) for n, p in zip(names, params, strict=True)],
                                     self.group, "parameter")
        _check_parameters(params, names)
        self._params = params
        self._names = names
        self.find_unused_parameters = find_unused_parameters
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.average = average
        self.bucket_order = bucket_order
        #: set by ``DistributedDataParallel.join``: divide by the ranks that are still
        #: training instead of the world size (``average="ranks"`` only)
        self.divide_by_initial_world_size = True
        #: hooks contribute only while this is true (``no_sync`` clears it)
        self.require_sync = True
        self.device = params[0].device
        self._cap = int(bucket_cap_mb * MIB)
        self._first_cap = int(first_bucket_mb * MIB)
        self._slots = ControlSlots(len(params), find_unused_parameters)
        self._hook: CommHook | None = None
        self._hook_state: Any = None
        self._local_batch_size: int | None = None
        self._step: _Step | None = None
        self._sync_steps = 0
        self._last_order: list[int] | None = None
        self._seen: set[int] = set()
        self._order_changed = False
        self._used_since_sync: set[int] = set()
        self.rebuilds: list[tuple[int, str]] = []  # (sync step, reason) of every rebuild
        self.last_step: StepRecord | None = None
        self._registrations: list[Any] = []  # the buckets' with the group, where it has any
        self._install(assign_buckets(params, range(len(params) - 1, -1, -1), self._cap,
                                     self._first_cap))
        verify_layout_across_ranks(layout_fingerprint(self.layout, params), self.group,
                                   self.device, "at construction")
        self._register_buckets()  # once every rank is known to have the same buckets
        log.debug("ddp: rank %d: %d buckets for %d parameters in reverse registration order: %s",
                  self.rank, len(self._buckets), len(params), self._buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i))
                         for i, p in enumerate(params)]

    # ------------------------------------------------------------------ public

    @property
    def layout(self) -> list[list[int]]:
        """Parameter indices per bucket, in launch order."""
        return [list(b.param_indices) for b in self._buckets]

    def set_local_batch_size(self, n: int | None) -> None:
        """This rank's batch size for the following steps (``average="samples"``); ``None``
        goes back to what ``prepare_for_backward`` is told."""
        if n is not None and (not isinstance(n, int) or n < 0):
            raise ValueError(f"the local batch size must be a non-negative int, got {n!r}")
        self._local_batch_size = n

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce buckets with ``hook(state, bucket) -> Future`` instead of an allreduce.

        The hook must average across ranks (as torch's hooks and ``ddp.hooks`` do) and its
        future must complete with the bucket's new contents (one tensor, or a list whose
        first item is it). Register it on every rank, before a forward pass.
        """
        if self._hook is not None:
            raise RuntimeError("ddp: a communication hook is already registered; register "
                               "one, once")
        if not callable(hook):
            raise TypeError(f"the hook must be callable, got {type(hook).__name__}")
        if self._step is not None:
            raise RuntimeError("ddp: register the communication hook before a forward pass, "
                               "not between a forward and its backward")
        self._hook, self._hook_state = hook, state

    def prepare_for_backward(self, outputs: Any = None, local_batch_size: int | None = None
                             ) -> None:
        """Start a synchronised step: called after a forward pass whose backward will sync.

        ``outputs`` are walked for the parameters they reach (``find_unused_parameters``);
        ``local_batch_size`` is this rank's share of the batch (``average="samples"``;
        ``set_local_batch_size`` overrides it).
        """
        if self._step is not None:
            if self._step.finalize_queued:
                raise RuntimeError(
                    "ddp: the previous backward pass did not finish reducing gradients (it "
                    "raised, or was interrupted); build a new DistributedDataParallel")
            self._step = None  # a forward without a backward: start over
        used: set[int] | None = None
        unused: list[int] = []
        if self.find_unused_parameters:
            if outputs is None:
                raise ValueError("find_unused_parameters needs the forward outputs to walk")
            used = parameters_reached(outputs, self._params)
            unused = [i for i in range(len(self._params)) if i not in used]
        self._step = self._begin(shadow=False, local_batch=local_batch_size, used=used)
        self._step.unused = unused

    def shadow_step(self) -> None:
        """Take part in one synchronised step with zero gradients and no samples: what a
        rank that ran out of data does under ``join`` so the others do not hang."""
        if self._step is not None and self._step.finalize_queued:
            raise RuntimeError("ddp: cannot shadow a step while a backward pass is reducing")
        step = self._step = self._begin(shadow=True, local_batch=0, used=set())
        while step.next_launch < len(self._buckets):
            self._launch(step, step.next_launch)
            step.next_launch += 1
        self._finalize()

    def remove(self) -> None:
        """Remove the hooks: the parameters' gradients stay local from now on."""
        for h in self._handles:
            h.remove()
        self._handles = []

    # ------------------------------------------------------------------ layout

    def _install(self, layout: Sequence[Sequence[int]]) -> None:
        """Allocate the buckets of ``layout``; with ``gradient_as_bucket_view`` existing
        gradients move into them."""
        first = self._params[layout[0][0]]
        self._control_fusable = first.dtype in CONTROL_DTYPES
        control = self._slots.size if self._control_fusable else 0
        self._buckets = [Bucket(b, idx, self._params, control if b == 0 else 0)
                         for b, idx in enumerate(layout)]
        self._where = {i: (b, k) for b, idx in enumerate(layout) for k, i in enumerate(idx)}
        if self.gradient_as_bucket_view:
            with torch.no_grad():
                for i, p in enumerate(self._params):
                    if p.grad is not None:
                        b, k = self._where[i]
                        view = self._buckets[b].views[k]
                        view.copy_(p.grad)
                        p.grad = view

    def _register_buckets(self) -> None:
        """Register the buckets with the group where its backend registers device memory
        (ringcomm's ``register_memory``: its kernel path then reduces each bucket where it
        lies, mapped once, instead of copying it every step); the last layout's first. Every
        rank installs the same layout at the same point, as registering needs (after the
        layouts were checked alike). Where the group refuses (torch's expandable segments:
        every rank alike), the buckets stay unregistered and a warning says why. The
        registrations end with the group, or at the next rebuild."""
        for registration in self._registrations:
            registration.deregister()
        self._registrations = []
        register = getattr(self.group, "register_memory", None)
        if register is None or self.device.type != "cuda":
            return
        try:
            for bucket in self._buckets:
                self._registrations.append(register(bucket.flat))
        except ValueError as refused:  # every rank is refused alike: reduce as before
            log.warning("ddp: rank %d: the buckets stay unregistered (their allreduces copy "
                        "them): %s", self.rank, refused)
            for registration in self._registrations:
                registration.deregister()
            self._registrations = []

    def _rebuild(self, why: str) -> None:
        """Rank 0 lays the buckets out along its latest observed order; everyone follows."""
        n = len(self._params)
        encoded = torch.zeros(1 + 2 * n, dtype=torch.int64, device=self.device)
        if self.rank == 0:
            observed = self._last_order or []
            known = set(observed)
            order = observed + [i for b in self.layout for i in b if i not in known]
            layout = assign_buckets(self._params, order, self._cap, self._first_cap)
            encoded[0] = len(layout)
            encoded[1:1 + len(layout)] = torch.tensor([len(b) for b in layout])
            encoded[1 + n:] = torch.tensor([i for b in layout for i in b])
        dist.broadcast(encoded, src=dist.get_global_rank(self.group, 0), group=self.group)
        values = encoded.tolist()
        sizes, flat = values[1:1 + values[0]], values[1 + n:]
        layout, start = [], 0
        for size in sizes:
            layout.append(flat[start:start + size])
            start += size
        verify_layout_across_ranks(layout_fingerprint(layout, self._params), self.group,
                                   self.device, f"after sync step {self._sync_steps}")
        self.rebuilds.append((self._sync_steps, why))
        if layout == self.layout:
            log.debug("ddp: rank %d: after sync step %d (%s): rank 0's order gives the same "
                      "buckets; nothing to rebuild", self.rank, self._sync_steps, why)
            return
        self._install(layout)
        self._register_buckets()
        log.debug("ddp: rank %d: rebuilt buckets after sync step %d (%s) from rank 0's "
                  "observed order: %s", self.rank, self._sync_steps, why, self._buckets)

    # ------------------------------------------------------------------ one step

    def _control_mode(self) -> str:
        """Where this step's bookkeeping travels: in bucket 0 ("fused"), in an allreduce
        of its own ("separate"), or nowhere when nothing needs it ("none")."""
        if self._hook is None and self._control_fusable:
            return "fused"
        needed = (self.average == "samples" or self.find_unused_parameters
                  or self._checks_order() or not self.divide_by_initial_world_size)
        return "separate" if needed else "none"

    def _checks_order(self) -> bool:
        return self.bucket_order == "observed" and not self.static_graph

    def _begin(self, shadow: bool, local_batch: int | None, used: set[int] | None) -> _Step:
        if not shadow:
            if self._local_batch_size is not None:
                local_batch = self._local_batch_size
            if local_batch is None:
                if self.average == "samples":
                    raise ValueError(
                        "ddp: average='samples' needs this rank's batch size: pass a tensor "
                        "as the first argument of forward, or call set_local_batch_size(n)")
                local_batch = 1
        step = _Step(self, shadow, local_batch or 0)
        if self.average == "samples" and self._hook is None:
            step.copy_scale = step.local_batch  # summed, then divided by the total at the end
        slots = self._slots
        control = torch.zeros(slots.size, dtype=torch.float64)
        if not shadow:
            control[slots.ACTIVE] = 1
            control[slots.BATCH] = step.local_batch
            control[slots.ORDER_CHANGED] = float(self._order_changed and self._checks_order())
            self._order_changed = False
            if slots.with_used_mask:
                mine = (set(range(len(self._params))) if used is None
                        else used | self._used_since_sync)
                control[[slots.USED + i for i in mine]] = 1
        step.control = control
        step.control_mode = self._control_mode()
        if step.control_mode == "separate":
            step.control_future = dist.all_reduce(control.to(self.device), group=self.group,
                                                  async_op=True).get_future()
        return step

    def _hook_for(self, index: int) -> Callable[[torch.Tensor], None]:
        def on_gradient(param: torch.Tensor) -> None:
            self._on_gradient(index, param)
        return on_gradient

    def _on_gradient(self, index: int, param: torch.Tensor) -> None:
        if not self.require_sync:
            self._used_since_sync.add(index)
            return
        step = self._step
        if step is None:  # no prepare_for_backward: the Reducer used on its own
            step = self._step = self._begin(shadow=False, local_batch=None, used=None)
        if not step.finalize_queued:
            step.finalize_queued = True
            Variable._execution_engine.queue_callback(self._finalize)
            for i in step.unused:  # nobody waits for a gradient that will not come
                self._mark_ready(step, i, self._params[i].grad, observed=False)
        self._mark_ready(step, index, param.grad, observed=True)

    def _mark_ready(self, step: _Step, i: int, grad: torch.Tensor | None,
                    observed: bool) -> None:
        if step.ready[i]:
            raise RuntimeError(
                f"ddp: {self._names[i]!r} got its gradient twice in one backward pass; the "
                "Reducer expects one per parameter (reentrant activation checkpointing or a "
                "second backward through part of the graph does this: use non-reentrant "
                "checkpointing, or static_graph=False with one backward per forward)")
        step.ready[i] = True
        if observed:
            step.ready_order.append(i)
            step.ready_times.append(time.perf_counter())
        b, k = self._where[i]
        view = self._buckets[b].views[k]
        scale = step.copy_scale
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            if scale == 1:
                view.copy_(grad)
            else:  # scaling while copying saves a pass over the bucket
                torch.mul(grad, scale, out=view)
            if self.gradient_as_bucket_view:
                self._params[i].grad = view
        elif scale != 1:
            view.mul_(scale)
        step.pending[b] -= 1
        if step.pending[b] == 0:
            while (step.next_launch < len(self._buckets)
                   and step.pending[step.next_launch] == 0):
                self._launch(step, step.next_launch)
                step.next_launch += 1

    def _launch(self, step: _Step, b: int) -> None:
        launched = time.perf_counter()  # before the call: an async allreduce may start in it
        bucket = self._buckets[b]
        flat = step.flats[b]
        grads = flat[:bucket.grad_numel]
        if self._hook is None:
            if b == 0 and step.control_mode == "fused":
                flat[bucket.grad_numel:].copy_(step.control)
            future = dist.all_reduce(flat, group=self.group, async_op=True).get_future()
        else:
            if not step.shadow:
                factor = self._hook_prescale(step)
                if factor != 1.0:
                    grads.mul_(factor)
            views = bucket.views if not step.shadow else bucket.views_of(flat)
            future = self._hook(self._hook_state, GradBucket(
                b, grads, b == len(self._buckets) - 1,
                [self._params[i] for i in bucket.param_indices], views))
        step.futures[b] = future
        step.launch_order.append(b)
        step.launch_times[b] = launched
        step.ready_before_launch[b] = len(step.ready_order)

    def _hook_prescale(self, step: _Step) -> float:
        """With a hook that divides by the world size, the factor that turns its mean into
        the mean this Reducer was asked for."""
        if self.average == "samples":
            total = self._control_total(step)[self._slots.BATCH]
            return self.world_size * step.local_batch / total if total else 0.0
        if not self.divide_by_initial_world_size:
            return self.world_size / self._control_total(step)[self._slots.ACTIVE]
        return 1.0

    def _control_total(self, step: _Step) -> list[float]:
        """The bookkeeping summed over ranks (waits for it)."""
        if step.control_total is None:
            if step.control_mode == "fused":
                total = step.flats[0][self._buckets[0].grad_numel:]
            elif step.control_mode == "separate":
                assert step.control_future is not None, "launched when the step began"
                total = _first_tensor(step.control_future.wait())
            else:  # nothing needed it: what it would have said
                total = torch.zeros(self._slots.size, dtype=torch.float64)
                total[self._slots.ACTIVE] = self.world_size
            step.control_total = total.tolist()
        return step.control_total

    def _finalize(self) -> None:
        """End of backward (an autograd engine callback): wait for each bucket in turn,
        average it and write its ``param.grad``, then look at the order the gradients came
        in."""
        step = self._step
        if step is None:
            return
        error = None
        try:
            missing = [i for i, ready in enumerate(step.ready) if not ready]
            if missing and not step.shadow:
                if self.find_unused_parameters:
                    log.debug("ddp: rank %d: no gradient for %s although the forward reached "
                              "them; counted as unused", self.rank,
                              [self._names[i] for i in missing])
                else:
                    error = RuntimeError(
                        "ddp: no gradient in this backward pass for "
                        + ", ".join(f"{self._names[i]!r}" for i in missing)
                        + ". Their buckets went out with zeros so no rank waits forever, but "
                        "the averaged gradients are wrong. If the forward pass does not use "
                        "every parameter in every step, pass find_unused_parameters=True; "
                        "otherwise make the loss depend on them.")
                for i in missing:
                    grad = self._params[i].grad if self.find_unused_parameters else None
                    self._mark_ready(step, i, grad, observed=False)
            total: list[float] = []
            divisor = 1.0
            for b, bucket in enumerate(self._buckets):
                self._collect(step, b)
                if b == 0:  # the bookkeeping has arrived with (or before) the first bucket
                    total = self._control_total(step)
                    divisor = self._divisor(total)
                if not step.shadow:  # while later buckets are still being reduced
                    self._write_gradients(bucket, total, divisor)
            self._end_sync_step(step, total)
        finally:
            self._step = None
        if error is not None:
            raise error

    def _collect(self, step: _Step, b: int) -> None:
        future = step.futures[b]
        assert future is not None, f"bucket {b} collected before it was launched"
        value = _first_tensor(future.wait())
        grads = step.flats[b][:self._buckets[b].grad_numel]
        if value.data_ptr() != grads.data_ptr():
            grads.copy_(value.reshape(-1)[:grads.numel()])

    def _divisor(self, total: list[float]) -> float:
        """What the summed buckets are divided by (1 where a hook averaged already)."""
        if self._hook is not None:
            return 1.0
        if self.average == "samples":
            return total[self._slots.BATCH]
        if self.divide_by_initial_world_size:
            return float(self.world_size)
        return total[self._slots.ACTIVE]

    def _write_gradients(self, bucket: Bucket, total: list[float], divisor: float) -> None:
        """Average ``bucket`` and write its parameters' ``grad``: the division happens while
        copying out of the bucket (one pass over the gradients, not two), or in the bucket
        when it is the gradient (``gradient_as_bucket_view``)."""
        slots = self._slots
        if not divisor:  # no rank had a sample: nothing to average
            bucket.grads.zero_()
            divisor = 1.0
        if self.gradient_as_bucket_view and divisor != 1:
            bucket.grads.div_(divisor)
        for i, view in zip(bucket.param_indices, bucket.views, strict=True):
            if slots.with_used_mask and total[slots.USED + i] == 0:
                continue  # no rank used it: its gradient stays as it was, as torch's DDP does
            p = self._params[i]
            if self.gradient_as_bucket_view:
                if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                    p.grad = view
            elif p.grad is None:
                p.grad = view.clone() if divisor == 1 else view / divisor
            elif divisor == 1:
                p.grad.copy_(view)
            else:
                torch.div(view, divisor, out=p.grad)

    def _end_sync_step(self, step: _Step, total: list[float]) -> None:
        self._sync_steps += 1
        self._used_since_sync.clear()
        if step.ready_order:
            if self._last_order is not None and self._checks_order():
                self._order_changed = self._order_differs(step.ready_order)
            self._last_order = step.ready_order
            self._seen.update(step.ready_order)
        self.last_step = StepRecord(step.ready_order, step.ready_times, step.launch_order,
                                    step.launch_times, step.ready_before_launch,
                                    time.perf_counter(), step.shadow)
        if self.bucket_order != "observed":
            return
        if self._sync_steps == 1:
            self._rebuild("the first step's order")
            return
        changed = round(total[self._slots.ORDER_CHANGED])
        if changed:
            self._rebuild(f"{changed} rank(s) saw the gradient order change in sync step "
                          f"{self._sync_steps - 1}")

    def _order_differs(self, order: list[int]) -> bool:
        """Whether ``order`` breaks the previous step's order, or brings a gradient this rank
        has not seen before (a parameter the observed layout could not place)."""
        if any(i not in self._seen for i in order):
            return True
        before = {i: n for n, i in enumerate(self._last_order or [])}
        common = [before[i] for i in order if i in before]
        return any(a > b for a, b in zip(common, common[1:], strict=False))


def _first_tensor(value: Any) -> torch.Tensor:
    while isinstance(value, (list, tuple)):
        value = value[0]
    return value


def _check_parameters(params: Sequence[Any], names: Sequence[str]) -> None:
    """Refuse what the Reducer cannot average, naming the parameter (the same on every rank,
    as the parameters were compared across ranks first)."""
    if not params:
        raise ValueError("ddp: no parameters to reduce (none require gradients)")
    seen: dict[int, str] = {}
    for name, p in zip(names, params, strict=True):
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"ddp: {name!r} is a {type(p).__name__}, not a tensor")
        if not p.is_floating_point():
            raise TypeError(
                f"ddp: {name!r} has dtype {p.dtype}; the Reducer averages floating-point "
                "gradients only. Keep integer or complex state in a buffer or a parameter with "
                "requires_grad=False (DistributedDataParallel broadcasts those and reduces "
                "nothing for them).")
        if not p.requires_grad or not p.is_leaf:
            raise ValueError(f"ddp: {name!r} is not a leaf tensor that requires gradients")
        if p.layout != torch.strided:
            raise TypeError(f"ddp: {name!r} is a {p.layout} tensor; only dense ones are reduced")
        if id(p) in seen:
            raise ValueError(f"ddp: {name!r} is the same tensor as {seen[id(p)]!r}; pass each "
                             "parameter once")
        seen[id(p)] = name
