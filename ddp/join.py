"""What a rank that ran out of data does under ``DistributedDataParallel.join()``.

torch's ``Join`` context manager calls ``main_hook`` on a joined rank once for every step
the other ranks still train, and ``post_hook`` once all have joined. Each main hook issues
exactly the collectives a training rank issues in one step, in the same order, with zero
contributions, so the others neither hang nor count it: whether the step syncs, the
buffers, the step's bookkeeping and every bucket (``Reducer.shadow_step``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch.distributed.algorithms.join import JoinHook

if TYPE_CHECKING:
    from .module import DistributedDataParallel


class DDPJoinHook(JoinHook):
    """Shadows one training step per call; at the end, all ranks take one final model."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        super().__init__()
        self.ddp = ddp
        ddp.reducer.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        ddp = self.ddp
        if not ddp._agree_on_sync_as_joined():
            return
        if ddp._syncs_buffers:
            ddp._sync_buffers(active=False)
        ddp.reducer.shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.ddp._take_model_of_last_joiner(is_last_joiner)
