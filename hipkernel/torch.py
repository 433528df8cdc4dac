"""The fused kernel on PyTorch tensors: :func:`attention`, on the tensors' device and the
current stream.

``attention(q, k, v, *, past_len, ...)`` takes CUDA tensors shaped like
:func:`hipkernel.attention` (``q (B,Sq,Hq,d)``, ``k, v (B,Hkv,S_cap,d)``, contiguous, fp16
or bf16) and returns ``out (B,Sq,Hq,d)`` of q's dtype. What it does per call is what a
serving loop can afford:

* It launches on ``torch.cuda.current_stream()`` of the tensors' device and returns: no
  synchronize and no host copy. ``out`` is allocated by torch's caching allocator on that
  stream, so torch orders every later use of it.
* The launch of a geometry is prepared once (``api.prepare_call``: the argument checks, the
  config, tuned at the first call, the compiled kernel and its packed arguments) and kept,
  keyed by what the tensors' shapes, dtypes and the options fix. A later call checks only
  what can change between calls of a geometry (contiguity, alignment, ``past_len``) and
  patches the buffer pointers.
* Under CUDA graph capture (``torch.cuda.graph``) a call enqueues the same launch, which
  the graph records. The first call of a geometry tunes (it times candidates and
  synchronizes) and compiles, neither of which a capture allows, so a geometry must have
  run once before it is captured; a call that has not raises RuntimeError saying so.
* It is the custom op ``torch.ops.hipkernel.attention`` (``torch.library``), with a fake
  (meta) implementation, so that ``torch.compile`` traces through it without a graph
  break. Outside compilation :func:`attention` calls the implementation directly: the
  op's dispatch would cost more host time than a short kernel runs.

Ragged batches (docs/semantics.md, Ragged batches): ``past_len`` and ``q_len`` as host
integer sequences of shape (B,); they are checked on the host, then copied through pinned
memory to the device on the current stream. Such a call cannot be captured (the copy's
source would be gone at replay).

The kernel's decline contract becomes an exception here: a call the kernel does not
implement (``api.decline_reason``) raises NotImplementedError with the reason, before
anything is launched.
"""

from __future__ import annotations

import math
import numbers
import threading

import numpy as np
import torch

from hipkernel import api

_DTYPES = {torch.float16: "fp16", torch.bfloat16: "bf16"}


class CudaRuntime:
    """What the entry point needs of torch and the device: a backend per device index, the
    current stream's handle, whether that stream is capturing, and which tensors it takes.
    Tests put a fake in :data:`RUNTIME`."""

    def __init__(self):
        self._backends: dict[int, object] = {}
        self._lock = threading.Lock()
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)

    def accepts(self, t: torch.Tensor) -> bool:
        return t.is_cuda

    def backend(self, device: torch.device):
        index = device.index if device.index is not None else torch.cuda.current_device()
        be = self._backends.get(index)
        if be is None:
            with self._lock:
                be = self._backends.get(index)
                if be is None:
                    import importlib

                    name = "hip" if torch.version.hip else "cuda"
                    be = importlib.import_module(f"hipkernel.backends.{name}").create(index)
                    self._backends[index] = be
        return be

    def stream(self, device: torch.device) -> int:
        return torch.cuda.current_stream(device).cuda_stream

    def stream_of(self, index: int) -> int:
        """:meth:`stream` of the device with this index, by torch's raw-stream query where it
        has one (a fraction of a microsecond, against a few for a Stream object)."""
        if self._raw_stream is None:
            return self.stream(torch.device("cuda", index))
        return self._raw_stream(index)

    def capturing(self, device: torch.device) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def upload(self, host: np.ndarray, device: torch.device) -> torch.Tensor:
        """``host`` on ``device``, copied through pinned memory on the current stream (the
        pinned buffer is held by torch's host allocator until the copy is done)."""
        return torch.from_numpy(host).pin_memory().to(device, non_blocking=True)


RUNTIME = CudaRuntime()


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _check_tensor(name: str, t, *, ndim: int | None = None) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {tuple(t.shape)}")
    if not RUNTIME.accepts(t):
        raise ValueError(f"{name}: expected a CUDA tensor, got one on {t.device}")
    return t


