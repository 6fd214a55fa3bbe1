"""ringcomm: collective communication you can read.

    import ringcomm
    comm = ringcomm.init()                 # under torchrun, or init(rank=, world_size=, store=)
    comm.allreduce(x, op="sum")            # numpy array or CPU tensor, in place

A collective is a *schedule* (``ringcomm.algorithms``), executed over *channels*
(``ringcomm.channels``) by the executor; ``print(schedule)`` shows it step by step.
"""

from .communicator import Communicator, Work
from .errors import (
    ArgumentError,
    CommAborted,
    CommError,
    CommTimeout,
    DesyncError,
    PeerLostError,
    RemoteError,
    StoreError,
    StoreTimeout,
)
from .rendezvous import init

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "CommAborted",
    "CommError",
    "CommTimeout",
    "Communicator",
    "DesyncError",
    "PeerLostError",
    "RemoteError",
    "StoreError",
    "StoreTimeout",
    "Work",
    "init",
]
