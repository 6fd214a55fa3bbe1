"""docs/tutorial.md is what docs/build_tutorial.py makes from the code today, and its first
section's arithmetic holds."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

BUILDER = Path(__file__).resolve().parent.parent / "docs" / "build_tutorial.py"


@pytest.fixture(scope="module")
def builder():
    spec = importlib.util.spec_from_file_location("build_tutorial", BUILDER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while defined
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_checked_in_tutorial_is_what_the_code_makes(builder):
    problems = builder.check()
    if problems:
        pytest.fail("\n\n".join(problems), pytrace=False)


def _numeric_gradient(x: np.ndarray, w: np.ndarray, h: float = 1e-6) -> np.ndarray:
    """The gradient of mean((x w)^3) by central differences, apart from the builder's formula."""
    def f(v: np.ndarray) -> float:
        return float(np.mean((x @ v) ** 3))

    out = []
    for j in range(w.size):
        step = np.zeros_like(w)
        step.flat[j] = h
        out.append((f(w + step) - f(w - step)) / (2 * h))
    return np.array(out)


def test_weighted_average_is_the_full_batch_gradient_and_the_plain_one_is_not(builder):
    x, w = builder.X, builder.W
    assert np.array_equal(w, [[0.3], [0.4]])
    m = builder.ddp_math()
    full = _numeric_gradient(x, w)
    np.testing.assert_allclose(m.full, full, atol=1e-8)
    equal, unequal = m.splits
    assert len(set(equal.sizes)) == 1 and len(set(unequal.sizes)) > 1
    for split in m.splits:
        assert sum(split.sizes) == len(x)
        bounds = np.cumsum((0,) + split.sizes)
        local = [_numeric_gradient(x[a:b], w) for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        np.testing.assert_allclose(split.local, local, atol=1e-8)
        weighted = sum(n / len(x) * g for n, g in zip(split.sizes, local, strict=True))
        np.testing.assert_allclose(weighted, full, atol=1e-8)
        np.testing.assert_allclose(split.weighted, m.full, atol=1e-12)
    np.testing.assert_allclose(equal.plain, m.full, atol=1e-12)  # equal batches: plain is exact
    assert np.abs(np.mean(local, axis=0) - full).max() > 1e-3  # unequal: the plain mean is not
    assert np.abs(unequal.plain - m.full).max() > 1e-3
