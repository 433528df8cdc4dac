"""`refattn` kernel adapters for this package (entry-point group ``refattn.kernels``).

* ``model``: the NumPy model of the fused kernel (``hipkernel.model``), the default kernel on
  machines without a GPU and the executable spec the HIP kernel follows.
* ``hipkernel``: the HIP kernel on the first GPU backend that works; ``hipkernel:cuda`` and
  ``hipkernel:hip`` force one.

Either may be forced to one tile config for every case with ``@CONFIG`` (a
``KernelConfig.name``: ``hipkernel:hip@wmma_m4_b64``, ``model@mma_m4_b32_p8_q4``): no
autotuning, the case's own tiles ignored, ``pack`` cut to what a case's G allows. That is
how a path the tuner would not pick (on AMD, the matrix-core kernel) goes through the case
matrix and the kill matrix (``refattn run`` / ``refattn mutants --kernel ...@CONFIG``).

Both declare the same contract (``api.decline_reason``): head dims in ``HEAD_DIMS``, fp16,
no softcap. On anything else they return -1 without touching the output buffer.

Of the optional members of the adapter protocol (docs/adapters.md) both have ``mutants``
(the whole catalogue: each is a flag of the model and a macro of the HIP source),
``variants(case)`` (the tile configs that can run the case: for ``model`` every config of
every path, which it emulates; for ``hipkernel`` the autotune candidates of the GPU it runs
on) and ``source_hash()`` (``hipkernel.api.source_hash()``: the model is the executable
spec of those sources and is judged with them).
"""

from __future__ import annotations

from hipkernel import api, model
from hipkernel.config import DEFAULT, KernelConfig, candidates, config_from_name, runs_path
from refattn.mutants import MUTANTS

# A target with every path the model emulates (scalar, mma, wgmma, wgspan): its configs are
# the model's variants.
_MODEL_ARCH = "sm_90"


def _config(inputs) -> KernelConfig | None:
    cfg = getattr(inputs, "config", None)
    if not cfg:
        return None
    return KernelConfig(cfg.get("m_tiles", DEFAULT.m_tiles), cfg.get("bkv", DEFAULT.bkv),
                        cfg.get("path", DEFAULT.path))


class _FusedKernel:
    base_name = "?"
    mutants = frozenset(m.name for m in MUTANTS)  # implemented (protocol); active: self.active

    def __init__(self, variant: str | None = None, mutants=frozenset(), config=None):
        self.variant = variant
        self.active = frozenset(mutants)
        unknown = sorted(self.active - type(self).mutants)
        if unknown:
            raise ValueError(f"mutants: not in the catalogue: {', '.join(unknown)}")
        # config: forced on every case (a KernelConfig or its name), or None: the case's own
        self.config = config if config is None or isinstance(config, KernelConfig) else config_from_name(config)
        self.name = self.base_name + (f":{variant}" if variant else "")
        if self.config is not None:
            self.name += f"@{self.config.name}"
        if self.active:
            self.name += "+" + "+".join(sorted(self.active))

    def _config_for(self, inputs) -> KernelConfig | None:
        """The forced config, its pack cut to the case's G; else the case's own (or None)."""
        if self.config is None:
            return _config(inputs)
        return self.config.for_group(inputs.q.shape[2] // inputs.k.shape[1])

    def supports(self, case) -> bool:
        return api.decline_reason(d=case.d, softcap=case.softcap or 0.0, dtype=case.dtype) is None

    def source_hash(self) -> str:
        return api.source_hash()

    def _arch(self) -> str:
        return _MODEL_ARCH

    def variants(self, case) -> list[str]:
        """The configs that run ``case`` on this adapter's target, each by its name (what
        ``@CONFIG`` takes); [] for a case it declines."""
        if not self.supports(case):
            return []
        G = case.Hq // case.Hkv
        return [c.name for c in candidates(self._arch(), case.d, G, case.window)
                if c.fits(case.d) and c.supports(G)]

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
        out = model.attention(q, k, v, config=self._config_for(inputs) or DEFAULT, mutants=self.active,
                              **self._kw(inputs))
        inputs.out[...] = out
        return 0, inputs.out


class HipKernel(_FusedKernel):
    """The HIP kernel through hip-python (AMD) or NVRTC + cuda-bindings (NVIDIA)."""

    base_name = "hipkernel"
    requires_gpu = True

    def __init__(self, variant: str | None = None, mutants=frozenset(), config=None):
        if variant not in (None, "cuda", "hip"):
            raise ValueError(f"kernel: unknown hipkernel variant {variant!r} (have cuda, hip)")
        super().__init__(variant, mutants, config)
        self._backend = None

    def available(self):
        from hipkernel.backends import get_backend

        try:
            self._backend = self._backend or get_backend(self.variant)
        except Exception as e:  # noqa: BLE001 - the reason is what we report
            return False, str(e)
        be = self._backend
        if self.config is not None and not runs_path(self.config.path, be.arch):
            return False, (f"config {self.config.name}: path {self.config.path!r} does not run on "
                           f"{be.name} {be.device_name} ({be.arch})")
        return True, f"{be.name} on {be.device_name} ({be.arch})"

    def _arch(self) -> str:
        from hipkernel.backends import get_backend

        self._backend = self._backend or get_backend(self.variant)
        return self._backend.arch

    def run(self, inputs):
        # The backend is resolved inside api.attention after the host-side decline decision,
        # so a declined case needs no GPU at all.
        status, out = api.attention(inputs.q, inputs.k, inputs.v, out=inputs.out,
                                    config=self._config_for(inputs), backend=self._backend or self.variant,
                                    mutants=self.active, **self._kw(inputs))
        return status, inputs.out if out is None else out
