"""`refattn` kernel adapters for this package (entry-point group ``refattn.kernels``).

* ``model``: the NumPy model of the fused kernel (``hipkernel.model``), the default kernel on
  machines without a GPU and the executable spec the HIP kernel follows.
* ``hipkernel``: the HIP kernel on the first GPU backend that works; ``hipkernel:cuda`` and
  ``hipkernel:hip`` force one.
* ``hipkernel-torch``: the same kernel through its PyTorch entry point
  (``hipkernel.torch.attention``) on CUDA tensors.

Either may be forced to one tile config for every case with ``@CONFIG`` (a
``KernelConfig.name``: ``hipkernel:hip@wmma_m4_b64``, ``model@mma_m4_b32_p8_q4``): no
autotuning, the case's own tiles ignored, ``pack`` cut to what a case's G allows. That is
how a path the tuner would not pick (on AMD, the matrix-core kernel) goes through the case
matrix and the kill matrix (``refattn run`` / ``refattn mutants --kernel ...@CONFIG``).

Both declare the same contract (``api.decline_reason``): head dims in ``HEAD_DIMS``, fp16 or
bf16, no softcap. On anything else they return -1 without touching the output buffer. Both
take ragged batches (``ragged = True``: per-sequence ``past_len`` and ``q_len``). A bf16
case's output comes back as float32 holding the bf16 values, in a new array.

Of the optional members of the adapter protocol (docs/adapters.md) both have ``mutants``
(the whole catalogue: each is a flag of the model and a macro of the HIP source),
``variants(case)`` (the tile configs that can run the case: for ``model`` every config of
every path, which it emulates; for ``hipkernel`` the autotune candidates of the GPU it runs
on) and ``source_hash()`` (``hipkernel.api.source_hash()``: the model is the executable
spec of those sources and is judged with them). ``hipkernel`` also has ``prepare(inputs)`` and
``synchronize()``, which ``refattn bench`` times it through: the inputs uploaded once, then
the case's ``api.PreparedCall`` launched on the resident buffers without a synchronize.
"""

from __future__ import annotations

from hipkernel import api, model
from hipkernel.config import (DEFAULT, KernelConfig, candidates, compiled_variants, config_from_name,
                              runs_path)
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
    ragged = True  # per-sequence past_len / q_len (protocol)

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
        return self.unsupported_reason(case) is None

    def unsupported_reason(self, case) -> str | None:
        """Why ``flash_prefill_v3`` declines the case (``api.decline_reason``), or None. A
        forced config that copies with TMA declines a ragged case: its tensor maps bound every
        sequence by one key count (hipkernel/api.py refuses the pairing)."""
        reason = api.decline_reason(d=case.d, softcap=case.softcap or 0.0, dtype=case.dtype)
        if reason is None:
            reason = self._tma_reason(case.ragged)
        return reason

    def _tma_reason(self, ragged: bool) -> str | None:
        if ragged and self.config is not None and self.config.tma:
            return (f"forced config {self.config.name} copies K/V with TMA, which a ragged "
                    f"batch cannot use")
        return None

    def source_hash(self) -> str:
        return api.source_hash()

    def _arch(self) -> str:
        return _MODEL_ARCH

    @staticmethod
    def tile_sizes() -> dict[str, list[int]]:
        """The query-row and key tiles of every config the tuner may launch
        (``compiled_variants``): what the coverage model's Sq and skv axes are relative to."""
        configs = [cfg for _, cfg in compiled_variants()]
        return {"q": sorted({c.block_positions for c in configs}),
                "kv": sorted({c.bkv for c in configs})}

    def variants(self, case) -> list[str]:
        """The configs that run ``case`` on this adapter's target, each by its name (what
        ``@CONFIG`` takes); [] for a case it declines."""
        if not self.supports(case):
            return []
        G = case.Hq // case.Hkv
        return [c.name for c in candidates(self._arch(), case.d, G, case.window)
                if c.fits(case.d) and c.supports(G) and not (case.ragged and c.tma)]

    def _kw(self, inputs) -> dict:
        return dict(past_len=inputs.past_len, q_len=inputs.q_len, window=inputs.window,
                    sink=inputs.sink, smooth_softmax=inputs.smooth_softmax,
                    softcap=inputs.softcap or 0.0, scale=inputs.scale)


