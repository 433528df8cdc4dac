"""Shared test assertion: the fp64 reference against the mpmath oracle."""

import numpy as np
import pytest

FP64_GATE = 1e-12  # fp64 reference vs 50-digit oracle


def assert_matches_oracle(actual, expected):
    """fp64 gate: relL2 <= 1e-12, or max-abs <= 1e-12 where the oracle's output is ~0."""
    __tracebackhide__ = True
    assert actual.shape == expected.shape and actual.dtype == np.float64
    bad = ~np.isfinite(actual)
    assert not bad.any(), f"{int(bad.sum())} non-finite outputs, first at (b, row, h, col) = {np.argwhere(bad)[0]}"
    diff = np.abs(actual - expected)
    norm = float(np.linalg.norm(expected))
    err = float(np.linalg.norm(diff))
    if err <= FP64_GATE * norm or diff.max() <= FP64_GATE:
        return
    at = np.unravel_index(int(np.argmax(diff)), diff.shape)
    b, i, h, c = (int(x) for x in at)
    pytest.fail(f"relL2 {err / max(norm, 1e-300):.3e} > {FP64_GATE:g} and max-abs {diff.max():.3e} > "
                f"{FP64_GATE:g}; worst at (b, h, row, col) = ({b}, {h}, {i}, {c}): "
                f"reference {actual[at]!r}, oracle {expected[at]!r}")
