"""Small kernel adapters with known behaviour, for testing the runner, the registry and the CLI.

Each is a real adapter (name, supports, run), loadable by import path, e.g.
``refattn run --kernel tests.helpers_kernels:WrongSinkKernel``. The "correct" one wraps the
fp32 reference and rounds to fp16, as an honest fp16 kernel would; the others each break one
rule the runner must catch.
"""

from __future__ import annotations

import numpy as np

from refattn.reference import attention


class CorrectKernel:
    """fp32 reference rounded to fp16 into ``inputs.out``; supports fp16 cases only."""

    name = "correct"

    def __init__(self, variant=None):
        self.variant = variant
        if variant:
            self.name = f"{type(self).name}:{variant}"

    def supports(self, case) -> bool:
        return case.dtype == "fp16" and case.softcap == 0

    def compute(self, inputs) -> np.ndarray:
        k, v = inputs.clean_kv()
        return attention(inputs.q, k, v, **inputs.reference_kwargs())

    def run(self, inputs):
        if inputs.dtype != "fp16" or inputs.softcap:
            return -1, inputs.out
        inputs.out[...] = self.compute(inputs).astype(np.float16)
        return 0, inputs.out


class WrongSinkKernel(CorrectKernel):
    """Ignores the sink and smooth softmax (the ``sink_ignored`` bug)."""

    name = "wrong-sink"

    def compute(self, inputs):
        k, v = inputs.clean_kv()
        kw = inputs.reference_kwargs()
        kw.update(sink=None, smooth_softmax=False)
        return attention(inputs.q, k, v, **kw)


class TailReadingKernel(CorrectKernel):
    """Attends over the whole cache capacity, canary rows included, as if past_len were
    ``S_cap - Sq`` (the ``tail_unmasked`` bug): the NaN canaries reach the output."""

    name = "tail-reader"

    def compute(self, inputs):
        kw = inputs.reference_kwargs()
        kw["past_len"] = inputs.k.shape[2] - inputs.q.shape[1]
        return attention(inputs.q, inputs.k, inputs.v, **kw)


class PoliteDecliner:
    """Declines everything and keeps its hands off the buffer."""

    name = "polite-decliner"

    def supports(self, case):
        return False

    def run(self, inputs):
        return -1, inputs.out


class TouchyDecliner(PoliteDecliner):
    """Declines, but zeroes the output buffer first."""

    name = "touchy-decliner"

    def run(self, inputs):
        inputs.out[0, 0, 0, 0] = 0
        return -1, inputs.out


class LiarKernel(CorrectKernel):
    """Declares nothing supported, then computes anyway and returns 0."""

    name = "liar"

    def supports(self, case):
        return False


class ReluctantKernel(CorrectKernel):
    """Claims every case and declines it."""

    name = "reluctant"

    def run(self, inputs):
        return -1, inputs.out


class RaisingKernel(CorrectKernel):
    name = "raiser"

    def run(self, inputs):
        raise RuntimeError("boom: device lost")


class WrongShapeKernel(CorrectKernel):
    """Returns BNSH (B, Hq, Sq, d) instead of (B, Sq, Hq, d)."""

    name = "wrong-shape"

    def run(self, inputs):
        return 0, self.compute(inputs).transpose(0, 2, 1, 3).copy()


class StatusTwoKernel(CorrectKernel):
    name = "status-two"

    def run(self, inputs):
        super().run(inputs)
        return 2, inputs.out


class UnavailableKernel(CorrectKernel):
    """Says it cannot run here."""

    name = "unavailable"
    requires_gpu = True

    def available(self):
        return False, "no device in this test"


class UnavailableGpuKernel(UnavailableKernel):
    """A GPU kernel that cannot run here."""


class AvailableGpuKernel(CorrectKernel):
    """A GPU kernel that says it can run here (it computes on the CPU)."""

    requires_gpu = True

    def available(self):
        return True, "a test device"


class AvailableGpuPeer(AvailableGpuKernel):
    """An available GPU peer (an implementation to compare against): never the default."""

    peer = True


class ReasonedDeclineKernel(CorrectKernel):
    """Declines d = 96 and says why; records the facts of what it ran."""

    name = "reasoned"

    def supports(self, case):
        return case.d != 96

    def unsupported_reason(self, case):
        return None if self.supports(case) else f"head dim {case.d} is not built\n(only 64)"

    def run(self, inputs):
        return (-1, inputs.out) if inputs.case.d == 96 else super().run(inputs)

    def facts(self):
        return {"library": "libreasoned 1.0", "threads": 2, "providers": ["cpu", "gpu"]}