class ModelKernel(_FusedKernel):
    """The CPU model. ``variant`` is unused (accepted for symmetry)."""

    base_name = "model"

    def available(self):
        return True, "NumPy model, runs anywhere"

    def run(self, inputs):
        q, k, v = inputs.q, inputs.k, inputs.v
        if (api.decline_reason(d=q.shape[3], softcap=inputs.softcap or 0.0, dtype=inputs.dtype)
                or self._tma_reason(inputs.ragged)):
            return -1, inputs.out
        out = model.attention(q, k, v, config=self._config_for(inputs) or DEFAULT, mutants=self.active,
                              dtype=inputs.dtype, **self._kw(inputs))
        if inputs.dtype != "fp16":  # bf16 values in float32: not what the fp16 buffer holds
            return 0, out
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
        return self._be().arch

    def _be(self):
        from hipkernel.backends import get_backend

        self._backend = self._backend or get_backend(self.variant)
        return self._backend

    def synchronize(self) -> None:
        """Wait for the launches ``prepare``'s callable enqueued."""
        self._be().synchronize()

    def prepare(self, inputs):
        """The inputs uploaded once into device buffers (the cache with its spare capacity,
        the output buffer with the canary bytes, a ragged case's lengths), and a
        :class:`refattn.timing.Prepared` that launches the case's ``api.PreparedCall`` on
        them, without a synchronize, for ``refattn bench``. The first launch is made here
        through ``api.flash_prefill_v3``, with its synchronize: it autotunes (untimed) and
        shows a decline as a ValueError. ``output()`` reads the output back, ``close()``
        frees the buffers, ``variant`` is the config the launches run."""
        import numpy as np

        from refattn.timing import Prepared

        q, k, v = inputs.q, inputs.k, inputs.v
        dtype = inputs.dtype
        if dtype not in api.SUPPORTED_DTYPES:
            raise ValueError(f"{self.name}: declines: {dtype} inputs (have {api.SUPPORTED_DTYPES})")
        if self._tma_reason(inputs.ragged):
            raise ValueError(f"{self.name}: declines: {self._tma_reason(inputs.ragged)}")
        if dtype == "bf16":  # the device holds the bf16 bit patterns: each float32's top half
            q, k, v = (_bf16_bits(x) for x in (q, k, v))
        be = self._be()
        B, Sq, Hq, d = q.shape
        Hkv, S_cap = k.shape[1], k.shape[2]
        if inputs.sink is not None:
            sink_mode = "per_head"
        elif inputs.smooth_softmax:
            sink_mode = "smooth"
        else:
            sink_mode = "none"
        bufs = {}
        try:
            for name, arr in (("q", q), ("k", k), ("v", v), ("out", inputs.out)):
                bufs[name] = be.alloc(arr.nbytes)
                be.htod(bufs[name], np.ascontiguousarray(arr))
            if sink_mode == "per_head":
                sink16 = np.ascontiguousarray(inputs.sink, dtype=np.float16)
                bufs["sink"] = be.alloc(sink16.nbytes)
                be.htod(bufs["sink"], sink16)
            config = self._config_for(inputs)
            kw = dict(B=B, Sq=Sq, Hq=Hq, Hkv=Hkv, d=d, S_cap=S_cap, window=inputs.window,
                      sink_mode=sink_mode, scale=inputs.scale, softcap=inputs.softcap or 0.0,
                      dtype=dtype, config=config, mutants=self.active)
            args = (bufs["q"], bufs["k"], bufs["v"], bufs.get("sink", 0), bufs["out"])
            status = api.flash_prefill_v3(be, *args, past_len=inputs.past_len, q_len=inputs.q_len,
                                          **kw)  # autotunes; synchronizes
            if status != 0:
                raise ValueError(f"{self.name}: declines this case (status {status})")
            # the timed launches: the lengths resident too, no synchronize, no checks
            past, past_lens, q_lens = api._resolve_lengths(inputs.past_len, inputs.q_len, B=B,
                                                           Sq=Sq, S_cap=S_cap)
            lens = (0, 0)
            if past_lens is not None or q_lens is not None:
                host = np.concatenate([x for x in (past_lens, q_lens) if x is not None]).astype(np.int32)
                bufs["lens"] = be.alloc(host.nbytes)
                be.htod(bufs["lens"], host)
                at = int(bufs["lens"])
                lens = (at if past_lens is not None else 0,
                        at + 4 * B * (past_lens is not None) if q_lens is not None else 0)
            bound = api.ragged_bound(past, past_lens, q_lens, B=B, Sq=Sq) if lens[0] else past
            call = api.prepare_call(be, *args, past_len=bound,
                                    device_lengths=lens if any(lens) else None, **kw)
        except BaseException:
            for ptr in bufs.values():
                be.free(ptr)
            raise
        ptrs = dict(zip(("q", "k", "v", "sink", "out"), args))
        abi_past = 0 if lens[0] else past

        def launch():
            call(**ptrs, past_len=abi_past, lens=lens)

        def output():
            out = np.empty(q.shape, dtype=np.float16 if dtype == "fp16" else np.uint16)
            be.dtoh(out, bufs["out"])
            return out if dtype == "fp16" else (out.astype(np.uint32) << 16).view(np.float32)

        def close():
            for ptr in bufs.values():
                be.free(ptr)
            bufs.clear()

        return Prepared(launch, output=output, close=close, variant=call.config.name)

    def run(self, inputs):
        # The backend is resolved inside api.attention after the host-side decline decision,
        # so a declined case needs no GPU at all. A bf16 result is float32 (bf16 values): a
        # new array, not the fp16 canary buffer.
        if self._tma_reason(inputs.ragged):
            return -1, inputs.out
        fp16 = inputs.dtype == "fp16"
        status, out = api.attention(inputs.q, inputs.k, inputs.v, out=inputs.out if fp16 else None,
                                    config=self._config_for(inputs), backend=self._backend or self.variant,
                                    mutants=self.active, dtype=inputs.dtype, **self._kw(inputs))
        return status, inputs.out if out is None else out


