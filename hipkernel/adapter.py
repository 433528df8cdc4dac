"""`refattn` kernel adapters for this package (entry-point group ``refattn.kernels``).

* ``model``: the NumPy model of the fused kernel (``hipkernel.model``), the default kernel on
  machines without a GPU and the executable spec the HIP kernel follows.
* ``hipkernel``: the HIP kernel on the first GPU backend that works; ``hipkernel:cuda`` and
  ``hipkernel:hip`` force one.

Both declare the same contract (``api.decline_reason``): head dims in ``HEAD_DIMS``, fp16,
no softcap. On anything else they return -1 without touching the output buffer.
"""

from __future__ import annotations

from hipkernel import api, model
from hipkernel.config import DEFAULT, KernelConfig


def _config(inputs) -> KernelConfig | None:
    cfg = getattr(inputs, "config", None)
    if not cfg:
        return None
    return KernelConfig(cfg.get("m_tiles", DEFAULT.m_tiles), cfg.get("bkv", DEFAULT.bkv),
                        cfg.get("path", DEFAULT.path))


class _FusedKernel:
    base_name = "?"

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        self.variant = variant
        self.mutants = frozenset(mutants)
        self.name = self.base_name + (f":{variant}" if variant else "")
        if self.mutants:
            self.name += "+" + "+".join(sorted(self.mutants))

    def supports(self, case) -> bool:
        return api.decline_reason(d=case.d, softcap=case.softcap or 0.0, dtype=case.dtype) is None

    def _kw(self, inputs) -> dict:
        return dict(past_len=inputs.past_len, window=inputs.window, sink=inputs.sink,
                    smooth_softmax=inputs.smooth_softmax, softcap=inputs.softcap or 0.0,
                    scale=inputs.scale)


class ModelKernel(_FusedKernel):
    """The CPU model. ``variant`` is unused (accepted for symmetry)."""

    base_name = "model"

    def available(self):
        return True, "NumPy model, runs anywhere"

    def run(self, inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        dtype = "fp16" if all(x.dtype == "float16" for x in (q, k, v)) else str(q.dtype)
        if api.decline_reason(d=q.shape[3], softcap=inputs.softcap or 0.0, dtype=dtype):
            return -1, inputs.out
        out = model.attention(q, k, v, config=_config(inputs) or DEFAULT, mutants=self.mutants,
                              **self._kw(inputs))
        inputs.out[...] = out
        return 0, inputs.out


class HipKernel(_FusedKernel):
    """The HIP kernel through hip-python (AMD) or NVRTC + cuda-bindings (NVIDIA)."""

    base_name = "hipkernel"
    requires_gpu = True

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        if variant not in (None, "cuda", "hip"):
            raise ValueError(f"kernel: unknown hipkernel variant {variant!r} (have cuda, hip)")
        super().__init__(variant, mutants)
        self._backend = None

    def available(self):
        from hipkernel.backends import get_backend

        try:
            self._backend = self._backend or get_backend(self.variant)
        except Exception as e:  # noqa: BLE001 - the reason is what we report
            return False, str(e)
        return True, f"{self._backend.name} on {self._backend.device_name} ({self._backend.arch})"

    def run(self, inputs):
        # The backend is resolved inside api.attention after the host-side decline decision,
        # so a declined case needs no GPU at all.
        status, out = api.attention(inputs.q, inputs.k, inputs.v, out=inputs.out,
                                    config=_config(inputs), backend=self._backend or self.variant,
                                    mutants=self.mutants, **self._kw(inputs))
        return status, inputs.out if out is None else out
