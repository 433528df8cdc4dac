"""Third-party-style adapters for the CLI tests: the example NumPy kernel as a user would
plug it in (by import path, outside the package), and a copy with the classic sliding-window
bug, one key too many visible (W + 1 keys)."""

import numpy as np

from examples.numpy_kernel import NumpyKernel


class WindowPlusOne(NumpyKernel):
    """Row at position p sees keys (p - W - 1, p]: W + 1 keys where W are visible."""

    name = "numpy-window-plus-one"

    def run(self, x):
        if x.window > 0:
            x = _with_window(x, x.window + 1)
        return super().run(x)


def _with_window(x, window):
    import dataclasses

    return dataclasses.replace(x, window=window)


class NondeterministicKernel(NumpyKernel):
    """Adds a tiny random perturbation: right to within the gate, never bitwise repeatable."""

    name = "numpy-nondeterministic"

    def run(self, x):
        status, out = super().run(x)
        out[...] = out + np.float16(np.random.default_rng().uniform(0, 1e-3))
        return status, out
