"""Which parameters a forward pass used: a walk of the autograd graph from its outputs.

With ``find_unused_parameters`` the Reducer must know, before backward starts, which
parameters will never get a gradient this step, or their buckets would wait forever. A
parameter is reached when its ``AccumulateGrad`` node is in the graph behind the outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import torch


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """Every tensor inside nested lists, tuples, dicts and dataclass-like objects."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)
    elif hasattr(value, "__dataclass_fields__"):
        for name in value.__dataclass_fields__:
            yield from tensors_in(getattr(value, name))


def parameters_reached(outputs: Any, params: Sequence[torch.Tensor]) -> set[int]:
    """Indices into ``params`` of the parameters the graph behind ``outputs`` reaches."""
    index = {id(p): i for i, p in enumerate(params)}
    reached: set[int] = set()
    visited: dict[int, Any] = {}  # id -> node; holding the node keeps its id unique
    stack = []
    for t in tensors_in(outputs):
        if t.grad_fn is not None:
            stack.append(t.grad_fn)
        elif id(t) in index:  # a parameter returned as it is
            reached.add(index[id(t)])
    while stack:
        node = stack.pop()
        if id(node) in visited:
            continue
        visited[id(node)] = node
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) in index:
            reached.add(index[id(variable)])
        stack.extend(n for n, _ in node.next_functions if n is not None)
    return reached
