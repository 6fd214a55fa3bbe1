"""Teaching views of the collectives: ``explain`` runs one for real over in-memory links and
cuts it into rounds; ``text``, ``svg``, ``page`` and ``animate`` show it."""

from ..plan.topology import hosts_layout
from .explanation import Explanation, explain

__all__ = ["Explanation", "explain", "hosts_layout"]