def _host_lengths(name: str, x, B: int) -> np.ndarray | None:
    """A per-sequence length argument as a host int64 array, or None for an int."""
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(f"{name}: per-sequence lengths are host integers (a list, a NumPy "
                             f"array or a CPU tensor): they are checked on the host before the "
                             f"launch; got a tensor on {x.device}")
        x = x.numpy()
    return api._check_lengths(name, x, B)


class _Geometry:
    """What a call's tensors and options fix, checked once: the key of its prepared call."""

    __slots__ = ("key", "B", "Sq", "Hq", "Hkv", "d", "S_cap", "dtype", "sink_mode", "scale",
                 "window", "config", "device", "index", "call")


_GEOMETRIES: dict[tuple, _Geometry] = {}
_GEOMETRIES_MAX = 1024


def _key(q, k, v, sink, window, smooth_softmax, scale, config):
    """What fixes a call's prepared launch, from the tensors' shapes, dtypes and devices and
    the options (each option with its type: ``window=True`` is not ``window=1``); None where
    it cannot be formed (not tensors, an unhashable option), which the checks then name."""
    try:
        return (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(),
                k.get_device(), v.get_device(),
                None if sink is None else (sink.shape, sink.dtype, sink.get_device()),
                window, type(window), smooth_softmax, type(smooth_softmax), scale,
                config if config is None or not isinstance(config, dict) else
                tuple(sorted(config.items())))
    except (AttributeError, TypeError):
        return None


def _geometry(q, k, v, sink, window, smooth_softmax, scale, config) -> _Geometry:
    key = _key(q, k, v, sink, window, smooth_softmax, scale, config)
    try:
        g = _GEOMETRIES.get(key) if key is not None else None
    except TypeError:  # an unhashable option: the checks below name it
        g = key = None
    if g is not None:
        return g
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, ndim=4)
    if q.dtype not in _DTYPES:
        raise ValueError(f"q: expected float16 or bfloat16, got {q.dtype}")
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: expected q's dtype {q.dtype}, got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name}: expected q's device {q.device}, got {t.device}")
    B, Sq, Hq, d = q.shape
    if k.shape[0] != B or k.shape[3] != d:
        raise ValueError(f"k: expected shape (B, Hkv, S_cap, d) with B = {B} and d = {d} from q, "
                         f"got {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
    if min(q.shape) < 1 or min(k.shape) < 1:
        raise ValueError(f"q, k: every dimension must be >= 1, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    Hkv, S_cap = k.shape[1], k.shape[2]
    if Hq % Hkv:
        raise ValueError(f"k: Hq = {Hq} query heads are not a multiple of Hkv = {Hkv} KV heads")
    if not isinstance(smooth_softmax, bool):
        raise ValueError(f"smooth_softmax: expected True or False, got {smooth_softmax!r}")
    if sink is not None:
        _check_tensor("sink", sink, ndim=1)
        if sink.shape[0] != Hq or not sink.dtype.is_floating_point:
            raise ValueError(f"sink: expected a float tensor of shape (Hq,) = ({Hq},), got "
                             f"{sink.dtype} {tuple(sink.shape)}")
        if sink.device != q.device:
            raise ValueError(f"sink: expected q's device {q.device}, got {sink.device}")
        if smooth_softmax:
            raise ValueError("sink: a per-head sink and smooth_softmax are two different sinks; "
                             "give one")
    if not _is_int(window) or window == 0 or window < -1:
        raise ValueError(f"window: expected -1 (no window) or W >= 1, got {window!r}")
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                              or not math.isfinite(scale) or scale <= 0):
        raise ValueError(f"scale: expected None or a finite float > 0, got {scale!r}")
    dtype = _DTYPES[q.dtype]
    reason = api.decline_reason(d=d, dtype=dtype)
    if reason is not None:
        raise NotImplementedError(f"hipkernel declines this call: {reason}")
    g = _Geometry()
    g.key, g.B, g.Sq, g.Hq, g.Hkv, g.d, g.S_cap = key, B, Sq, Hq, Hkv, d, S_cap
    g.dtype, g.window, g.device = dtype, int(window), q.device
    g.index = q.device.index
    g.sink_mode = "per_head" if sink is not None else "smooth" if smooth_softmax else "none"
    g.scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    g.config = api._check_config(config)
    g.call = None
    if key is not None:
        if len(_GEOMETRIES) >= _GEOMETRIES_MAX:
            _GEOMETRIES.pop(next(iter(_GEOMETRIES)))
        _GEOMETRIES[key] = g
    return g


def _contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor (use .contiguous()), got strides "
                         f"{t.stride()}")