def _bf16_bits(x):
    """The bf16 bit patterns (uint16) of ``x``, float32 holding bf16 values."""
    import numpy as np

    return (np.ascontiguousarray(x, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


class TorchEntryKernel(_FusedKernel):
    """``hipkernel.torch.attention`` on CUDA tensors (``hipkernel-torch``): the kernel
    through its torch entry point, on torch's current stream, so that the case matrix checks
    what a PyTorch caller gets (the torch-side checks, the prepared launch, the lengths'
    copy of a ragged case). A case's arrays become CUDA tensors (bf16: exact), its output
    buffer seeds ``out`` (bf16: NaN bytes), and the result is read back after a
    synchronize. It implements no mutants (the entry point takes none)."""

    base_name = "hipkernel-torch"
    requires_gpu = True
    mutants = frozenset()

    def __init__(self, variant: str | None = None, mutants=frozenset(), config=None):
        if variant is not None:
            raise ValueError(f"kernel: hipkernel-torch has no variants (got {variant!r}); it runs "
                             f"on torch's current CUDA device")
        super().__init__(None, mutants, config)

    def available(self):
        try:
            import torch
        except Exception as e:  # noqa: BLE001 - the reason is the answer
            return False, f"torch not importable: {type(e).__name__}: {e}"
        if not torch.cuda.is_available():
            return False, f"torch {torch.__version__} sees no CUDA device"
        try:
            from hipkernel import torch as ht

            be = ht.RUNTIME.backend(torch.device("cuda", torch.cuda.current_device()))
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}"
        return True, f"torch {torch.__version__} on {be.device_name} ({be.arch}), {be.name} backend"

    def source_hash(self) -> str:
        """The kernel's and the launch code's hash with the torch entry point on top
        (``api.torch_source_hash``)."""
        return api.torch_source_hash()

    def _arch(self) -> str:
        import torch

        from hipkernel import torch as ht

        return ht.RUNTIME.backend(torch.device("cuda", torch.cuda.current_device())).arch

    def run(self, inputs):
        import numpy as np
        import torch

        from hipkernel import torch as ht

        if (api.decline_reason(d=inputs.q.shape[3], softcap=inputs.softcap or 0.0, dtype=inputs.dtype)
                or self._tma_reason(inputs.ragged)):
            return -1, inputs.out
        bf16 = inputs.dtype == "bf16"

        def dev(a):
            t = torch.from_numpy(np.array(a, copy=True)).to("cuda")
            return t.to(torch.bfloat16) if bf16 else t

        sink = None
        if inputs.sink is not None:  # fp16 on the host, with the NumPy level's range check
            s = np.asarray(inputs.sink, dtype=np.float64)
            finite = np.isfinite(s)
            if (np.abs(s[finite]) > np.finfo(np.float16).max).any():
                raise ValueError("sink: finite logits beyond the fp16 range (|sigma| <= 65504) "
                                 "would become inf in the kernel's fp16 sink")
            sink = torch.from_numpy(s.astype(np.float16)).to("cuda")
        q, k, v = dev(inputs.q), dev(inputs.k), dev(inputs.v)
        if bf16:
            out = torch.full_like(q, float("nan"))
        else:
            out = torch.from_numpy(np.array(inputs.out, copy=True)).to("cuda")
        ht.attention(q, k, v, past_len=inputs.past_len, q_len=inputs.q_len, window=inputs.window,
                     sink=sink, smooth_softmax=bool(inputs.smooth_softmax), scale=inputs.scale,
                     out=out, config=self._config_for(inputs))
        torch.cuda.synchronize()
        if bf16:
            return 0, out.float().cpu().numpy()
        inputs.out[...] = out.cpu().numpy()
        return 0, inputs.out
