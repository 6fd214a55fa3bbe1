"""The floors under ringcomm's small calls, measured in the same run as the calls.

A small collective through torch costs torch's own dispatch (``dist.all_reduce`` checking
its arguments, building its options, calling the backend through c10d, waiting on the
handle) plus what the backend does. ``floor/torch`` measures the first part alone: a
``torch.distributed`` process group of a backend that does nothing (every collective
returns a handle that is already complete), called exactly as the ``ringcomm/torch`` rows
call theirs. ``floor/ringcomm`` measures the second part's fixed share: ringcomm's own API
on a group of one rank per process, where nothing is exchanged (argument checks, the
buffer's wrapping, the plan's lookup, the op's bookkeeping), every rank at once so that
ranks that share cores share them here too.

So a ``ringcomm/torch`` time splits into torch's floor, ringcomm's fixed cost and the
exchange itself, and its gap to MPI into torch's part and ringcomm's (``report``). Neither
floor computes anything: their rows have no wrong elements to count.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from .common import free_port

TORCH_FLOOR = "floor/torch"
API_FLOOR = "floor/ringcomm"
FLOORS = (TORCH_FLOOR, API_FLOOR)
_BACKEND = "ringcomm-floor"  # the do-nothing backend's name in torch.distributed


def _done_work() -> Any:
    """A complete torch handle: what the do-nothing group returns for every call."""
    import torch.distributed as dist

    class Done(dist.Work):
        def wait(self, timeout: timedelta = timedelta(0)) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def is_success(self) -> bool:
            return True

    return Done()


def _nothing_group(rank: int, size: int) -> Any:
    """A process group whose allreduce completes at once and moves nothing: torch's
    dispatch is all a call through it costs. It returns one complete handle, made once, as
    the cheapest backend written in Python would (the floors stand under allreduce only)."""
    import torch.distributed as dist

    class Nothing(dist.ProcessGroup):
        def __init__(self) -> None:
            super().__init__(rank, size)  # type: ignore[call-arg]
            self._done = _done_work()

        def getBackendName(self) -> str:  # noqa: N802 - torch's name
            return _BACKEND

        def _nothing(self, *args: Any, **kwargs: Any) -> Any:
            return self._done

        allreduce = barrier = _nothing

    return Nothing()


def _create(opts: Any, backend_options: Any = None) -> Any:
    return _nothing_group(opts.group_rank, opts.group_size)


def join_torch_floor(timeout: float) -> Any:
    """The do-nothing group, made like ``ringcomm/torch``'s (``dist.new_group`` beside the
    default Gloo group; every rank at once)."""
    import torch.distributed as dist

    if _BACKEND.upper() not in getattr(dist.Backend, "_plugins", {}):
        dist.Backend.register_backend(_BACKEND, _create, extended_api=True, devices=["cpu"])
    return dist.new_group(backend=_BACKEND, timeout=timedelta(seconds=timeout))


def join_api_floor(timeout: float) -> Any:
    """A communicator of this rank alone (its own store): ringcomm's API with nothing to
    exchange."""
    import ringcomm

    return ringcomm.init(rank=0, world_size=1, store=f"127.0.0.1:{free_port()}",
                         timeout=timeout)