def _upload_lengths(g: _Geometry, past_lens, q_lens, stream_capturing: bool):
    """The int32 device tensor of a ragged call's lengths (past_lens, then q_lens, each
    where per sequence) and the pair of pointers ``device_lengths`` takes."""
    if stream_capturing:
        raise RuntimeError("hipkernel.torch.attention: a ragged call copies its host lengths to "
                           "the device, which a CUDA graph would replay from a buffer that is "
                           "gone; capture uniform calls only")
    parts = [x for x in (past_lens, q_lens) if x is not None]
    dev = RUNTIME.upload(np.concatenate(parts).astype(np.int32), g.device)
    at = dev.data_ptr()
    return dev, (at if past_lens is not None else 0,
                 at + 4 * g.B * (past_lens is not None) if q_lens is not None else 0)


def _attention(q, k, v, past_len, q_len, window, sink, smooth_softmax, scale, out, config):
    g = _geometry(q, k, v, sink, window, smooth_softmax, scale, config)
    if (g.call is not None and type(past_len) is int and q_len is None
            and q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
            and (sink is None or sink.dtype == torch.float16 and sink.is_contiguous())
            and 0 <= past_len <= g.S_cap - g.Sq
            and (out is None or type(out) is torch.Tensor and out.shape == q.shape
                 and out.dtype == q.dtype and out.is_contiguous() and out.device == q.device)):
        # a geometry that ran before, the common call: what the slow path below would check
        # of it holds, so only the pointers remain (their alignment, then the launch)
        if out is None:
            out = torch.empty_like(q)
        ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
                0 if sink is None else sink.data_ptr())
        if not (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
            g.call.enqueue(ptrs[0], ptrs[1], ptrs[2], ptrs[4], ptrs[3], past_len,
                           RUNTIME.stream_of(g.index))
            return out
    for name, t in (("q", q), ("k", k), ("v", v)):
        _contiguous(name, t)
    if out is None:
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
    else:
        _check_tensor("out", out, ndim=4)
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out: expected a {q.dtype} tensor of shape {tuple(q.shape)} on "
                             f"{q.device}, got {out.dtype} {tuple(out.shape)} on {out.device}")
        _contiguous("out", out)
    sink16 = None
    if sink is not None:
        sink16 = sink if sink.dtype == torch.float16 and sink.is_contiguous() else \
            sink.to(torch.float16).contiguous()

    # lengths: an int, else per sequence (host, checked here, copied to the device)
    past_lens = q_lens = None
    if _is_int(past_len):
        if past_len < 0:
            raise ValueError(f"past_len: expected an int >= 0 or a host integer sequence of shape "
                             f"(B,), got {past_len!r}")
        past = int(past_len)
        if q_len is None and past + g.Sq > g.S_cap:
            raise ValueError(f"S_cap: cache capacity {g.S_cap} < past_len + Sq = {past + g.Sq}")
    else:
        past = past_lens = _host_lengths("past_len", past_len, g.B)
    if q_len is not None:
        q_lens = _host_lengths("q_len", q_len, g.B)
    if past_lens is not None or q_lens is not None:  # the NumPy level's checks, and its collapse
        past, past_lens, q_lens = api._resolve_lengths(past, q_lens, B=g.B, Sq=g.Sq, S_cap=g.S_cap)
    ragged = past_lens is not None or q_lens is not None
    bound = api.ragged_bound(past, past_lens, q_lens, B=g.B, Sq=g.Sq) if past_lens is not None else past
    ptrs = (q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr(),
            sink16.data_ptr() if sink16 is not None else 0)
    if (ptrs[0] | ptrs[1] | ptrs[2] | ptrs[3] | ptrs[4]) & 15:
        for name, p in zip(("q", "k", "v", "out", "sink"), ptrs):
            if p % 16:  # every global access of the kernel is 16 bytes wide
                raise ValueError(f"{name}: data_ptr() {p:#x} is not 16-byte aligned (a view at "
                                 f"an offset; use .clone())")
    capturing = RUNTIME.capturing(g.device)
    stream = RUNTIME.stream(g.device)
    be = RUNTIME.backend(g.device)
    lens_dev, lens = None, (0, 0)
    if ragged:
        lens_dev, lens = _upload_lengths(g, past_lens, q_lens, capturing)
    call = g.call if not ragged else None
    if call is None:
        if capturing:
            raise RuntimeError("hipkernel.torch.attention: this geometry has not run before; its "
                               "first call tunes and compiles its kernel, which cannot happen "
                               "under CUDA graph capture. Call it once before capturing")
        call = api.prepare_call(
            be, ptrs[0], ptrs[1], ptrs[2], ptrs[4], ptrs[3], B=g.B, Sq=g.Sq, Hq=g.Hq, Hkv=g.Hkv,
            d=g.d, S_cap=g.S_cap, past_len=bound, window=g.window, sink_mode=g.sink_mode,
            scale=g.scale, dtype=g.dtype, config=g.config,
            device_lengths=lens if ragged else None)
        if call is None:  # _geometry raises first for what the kernel declines
            raise NotImplementedError("hipkernel declines this call")
        if not ragged:
            g.call = call
    call(q=ptrs[0], k=ptrs[1], v=ptrs[2], sink=ptrs[4], out=ptrs[3],
         past_len=0 if past_lens is not None else past, lens=lens, stream=stream)
    # lens_dev goes back to torch's allocator here: it was allocated on this stream, so the
    # allocator hands its memory out again only to work ordered after the kernel.
    del lens_dev
    return out


