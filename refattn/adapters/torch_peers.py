"""torch's attention kernels as adapters, the peers ``refattn bench`` times a kernel against.

Each is an adapter (``refattn.kernels``) with every member the bench uses: ``supports(case)``,
``run(inputs)``, ``prepare(inputs)`` (device-resident torch copies of the inputs, uploaded
once; the returned :class:`refattn.timing.Prepared` launches on them and reads the output
back), ``synchronize()``, ``available()``, ``requires_gpu = True`` and ``source_hash()`` (the
versions of what computes: ``torch-2.11.0+cu130``, ``flash-attn-4-...``). They are named by
import path (``refattn.adapters.torch_peers:Sdpa``) or, in ``refattn bench --peers``, by the short names
``sdpa``, ``cudnn``, ``flex`` and ``fa4`` (:data:`PEERS`).

* ``sdpa``: ``F.scaled_dot_product_attention`` held to its FlashAttention-2 backend
  (``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``). No sink, no window.
* ``cudnn``: the same held to cuDNN (``SDPBackend.CUDNN_ATTENTION``). No sink, no window.
* ``flex``: ``torch.compile(flex_attention)`` with a block mask for causal bottom-right
  (+ the window), and the sink applied exactly from the LSE: ``out * sigmoid(lse - sink)``,
  the sink identity ``Z / (Z + e^sink) = sigmoid(ln Z - sink)``. Ragged batches.
* ``fa4``: FlashAttention 4 (``flash_attn.cute.interface.flash_attn_func``, package
  ``flash-attn-4``), ``causal=True``, ``window_size=(W - 1, 0)`` (``(None, 0)`` without a
  window), ``learnable_sink`` the per-head sink as fp32 ``(Hq,)``, q/k/v in ``(B, S, H, d)``.
  Ragged batches through ``flash_attn_varlen_func``.

How each is configured
======================

* **Causal alignment.** torch's ``is_causal=True`` is top-left aligned, and its flash backend
  refuses ``is_causal`` when ``Sq != skv`` (``check_flash_causal_non_square_seqlens`` in ATen's
  ``sdp_utils.cpp``). So for a chunk over a cache ``sdpa`` gets
  ``torch.nn.attention.bias.causal_lower_right(Sq, skv)``, which torch dispatches to the flash
  op with that op's own (bottom-right) causal flag. cuDNN aligns ``is_causal`` top-left too
  (on ``gptoss-512@8192`` its output differed from hipkernel's, which passes the
  reference, by a relL2 of 9), so for
  ``Sq != skv`` it gets a dense additive fp16 mask, 0 where key j <= past_len + i and -inf
  elsewhere, built in ``prepare``. When ``Sq == skv`` the alignments coincide and
  ``is_causal=True`` is used. FlashAttention's and Flex's masks are bottom-right by
  construction.
* **GQA.** ``enable_gqa=True`` first (flash and cuDNN read Hkv < Hq heads natively); if the
  backend refuses it in ``prepare``'s trial call, the KV heads are repeated
  (``repeat_interleave(G, dim=1)``: query head h reads KV head h // G) once, there. The
  prepared call's ``variant`` says which.
* **Windows.** SDPA has no sliding-window kernel (a dense mask would still compute the whole
  causal band), so ``sdpa`` and ``cudnn`` do not support windowed cases.
* **Flex.** Compiled once per process (``torch.compile(..., dynamic=False)``, recompiled by
  dynamo once per shape); the block mask is built once per shape, in ``prepare``. The LSE is
  requested with ``return_aux=AuxRequest(lse=True)`` (``return_lse=True`` before torch 2.9).
  Flex's kernel works in base 2 and its Python API converts the LSE to a natural log; a probe
  against ``torch.logsumexp`` when the peer is first built confirms the base and picks the
  conversion (``Flex.lse_base``, in the prepared call's ``variant``).
* **FA4's sink dtype.** Early flash-attn-4 releases take ``learnable_sink`` in bf16 only; when
  fp32 is refused, bf16 is tried, and the variant says so (bf16 cannot hold every fp16 sink
  exactly: the bench's check against the reference decides whether it still matches).

* **Data types.** fp16 and bf16 cases (fp32 is declined). A bf16 case's q/k/v, float32
  arrays holding bf16 values on the host, are uploaded as ``torch.bfloat16`` (exact), and the
  output is read back as a float32 array holding its bf16 values (exact; ``run`` returns it
  as a new array rather than rounding it into the fp16 ``inputs.out``). The sink stays fp32
  on the device in either dtype (FA4's bf16 fallback aside).
* **Ragged batches** (docs/semantics.md, Ragged batches; ``ragged = True`` on ``flex`` and
  ``fa4``; ``sdpa`` and ``cudnn`` have no such attribute and decline them). Both get the
  whole cache, all ``S_cap`` rows of every sequence, and the per-sequence lengths as device
  tensors. ``flex``: a block mask over ``B`` built from ``past_len`` and ``q_len``: key j
  visible from row i of sequence b iff ``i < q_len[b]`` and ``j <= past_len[b] + i`` (and
  ``j >= past_len[b] + i - W + 1`` under a window). A padded row is then fully masked: flex
  gives it LSE -inf, whose sink gate ``sigmoid(-inf - sink)`` is 0; the ragged sink path sets
  the gate to 0 there outright, so no NaN can come from it. ``fa4``:
  ``flash_attn_varlen_func`` with q ``(B, Sq, Hq, d)``, k/v ``(B, S_cap, Hkv, d)``,
  ``seqused_q = q_len`` and ``seqused_k = past_len + q_len`` (int32), ``max_seqlen_q = Sq``,
  ``max_seqlen_k = S_cap``; its causal mask is bottom-right per sequence, so row i of b sees
  keys ``j <= seqused_k[b] - seqused_q[b] + i = past_len[b] + i``. FA4 leaves what its
  padded rows hold undefined, so the adapters' convention is that ``output()`` sets every
  padded row (``i >= q_len[b]``) to 0 on the host, after the read-back and outside the timed
  launch; ``flex``'s ``output()`` does the same.

All of them compute on the case's dtype (fp16 or bf16) with the case's scale (default
1/sqrt(d)), no softcap. The bench checks each one's output against the fp64 reference before
timing it (``refattn.bench``).
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from refattn.kernels import KernelError
from refattn.timing import Prepared

LN2 = math.log(2.0)  # flex's kernel keeps the LSE in base 2: ln Z = log2 Z * ln 2


def _short(e: BaseException, caught=()) -> str:
    """One line for an exception, with the most telling warning caught alongside (torch says
    why it did not use a backend in a warning)."""
    first = (str(e).strip().splitlines() or [""])[0]
    msg = f"{type(e).__name__}: {first}"[:200]
    why = [str(w.message).strip() for w in caught
           if "not used because" not in str(w.message) and str(w.message).strip()]
    if why:
        msg += f" ({why[0][:160]})"
    return msg


def _torch():
    import torch

    return torch


class _TorchPeer:
    """What the torch peers share: availability, upload, read-back, synchronize."""

    name = "?"
    requires_gpu = True
    peer = True

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        if variant is not None:
            raise KernelError(f"kernel: the {self.name} peer has no variants (got {variant!r})")
        if mutants:
            raise KernelError(f"kernel: the {self.name} peer has no mutants")

    # ---- protocol ---------------------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        try:
            T = _torch()
        except Exception as e:  # noqa: BLE001 - the reason is the answer
            return False, f"torch not importable: {type(e).__name__}: {e}"
        try:
            if not T.cuda.is_available():
                return False, f"torch {T.__version__} sees no CUDA device"
            return self._probe(T)
        except Exception as e:  # noqa: BLE001
            return False, f"{type(e).__name__}: {e}"

    def _probe(self, T) -> tuple[bool, str]:
        raise NotImplementedError

    def synchronize(self) -> None:
        _torch().cuda.synchronize()

    def source_hash(self) -> str:
        return f"torch-{_torch().__version__}"

    def facts(self) -> dict:
        """What a run records of it: the versions that compute and the device."""
        T = _torch()
        facts = {"torch": T.__version__, "cuda": str(T.version.cuda)}
        if T.cuda.is_available():
            facts["device"] = T.cuda.get_device_name()
        return facts

    def unsupported_reason(self, case) -> str | None:
        """Why ``supports(case)`` is False, or None when it is True."""
        if case.dtype not in ("fp16", "bf16"):
            return f"{self.name} is timed on fp16 and bf16 only (the case is {case.dtype})"
        if case.softcap:
            return f"{self.name}: softcap is not configured"
        if case.ragged and not getattr(self, "ragged", False):
            return f"{self.name}: no ragged batches (one past_len for every sequence)"
        return self._unsupported(case)

    def _unsupported(self, case) -> str | None:
        return None

    def supports(self, case) -> bool:
        return self.unsupported_reason(case) is None

    def run(self, inputs):
        """One call on fresh device copies, the output read back into ``inputs.out`` (fp16), or
        for a bf16 case returned as a new float32 array holding the bf16 values."""
        if not self.supports(inputs.case):
            return -1, inputs.out
        p = self.prepare(inputs)
        try:
            p()
            self.synchronize()
            out = p.output()
            if inputs.dtype == "fp16":
                inputs.out[...] = out
                out = inputs.out
        finally:
            if p.close is not None:
                p.close()
        return 0, out

    # ---- helpers ----------------------------------------------------------------------------
    @staticmethod
    def _dev(T, a, dtype: str = "fp16"):
        """A device copy of NumPy ``a`` (copied first: the bench's inputs are read-only). With
        ``dtype = "bf16"`` a float32 array of bf16 values becomes ``torch.bfloat16`` (exact)."""
        t = T.from_numpy(np.array(a, copy=True)).to("cuda")
        return t.to(T.bfloat16) if dtype == "bf16" else t

    def _upload(self, inputs, whole_cache: bool = False) -> dict:
        """q (B, Hq, Sq, d), k and v (B, Hkv, skv, d) cut to the cache (``whole_cache``: all
        S_cap rows, as a ragged batch has them), in the case's dtype; the scale."""
        T = _torch()
        k, v = (inputs.k, inputs.v) if whole_cache else inputs.clean_kv()
        dt = inputs.dtype
        return {"q": self._dev(T, inputs.q, dt).transpose(1, 2).contiguous(),
                "k": self._dev(T, k, dt).contiguous(), "v": self._dev(T, v, dt).contiguous(),
                "scale": inputs.scale or 1.0 / math.sqrt(inputs.q.shape[3])}

    @staticmethod
    def _reader(holder: dict, bhsd: bool = True, q_len=None):
        """``output()``: the last output as NumPy (B, Sq, Hq, d): fp16, or float32 holding the
        values of a bf16 output (exact). With ``q_len`` (a ragged batch) the padded rows
        ``i >= q_len[b]`` are set to 0 here, on the host (module docstring)."""
        def output():
            out = holder["out"]
            if bhsd:
                out = out.transpose(1, 2)
            if out.dtype == _torch().bfloat16:
                host = out.float().to("cpu").contiguous().numpy()
            else:
                host = out.to("cpu").contiguous().numpy().astype(np.float16, copy=False)
            for b, n in enumerate(q_len or ()):
                host[b, n:] = 0
            return host
        return output


class _Sdpa(_TorchPeer):
    """``F.scaled_dot_product_attention`` held to one backend (module docstring)."""

    backend_name = "FLASH_ATTENTION"

    def _unsupported(self, case) -> str | None:
        if case.sink != "none":
            return f"{self.name} has no attention sink"
        if case.window > 0:
            return (f"{self.name}: SDPA has no sliding-window kernel (a dense mask would still "
                    f"compute the whole causal band)")
        return None

    def _backend(self):
        from torch.nn.attention import SDPBackend

        return getattr(SDPBackend, self.backend_name)

    def _masks(self, T, t: dict, sq: int, skv: int, past: int) -> tuple[str, dict]:
        raise NotImplementedError

    def prepare(self, inputs):
        if not self.supports(inputs.case):
            raise ValueError(f"{self.name}: {self.unsupported_reason(inputs.case)}")
        T = _torch()
        from torch.nn.attention import sdpa_kernel

        F = T.nn.functional
        t = self._upload(inputs)
        B, Sq, Hq, d = inputs.q.shape
        G = Hq // inputs.k.shape[1]
        mask_label, mask = self._masks(T, t, Sq, inputs.skv, inputs.past_len)
        backend = self._backend()
        holder: dict = {}
        rejected = []
        for gqa in ("native GQA (enable_gqa=True)", f"KV heads repeated x{G}"):
            if gqa.startswith("native"):
                k, v, kw = t["k"], t["v"], {"enable_gqa": True}
            else:
                k, v, kw = t["k"].repeat_interleave(G, dim=1), t["v"].repeat_interleave(G, dim=1), {}
            q, scale = t["q"], t["scale"]

            def fn(q=q, k=k, v=v, kw=kw):
                with sdpa_kernel([backend]):
                    holder["out"] = F.scaled_dot_product_attention(q, k, v, scale=scale, **mask, **kw)

            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fn()
                    T.cuda.synchronize()
                except Exception as e:  # noqa: BLE001 - this way of calling it cannot run
                    rejected.append(f"{gqa}: {_short(e, caught)}")
                    continue
            label = f"{mask_label}, {gqa}"
            if rejected:
                label += "; rejected first: " + "; ".join(rejected)
            return Prepared(fn, output=self._reader(holder), close=holder.clear, variant=label)
        raise RuntimeError(f"{self.name}: no way of calling it ran: " + "; ".join(rejected))


class Sdpa(_Sdpa):
    """SDPA, FlashAttention-2 backend."""

    name = "sdpa"
    backend_name = "FLASH_ATTENTION"

    def _probe(self, T):
        from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: F401

        if not getattr(T.backends.cuda, "is_flash_attention_available", lambda: True)():
            return False, f"torch {T.__version__} built without flash attention"
        return True, f"torch {T.__version__} SDPA, flash backend (FlashAttention-2)"

    def _masks(self, T, t, sq, skv, past):
        if sq == skv:  # top-left and bottom-right coincide
            return "is_causal=True", {"is_causal": True}
        from torch.nn.attention.bias import causal_lower_right

        # reaches the flash op with its own bottom-right causal flag
        return "causal_lower_right(Sq, skv)", {"attn_mask": causal_lower_right(sq, skv)}


class Cudnn(_Sdpa):
    """SDPA, cuDNN backend."""

    name = "cudnn"
    backend_name = "CUDNN_ATTENTION"

    def _probe(self, T):
        from torch.nn.attention import SDPBackend

        if not hasattr(SDPBackend, "CUDNN_ATTENTION"):
            return False, f"torch {T.__version__} has no cuDNN SDPA backend"
        if not T.backends.cudnn.is_available():
            return False, "cuDNN is not available to torch"
        return True, f"torch {T.__version__} SDPA, cuDNN {T.backends.cudnn.version()}"

    def source_hash(self) -> str:
        T = _torch()
        return f"torch-{T.__version__}-cudnn-{T.backends.cudnn.version()}"

    def _masks(self, T, t, sq, skv, past):
        if sq == skv:
            return "is_causal=True", {"is_causal": True}
        # cuDNN aligns is_causal top-left: an additive mask, 0 where key j <= p = past_len + i
        visible = T.ones(sq, skv, dtype=T.bool, device="cuda").tril(diagonal=past)
        bias = T.zeros(1, 1, sq, skv, dtype=t["q"].dtype, device="cuda")
        bias.masked_fill_(~visible, float("-inf"))
        kind = "bf16" if t["q"].dtype == T.bfloat16 else "fp16"
        return f"dense bottom-right mask (additive {kind})", {"attn_mask": bias}


class _FlexCompiled:
    """The compiled flex functions and the LSE base, built once per process."""

    def __init__(self, T):
        import torch._dynamo
        from torch.nn.attention import flex_attention as fa

        self.T = T
        try:
            from torch.nn.attention.flex_attention import AuxRequest
        except ImportError:  # torch < 2.9: only the (since deprecated) return_lse flag
            AuxRequest = None
        self.api = "return_aux=AuxRequest(lse=True)" if AuxRequest else "return_lse=True"
        self.create_block_mask, self.and_masks = fa.create_block_mask, fa.and_masks
        # One compile per shape (a new mask_mod and new sizes each time): keep dynamo from
        # giving up on the function after its default recompile limit of 8.
        cfg = torch._dynamo.config
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for knob in ("recompile_limit", "cache_size_limit"):
                if hasattr(cfg, knob):
                    setattr(cfg, knob, max(int(getattr(cfg, knob)), 64))

        if AuxRequest is not None:
            want_lse = AuxRequest(lse=True)

            def flex_lse(q, k, v, block_mask, scale):
                out, aux = fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                             enable_gqa=True, return_aux=want_lse)
                return out, aux.lse
        else:
            def flex_lse(q, k, v, block_mask, scale):
                return fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale,
                                         enable_gqa=True, return_lse=True)

        self._flex_lse = flex_lse
        self.lse_scale, self.lse_base = self._probe_lse_base()
        lse_scale = self.lse_scale

        def flex_sink(q, k, v, block_mask, scale, sink):
            out, lse = flex_lse(q, k, v, block_mask, scale)
            # out (B, Hq, Sq, d) is normalised by Z = sum_j exp(s_j); with the sink it is
            # normalised by Z + e^sink: scale by Z / (Z + e^sink) = sigmoid(ln Z - sink).
            gate = T.sigmoid(lse * lse_scale - sink[None, :, None])
            return (out.float() * gate[..., None]).to(out.dtype)

        def flex_sink_ragged(q, k, v, block_mask, scale, sink, valid):
            # A padded row (valid[b, i] False) is fully masked: flex gives it LSE -inf, whose
            # gate sigmoid(-inf - sink) is 0. The gate is set to 0 there outright, so that no
            # LSE flex may leave in such a row (nor -inf - -inf) can make it NaN.
            out, lse = flex_lse(q, k, v, block_mask, scale)
            gate = T.where(valid[:, None, :], T.sigmoid(lse * lse_scale - sink[None, :, None]), 0.0)
            return (out.float() * gate[..., None]).to(out.dtype)

        def flex_plain(q, k, v, block_mask, scale):
            return fa.flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)

        self.sink_fn = T.compile(flex_sink, dynamic=False)
        self.sink_ragged_fn = T.compile(flex_sink_ragged, dynamic=False)
        self.plain_fn = T.compile(flex_plain, dynamic=False)

    def _probe_lse_base(self) -> tuple[float, str]:
        """Which log the returned LSE is in: compared with torch.logsumexp on a tiny problem."""
        T = self.T
        g = T.Generator(device="cuda").manual_seed(0)
        q, k, v = (T.randn(1, 1, 128, 16, device="cuda", generator=g) for _ in range(3))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, lse = self._flex_lse(q, k, v, None, 0.25)
        ref = T.logsumexp((q @ k.transpose(-1, -2)) * 0.25, dim=-1)
        if T.allclose(lse.float(), ref, rtol=1e-3, atol=1e-3):
            return 1.0, "natural"
        if T.allclose(lse.float() * LN2, ref, rtol=1e-3, atol=1e-3):
            return LN2, "log2 (converted: * ln 2)"
        raise RuntimeError(f"flex LSE is neither ln nor log2 of the logsumexp "
                           f"(max |lse - ref| = {float((lse - ref).abs().max()):.3g})")

    def block_mask(self, sq: int, skv: int, past: int, W: int):
        """Causal bottom-right (key j visible iff j <= p, p = past_len + i), and j >= p - W + 1
        under a window: the visibility of docs/semantics.md (Semantics) as flex mask_mods."""
        def causal(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + past

        def in_window(b, h, q_idx, kv_idx):
            return kv_idx >= q_idx + past - W + 1

        mask_mod = causal if W < 0 else self.and_masks(causal, in_window)
        return self.create_block_mask(mask_mod, None, None, sq, skv, device="cuda")

    def ragged_block_mask(self, sq: int, s_cap: int, past, q_len, W: int):
        """A ragged batch's visibility (docs/semantics.md, Ragged batches) from per-sequence
        device tensors ``past`` and ``q_len`` (B,): key j of sequence b visible from its row i
        iff i < q_len[b] and j <= past[b] + i (so never j >= past[b] + q_len[b]), and
        j >= past[b] + i - W + 1 under a window; one mask per sequence over the whole cache."""
        def causal(b, h, q_idx, kv_idx):
            return (q_idx < q_len[b]) & (kv_idx <= past[b] + q_idx)

        def in_window(b, h, q_idx, kv_idx):
            return kv_idx >= past[b] + q_idx - W + 1

        mask_mod = causal if W < 0 else self.and_masks(causal, in_window)
        return self.create_block_mask(mask_mod, past.shape[0], None, sq, s_cap, device="cuda")


class Flex(_TorchPeer):
    """``torch.compile``d FlexAttention, the sink applied exactly from its LSE."""

    name = "flex"
    ragged = True  # per-sequence past_len / q_len, in the block mask
    _compiled: object = None  # _FlexCompiled, or the exception building it raised (per process)

    def _probe(self, T):
        from torch.nn.attention import flex_attention  # noqa: F401
        import triton

        return True, f"torch {T.__version__} FlexAttention (compiled), triton {triton.__version__}"

    def source_hash(self) -> str:
        import triton

        return f"torch-{_torch().__version__}-triton-{triton.__version__}"

    def _unsupported(self, case) -> str | None:
        return None  # every sink mode (smooth softmax: a sink logit of 0), every window

    @classmethod
    def compiled(cls) -> _FlexCompiled:
        """The compiled functions, built once; a failure to build is kept and re-raised."""
        if Flex._compiled is None:
            try:
                Flex._compiled = _FlexCompiled(_torch())
            except Exception as e:  # noqa: BLE001 - every later shape reports the same reason
                Flex._compiled = e
        if isinstance(Flex._compiled, Exception):
            raise Flex._compiled
        return Flex._compiled

    def prepare(self, inputs):
        if not self.supports(inputs.case):
            raise ValueError(f"flex: {self.unsupported_reason(inputs.case)}")
        T = _torch()
        fx = self.compiled()
        ragged = inputs.q_len is not None
        t = self._upload(inputs, whole_cache=ragged)
        B, Sq, Hq, d = inputs.q.shape
        q, k, v, scale = t["q"], t["k"], t["v"], t["scale"]
        q_len = None
        if ragged:
            q_len = [int(n) for n in inputs.q_len]
            past = self._dev(T, np.asarray(inputs.past_len, dtype=np.int64))
            rows = self._dev(T, np.asarray(inputs.q_len, dtype=np.int64))
            bm = fx.ragged_block_mask(Sq, k.shape[2], past, rows, inputs.window)
            valid = T.arange(Sq, device="cuda")[None, :] < rows[:, None]  # (B, Sq)
        else:
            bm = fx.block_mask(Sq, inputs.skv, inputs.past_len, inputs.window)
        holder: dict = {}
        sink = None
        if inputs.sink is not None:
            sink = self._dev(T, inputs.sink).float()
        elif inputs.smooth_softmax:
            sink = T.zeros(Hq, dtype=T.float32, device="cuda")
        if sink is not None and ragged:
            def fn():
                holder["out"] = fx.sink_ragged_fn(q, k, v, bm, scale, sink, valid)
        elif sink is not None:
            def fn():
                holder["out"] = fx.sink_fn(q, k, v, bm, scale, sink)
        else:
            def fn():
                holder["out"] = fx.plain_fn(q, k, v, bm, scale)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()  # compiles for this shape (untimed)
            T.cuda.synchronize()
        w = "" if inputs.window < 0 else f" + window {inputs.window}"
        if ragged:
            label = (f"block mask per sequence (i < q_len[b], j <= past_len[b] + i{w}) over "
                     f"B = {B} x S_cap = {k.shape[2]}, enable_gqa=True")
        else:
            label = f"block mask causal bottom-right{w}, enable_gqa=True"
        if sink is not None:
            label += f", {fx.api}, sink = out * sigmoid(lse - sink), LSE base {fx.lse_base}"
        if ragged:
            label += "; padded rows set to 0 on the host"
        return Prepared(fn, output=self._reader(holder, q_len=q_len), close=holder.clear,
                        variant=label, extra={"lse_base": fx.lse_base})


class Fa4(_TorchPeer):
    """FlashAttention 4 (``flash_attn.cute``), with the sink as its ``learnable_sink``."""

    name = "fa4"
    ragged = True  # flash_attn_varlen_func with seqused_q / seqused_k

    @staticmethod
    def _func():
        from flash_attn.cute.interface import flash_attn_func

        return flash_attn_func

    @staticmethod
    def _varlen_func():
        from flash_attn.cute.interface import flash_attn_varlen_func

        return flash_attn_varlen_func

    @staticmethod
    def _version() -> str:
        import importlib.metadata as md

        for dist in ("flash-attn-4", "fa4"):
            try:
                return md.version(dist)
            except md.PackageNotFoundError:
                continue
        import flash_attn.cute as fc

        return str(getattr(fc, "__version__", "unknown"))

    def _probe(self, T):
        self._func()
        major, minor = T.cuda.get_device_capability()
        if major < 9:
            return False, f"flash-attn-4 needs sm_90 or newer (this device is sm_{major}{minor})"
        return True, f"flash-attn-4 {self._version()} (flash_attn.cute), torch {T.__version__}"

    def source_hash(self) -> str:
        return f"flash-attn-4-{self._version()}-torch-{_torch().__version__}"

    def facts(self) -> dict:
        return {**super().facts(), "flash_attn_4": self._version()}

    def prepare(self, inputs):
        if not self.supports(inputs.case):
            raise ValueError(f"fa4: {self.unsupported_reason(inputs.case)}")
        T = _torch()
        ragged = inputs.q_len is not None
        func = self._varlen_func() if ragged else self._func()
        k, v = (inputs.k, inputs.v) if ragged else inputs.clean_kv()
        dt = inputs.dtype
        q = self._dev(T, inputs.q, dt).contiguous()                  # (B, Sq, Hq, d)
        k = self._dev(T, k, dt).transpose(1, 2).contiguous()         # (B, skv or S_cap, Hkv, d)
        v = self._dev(T, v, dt).transpose(1, 2).contiguous()
        scale = inputs.scale or 1.0 / math.sqrt(inputs.q.shape[3])
        window = (inputs.window - 1, 0) if inputs.window > 0 else (None, 0)
        Hq = inputs.q.shape[2]
        q_len = None
        if ragged:
            # causal=True is bottom-right per sequence: row i of b sees keys
            # j <= seqused_k[b] - seqused_q[b] + i = past_len[b] + i
            q_len = [int(n) for n in inputs.q_len]
            used_q = self._dev(T, np.asarray(inputs.q_len, dtype=np.int32))
            used_k = self._dev(T, np.asarray(inputs.past_len + inputs.q_len, dtype=np.int32))
            max_q, max_k = q.shape[1], k.shape[1]

            def call(sink):
                return func(q, k, v, seqused_q=used_q, seqused_k=used_k, max_seqlen_q=max_q,
                            max_seqlen_k=max_k, softmax_scale=scale, causal=True,
                            window_size=window, learnable_sink=sink)
        else:
            def call(sink):
                return func(q, k, v, softmax_scale=scale, causal=True, window_size=window,
                            learnable_sink=sink)
        sink32 = None
        if inputs.sink is not None:
            sink32 = self._dev(T, inputs.sink).float().contiguous()
        elif inputs.smooth_softmax:
            sink32 = T.zeros(Hq, dtype=T.float32, device="cuda")
        holder: dict = {}
        attempts = [("fp32", sink32)] if sink32 is not None else [("", None)]
        if sink32 is not None:
            attempts.append(("bf16", sink32.to(T.bfloat16)))
        rejected = []
        for label, sink in attempts:
            def fn(sink=sink):
                res = call(sink)
                holder["out"] = res[0] if isinstance(res, (tuple, list)) else res
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    fn()  # compiles for this shape (untimed)
                    T.cuda.synchronize()
                except Exception as e:  # noqa: BLE001
                    rejected.append(f"learnable_sink {label}: {_short(e, caught)}" if label else _short(e, caught))
                    continue
            variant = f"causal=True, window_size={window}"
            if ragged:
                variant = (f"flash_attn_varlen_func, seqused_q / seqused_k (B = {q.shape[0]}), "
                           f"max_seqlen_k = S_cap = {max_k}, {variant}")
            if label:
                variant += f", learnable_sink {label} (Hq,)"
            if ragged:
                variant += "; padded rows set to 0 on the host"
            if rejected:
                variant += "; rejected first: " + "; ".join(rejected)
            return Prepared(fn, output=self._reader(holder, bhsd=False, q_len=q_len), close=holder.clear,
                            variant=variant)
        raise RuntimeError("fa4: " + "; ".join(rejected))


# short name -> import path, for ``refattn bench --peers``
PEERS = {"sdpa": "refattn.adapters.torch_peers:Sdpa", "cudnn": "refattn.adapters.torch_peers:Cudnn",
         "flex": "refattn.adapters.torch_peers:Flex", "fa4": "refattn.adapters.torch_peers:Fa4"}

__all__ = ["Cudnn", "Fa4", "Flex", "PEERS", "Sdpa"]
