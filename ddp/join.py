"""What a rank that ran out of data does under ``DistributedDataParallel.join()``.

torch's ``Join`` context manager calls ``main_hook`` on a joined rank once for every step
the other ranks still train, and ``post_hook`` once all have joined. Each main hook has the
replica shadow one training step (``DistributedDataParallel.shadow_step``): exactly the
collectives a training rank issues in one step, in the same order, with zero
contributions, so the others neither hang nor count it.

The hook reaches the replica only through the two public methods of ``JoinedReplica``, so
this module needs nothing from ``module``, which creates the hook.
"""

from __future__ import annotations

from typing import Protocol

from torch.distributed.algorithms.join import JoinHook


class JoinedReplica(Protocol):
    """What the join hook asks of a replica (``DistributedDataParallel`` is one)."""

    def shadow_step(self) -> None:
        """One training step's collectives, contributing nothing."""
        ...

    def take_model_of_last_joiner(self, is_last_joiner: bool) -> None:
        """Every rank takes the model of one rank that trained to the end."""
        ...


class DDPJoinHook(JoinHook):
    """Shadows one training step per call; at the end, all ranks take one final model."""

    def __init__(self, replica: JoinedReplica) -> None:
        super().__init__()
        self.replica = replica

    def main_hook(self) -> None:
        self.replica.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.replica.take_model_of_last_joiner(is_last_joiner)