def attention(q, k, v, *, past_len, q_len=None, window: int = -1, sink=None,
              smooth_softmax: bool = False, scale: float | None = None, out=None, config=None):
    """Fused GQA flash prefill on CUDA tensors (module docstring): ``q (B,Sq,Hq,d)``,
    ``k, v (B,Hkv,S_cap,d)`` contiguous float16 or bfloat16 on one device, ``sink (Hq,)``
    a float tensor on that device (per-head sink logits; the kernel's sink is fp16, so
    another dtype is rounded to fp16 on the device, where a finite logit beyond +-65504
    becomes +-inf: checking that would take a synchronize) or None, ``smooth_softmax`` the
    fixed zero-logit sink, ``window`` -1 or W >= 1 (ORT's sliding window), ``past_len``
    an int or a host integer sequence (B,), ``q_len`` None or a host integer sequence
    (B,) of valid rows (padded rows come back as zeros). Returns ``out`` (given: filled;
    else a new tensor like q), computed on the current stream; the call returns before the
    kernel is done. ``config``: a ``KernelConfig`` or dict to force one (default: tuned).
    ValueError names a bad argument; NotImplementedError says what the kernel declines."""
    if torch.compiler.is_compiling():
        if not _is_int(past_len) or q_len is not None or config is not None:
            raise ValueError("hipkernel.torch.attention under torch.compile takes an int past_len, "
                             "no q_len and no config (the custom op's schema); call it outside "
                             "the compiled region for ragged batches")
        res = torch.ops.hipkernel.attention(q, k, v, sink, int(past_len), int(window),
                                            bool(smooth_softmax),
                                            -1.0 if scale is None else float(scale))
        if out is not None:
            out.copy_(res)
            return out
        return res
    return _attention(q, k, v, past_len, q_len, window, sink, smooth_softmax, scale, out, config)


# --------------------------------------------------------------------------- custom op

@torch.library.custom_op("hipkernel::attention", mutates_args=(), device_types="cuda")
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sink: torch.Tensor | None,
                  past_len: int, window: int, smooth_softmax: bool, scale: float) -> torch.Tensor:
    """``attention`` as a torch op (``scale`` < 0: the default 1/sqrt(d))."""
    return _attention(q, k, v, past_len, None, window, sink, smooth_softmax,
                      None if scale < 0 else scale, None, None)


@_attention_op.register_fake
def _attention_fake(q, k, v, sink, past_len, window, smooth_softmax, scale):
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def clear() -> None:
    """Forget every prepared geometry (their kernels stay loaded in the backend)."""
    _GEOMETRIES.clear()
