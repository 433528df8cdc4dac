"""ONNX Runtime's ``com.microsoft::GroupQueryAttention`` as an adapter, on any execution provider.

``--kernel ort`` (or ``ort:cpu``) runs the operator on ``CPUExecutionProvider``; ``ort:cuda``
on ``CUDAExecutionProvider``; ``ort:<Name>ExecutionProvider`` on that provider; and
``ort:/path/to/libmy_ep.so`` on a plugin execution provider, registered from that library
through ONNX Runtime's plugin-EP API (``onnxruntime.register_execution_provider_library`` and
``SessionOptions.add_provider_for_devices``, onnxruntime 1.22 and later). Every provider but
the CPU's requires a GPU (``variant_requires_gpu``): pytest marks those cases ``gpu`` and
``--gpus N`` shards them.

The node
========

One ``GroupQueryAttention`` node per geometry (batch, chunk rows, heads, head size, past
length, window, sink mode, scale, softcap, dtype), built with ``onnx.helper`` in a model
that imports only the ``com.microsoft`` domain, at the opset of the installed onnxruntime's
own schema of the operator:

* inputs ``query`` (B, Sq, Hq*d); ``key``, ``value`` (B, Sq, Hkv*d), the chunk's rows
  ``[past_len, past_len + Sq)`` of the case's cache; ``past_key``, ``past_value``
  (B, Hkv, past_len, d) in BNSH, rows ``[0, past_len)`` (left out, as the operator allows,
  when ``past_len = 0``); ``seqlens_k`` int32 (B,) = ``past_len + Sq - 1``;
  ``total_sequence_length`` int32 scalar = ``past_len + Sq``; ``head_sink`` (Hq,) for a
  per-head sink. Every input is placed by its name at the position the installed schema
  gives it; the ones not used (rotary caches, ``attention_bias``...) are empty.
* attributes ``num_heads``, ``kv_num_heads``, ``scale`` (the case's, or ``1/sqrt(d)``
  given explicitly), ``local_window_size`` (``W``, or -1), ``softcap``, ``smooth_softmax``
  (1 for the ``smooth`` sink mode; a per-head sink is the ``head_sink`` input alone).
* outputs ``output`` (B, Sq, Hq*d) and ``present_key`` / ``present_value``
  (B, Hkv, past_len + Sq, d), separate buffers from the past: the shared-buffer mode
  (past and present one tensor of the cache's capacity) is not used.
* I/O in the case dtype: fp16, fp32, or bf16 (fed as bf16 bit patterns), each only as far as
  the provider takes it.

A session is created per geometry with ``enable_fallback=0``, with
``session.disable_cpu_ep_fallback`` for a provider other than the CPU's, and, where the
installed onnxruntime records it, the provider the node was assigned to is checked: the
node runs on the provider under test or the geometry is declined. The CPU memory arena is
off (ORT's CPU kernel allocates the (Hq, Sq, Skv) fp32 probabilities, which an arena would
keep per session), and ``intra_op_num_threads`` is the harness's thread count
(:func:`refattn.reference.pool_threads`).

Declines
========

Declines are derived from ONNX Runtime, not guessed: ``supports(case)`` creates a session and
runs it once on zero-filled inputs with the case's shapes and sequence lengths (what the
operator validates; values are never checked). A session that cannot be created or a trial
run that raises declines the geometry, and ``unsupported_reason(case)`` gives what was tried
and ONNX Runtime's message, e.g. ``onnxruntime 1.32.0 CPUExecutionProvider, trial run (B=2
sq=64 Hq=16 Hkv=2 d=64 past=100 window=50 per_head fp16): Error in execution: batch_size must
be 1 when sequence_length > 1 and past context is given.`` Verdicts are cached per geometry.

The trial's cost. On the real geometry a trial is a second full ORT call per geometry: on the
CPU provider, over the three shipped suites, ORT's share of the time grows about 1.6x
(18 s to 29 s on a 2-core host; the whole ``refattn run`` from 53 s to 65 s). On the CPU
provider the trial therefore runs on :meth:`Geometry.trial`: at most ``TRIAL_ROWS`` chunk
rows and past rows, with the batch, heads, head size, dtype, sink, softcap, scale and
window of the case. The CPU kernel's input checks (``CheckInputs`` in ORT's
``group_query_attention_helper.h`` and the batch restriction the operator's schema
documents) see the chunk and past lengths only through ``Sq > 1``, ``past_len > 0`` and
their consistency with ``seqlens_k`` and ``total_sequence_length``; the reduction keeps all
three (the other refusals seen, a head size that is not a multiple of 8 and bf16, involve no
length). It can err only in two ways, both visible: a refusal of the small geometry is
confirmed on the real one before the case is declined (so the reason shown is always the
real geometry's, and a geometry ORT runs is never declined), and a refusal that only the
real geometry would hit surfaces as an error of ``run`` carrying ORT's message, not as a
pass. Every other provider (a GPU picks kernels by size) has its trial on the real
geometry, which then is also the session's warm-up. Reasons known without a trial: an input
or attribute the installed schema lacks (``head_sink``, ``softcap``, ``smooth_softmax``),
and a per-head sink in bf16 (``head_sink`` is typed like the query, and bf16 cannot carry
every fp16 sink exactly).

Known disagreement: onnxruntime 1.32's CPU kernel multiplies the whole probability row,
zeros included, into V, so a non-finite ``v`` at a key a row cannot see reaches every row
(docs/adapters.md, Verifying an ONNX Runtime execution provider).
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

import numpy as np

from refattn.kernels import KernelError

OP, DOMAIN = "GroupQueryAttention", "com.microsoft"
CPU = "CPUExecutionProvider"
SHORT_NAMES = {"cpu": CPU, "cuda": "CUDAExecutionProvider"}
PROVIDER_RE = re.compile(r"^[A-Za-z][A-Za-z0-9]*ExecutionProvider$")
LIBRARY_SUFFIXES = (".so", ".dll", ".dylib")
# IR version of the one-node model: it uses nothing newer, and every onnxruntime the extra
# allows (>= 1.22) reads it, whatever the installed onnx package would default to.
IR_VERSION = 8
TRIAL_ROWS = 8  # chunk and past rows of a CPU trial run (Geometry.trial)
MAX_SESSIONS = 8  # sessions kept (least recently used dropped); verdicts are all kept
# TensorProto element types (onnx.TensorProto.FLOAT, FLOAT16, BFLOAT16, INT32)
ELEM = {"fp32": 1, "fp16": 10, "bf16": 16}
INT32 = 6

_PLUGINS: dict[str, str | Exception] = {}  # resolved library path -> its EP name, or the failure


class _Refused(Exception):
    """ONNX Runtime refused a geometry: the message is the reason shown beside the decline."""


def _ort():
    import onnxruntime

    return onnxruntime


def _first_line(e: BaseException) -> str:
    """ONNX Runtime's message on one line, the boilerplate around the status message cut."""
    text = " ".join(str(e).split()) or type(e).__name__
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : ([A-Z_]+) : ", r"\1: ", text)
    text = re.sub(r"Non-zero status code returned while running \w+ node\. Name:'[^']*' "
                  r"Status Message: ", "", text)
    return text[:220]


@functools.lru_cache(maxsize=1)
def _schema():
    """The installed onnxruntime's newest schema of ``com.microsoft::GroupQueryAttention``, or
    None when it has none."""
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    found = [s for s in C.get_all_operator_schema() if s.name == OP and s.domain == DOMAIN]
    return max(found, key=lambda s: s.since_version) if found else None


class Geometry(NamedTuple):
    """What a session depends on: everything of a case but its values (the seed), its cache
    capacity (only rows [0, skv) are fed) and the tile config of this repository's kernel."""

    B: int
    sq: int
    Hq: int
    Hkv: int
    d: int
    past: int
    window: int
    sink: str
    dtype: str
    scale: float
    softcap: float

    @classmethod
    def of(cls, case) -> "Geometry":
        scale = case.scale if case.scale is not None else 1.0 / math.sqrt(case.d)
        return cls(case.B, case.sq, case.Hq, case.Hkv, case.d, case.past_len, case.window,
                   case.sink, case.dtype, float(scale), float(case.softcap))

    @property
    def skv(self) -> int:
        return self.past + self.sq

    def trial(self) -> "Geometry":
        """The geometry a CPU provider's trial run uses: at most :data:`TRIAL_ROWS` chunk rows
        and past rows, everything else kept (module docstring, Declines)."""
        return self._replace(sq=min(self.sq, TRIAL_ROWS), past=min(self.past, TRIAL_ROWS))

    def describe(self) -> str:
        parts = [f"B={self.B} sq={self.sq} Hq={self.Hq} Hkv={self.Hkv} d={self.d} "
                 f"past={self.past}"]
        if self.window > 0:
            parts.append(f"window={self.window}")
        if self.sink != "none":
            parts.append(self.sink)
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        parts.append(self.dtype)
        return " ".join(parts)


def _is_library(variant: str) -> bool:
    return "/" in variant or "\\" in variant or variant.endswith(LIBRARY_SUFFIXES)


class OrtKernel:
    """ONNX Runtime's GroupQueryAttention on one execution provider (module docstring)."""

    peer = True
    requires_gpu = False  # the class's answer is the CPU provider's; instances say their own

    @staticmethod
    def variant_requires_gpu(variant: str | None) -> bool:
        """Whether ``ort:<variant>`` runs on an accelerator: every provider but the CPU's (a
        plugin EP library included), read from the variant alone, before anything loads."""
        v = (variant or "cpu").strip()
        return SHORT_NAMES.get(v.lower(), v) != CPU

    def __init__(self, variant: str | None = None, mutants=frozenset()):
        if mutants:
            raise KernelError(f"kernel: ort has no mutants (got {', '.join(sorted(mutants))})")
        if variant is not None and not isinstance(variant, str):
            raise KernelError(f"kernel: ort variant must be a string, got "
                              f"{type(variant).__name__} {variant!r}")
        v = (variant or "cpu").strip()
        self.library: Path | None = None
        if v.lower() in SHORT_NAMES:
            self.provider = SHORT_NAMES[v.lower()]
        elif PROVIDER_RE.match(v):
            self.provider = v
        elif _is_library(v):
            self.library = Path(v).expanduser().resolve()
            self.provider = ""  # the EP name the library registers, known once it is loaded
        else:
            raise KernelError(f"kernel: unknown ort variant {variant!r}: expected cpu, cuda, an "
                              f"execution provider's name (e.g. ROCMExecutionProvider) or the "
                              f"path of a plugin EP library (.so, .dll, .dylib)")
        short = {p: s for s, p in SHORT_NAMES.items()}
        label = str(self.library) if self.library else short.get(self.provider, self.provider)
        self.name = f"ort:{label}"
        self.requires_gpu = self.provider != CPU
        self._sessions: OrderedDict[Geometry, object] = OrderedDict()
        self._verdicts: dict[Geometry, str | None] = {}  # geometry -> None (runs) or the reason
        self._available: tuple[bool, str] | None = None

    # ---- availability, facts ---------------------------------------------------------------
    def available(self) -> tuple[bool, str]:
        if self._available is None:
            self._available = self._probe_available()
        return self._available

    def _probe_available(self) -> tuple[bool, str]:
        try:
            ort = _ort()
        except Exception as e:  # noqa: BLE001 - the reason is the answer
            return False, f"onnxruntime not importable: {type(e).__name__}: {e}"
        try:
            import onnx
        except Exception as e:  # noqa: BLE001
            return False, f"onnx not importable (it builds the model): {type(e).__name__}: {e}"
        if _schema() is None:
            return False, f"onnxruntime {ort.__version__} has no {DOMAIN} {OP}"
        if self.library is not None:
            try:
                self._plugin_ep()
            except _Refused as e:
                return False, str(e)
        elif self.provider not in ort.get_available_providers():
            hint = " (onnxruntime-gpu provides it)" if self.provider == SHORT_NAMES["cuda"] else ""
            return False, (f"{self.provider} is not available in onnxruntime {ort.__version__}"
                           f"{hint}; available: {', '.join(ort.get_available_providers())}")
        return True, (f"onnxruntime {ort.__version__} {self.provider}, {DOMAIN} {OP} "
                      f"(opset {self.opset()}), onnx {onnx.__version__}")

    def opset(self) -> int:
        """The ``com.microsoft`` opset the model imports: the installed schema's version."""
        return int(_schema().since_version)

    def facts(self) -> dict:
        ort = _ort()
        facts = {"onnxruntime": ort.__version__, "provider": self._provider(),
                 "providers": list(ort.get_available_providers()),
                 "opset_com_microsoft": self.opset()}
        if self.library is not None:
            facts["plugin_library"] = str(self.library)
        return facts

    def source_hash(self) -> str:
        h = f"onnxruntime-{_ort().__version__}:{self._provider()}"
        if self.library is not None:  # the library is the code under test
            h += ":" + hashlib.sha256(self.library.read_bytes()).hexdigest()[:16]
        return h

    def _provider(self) -> str:
        if self.library is not None and not self.provider:
            self.provider = self._plugin_ep()
        return self.provider

    # ---- plugin execution providers ---------------------------------------------------------
    def _plugin_ep(self) -> str:
        """Register the plugin library (once per process) and return the name of the EP it
        provides; :class:`_Refused` with ONNX Runtime's message when that fails."""
        ort = _ort()
        key = str(self.library)
        if key not in _PLUGINS:
            _PLUGINS[key] = self._register(ort)
        got = _PLUGINS[key]
        if isinstance(got, Exception):
            raise _Refused(str(got))
        self.provider = got
        return got

    def _register(self, ort) -> str | Exception:
        lib = self.library
        if not hasattr(ort, "register_execution_provider_library") or not hasattr(
                ort.SessionOptions, "add_provider_for_devices"):
            return _Refused(f"onnxruntime {ort.__version__} has no plugin execution provider API "
                            f"(register_execution_provider_library, add_provider_for_devices: "
                            f"onnxruntime 1.22 and later)")
        if not lib.is_file():
            return _Refused(f"plugin EP library {lib}: no such file")
        before = {d.ep_name for d in ort.get_ep_devices()}
        try:
            ort.register_execution_provider_library(f"refattn-{lib.stem}", str(lib))
        except Exception as e:  # noqa: BLE001 - ORT's own message is the reason
            return _Refused(f"onnxruntime {ort.__version__} could not register {lib}: "
                            f"{_first_line(e)}")
        new = sorted({d.ep_name for d in ort.get_ep_devices()} - before)
        if not new:
            return _Refused(f"{lib} registered, but it offers no device of a new execution "
                            f"provider (devices: {', '.join(sorted(before)) or 'none'})")
        return new[0]

    # ---- the contract ------------------------------------------------------------------------
    def unsupported_reason(self, case) -> str | None:
        """Why ``supports(case)`` is False (ONNX Runtime's own message when it refused the
        geometry), or None when it is True."""
        ok, why = self.available()
        if not ok:
            return f"not available: {why}"
        schema = _schema()
        inputs = {i.name for i in schema.inputs}
        ver = _ort().__version__
        if case.sink == "per_head" and "head_sink" not in inputs:
            return f"onnxruntime {ver}'s {OP} has no head_sink input (per-head sinks)"
        for attr, used in (("smooth_softmax", case.sink == "smooth"),
                           ("softcap", case.softcap > 0)):
            if used and attr not in schema.attributes:
                return f"onnxruntime {ver}'s {OP} has no {attr} attribute"
        if case.sink == "per_head" and case.dtype == "bf16":
            return (f"onnxruntime {ver}: {OP}'s head_sink is typed like the query, and bf16 "
                    f"cannot carry every fp16 sink of the case exactly")
        return self._verdict(case)

    def supports(self, case) -> bool:
        return self.unsupported_reason(case) is None

    def run(self, inputs):
        case = inputs.case
        if not self.supports(case):
            return -1, inputs.out
        g = Geometry.of(case)
        out = self._execute(self._session(g), g,
                            self._feeds(g, inputs.q, inputs.k, inputs.v, inputs.sink))
        out = out.reshape(g.B, g.sq, g.Hq, g.d)
        if g.dtype == "fp16":
            inputs.out[...] = out
            return 0, inputs.out
        if g.dtype == "bf16":  # bf16 bit patterns -> the float32 values they hold
            out = (out.astype(np.uint32) << 16).view(np.float32)
        return 0, out

    # ---- verdicts and sessions ---------------------------------------------------------------
    def _verdict(self, case) -> str | None:
        """None when ORT runs the case's geometry, else why not (cached per geometry). On the
        CPU provider the trial runs on :meth:`Geometry.trial` first, and a refusal there is
        confirmed on the real geometry, whose message is the reason; elsewhere the trial runs
        on the real geometry (module docstring, Declines)."""
        g = Geometry.of(case)
        if g not in self._verdicts:
            small = g.trial() if self._provider() == CPU else g
            why = self._trial(small)
            if why is not None and small != g:
                why = self._trial(g)
            self._verdicts[g] = why
        return self._verdicts[g]

    def _trial(self, g: Geometry) -> str | None:
        """Create the session of ``g`` and run it once on zeros: None, or ORT's refusal."""
        try:
            session = self._session(g)
            zeros = self._feeds(g, *self._zero_inputs(g))
            try:
                self._execute(session, g, zeros)
            except Exception as e:  # noqa: BLE001 - ORT's refusal is the verdict
                raise _Refused(self._said("trial run", g, e)) from e
        except _Refused as e:
            self._sessions.pop(g, None)
            return str(e)
        return None

    def _said(self, what: str, g: Geometry, e: BaseException) -> str:
        return (f"onnxruntime {_ort().__version__} {self._provider()}, {what} "
                f"({g.describe()}): {_first_line(e)}")

    def _session(self, g: Geometry):
        if g in self._sessions:
            self._sessions.move_to_end(g)
            return self._sessions[g]
        ort = _ort()
        model = self._model(g).SerializeToString()
        so = ort.SessionOptions()
        so.log_severity_level = 4  # ORT's errors come back as exceptions, not as log lines
        so.enable_cpu_mem_arena = False
        from refattn.reference import pool_threads

        so.intra_op_num_threads = pool_threads()
        so.add_session_config_entry("session.record_ep_graph_assignment_info", "1")
        provider = self._provider()
        if provider != CPU:
            so.add_session_config_entry("session.disable_cpu_ep_fallback", "1")
        try:
            if self.library is not None:
                devices = [d for d in ort.get_ep_devices() if d.ep_name == provider][:1]
                so.add_provider_for_devices(devices, {})
                session = ort.InferenceSession(model, so, enable_fallback=0)
            else:
                session = ort.InferenceSession(model, so, providers=[provider], enable_fallback=0)
        except Exception as e:  # noqa: BLE001 - ORT's refusal is the verdict
            raise _Refused(self._said("session", g, e)) from e
        assigned = self._assigned(session)
        if assigned is not None and assigned != provider:
            raise _Refused(f"onnxruntime {ort.__version__} assigned {OP} ({g.describe()}) to "
                           f"{assigned}, not to {provider}")
        self._sessions[g] = session
        while len(self._sessions) > MAX_SESSIONS:
            self._sessions.popitem(last=False)
        return session

    @staticmethod
    def _assigned(session) -> str | None:
        """The provider the node runs on, where the installed onnxruntime records it."""
        fn = getattr(session, "get_provider_graph_assignment_info", None)
        if fn is None:
            return None
        try:
            for sub in fn():
                if any(n.op_type == OP for n in sub.get_nodes()):
                    return sub.ep_name
        except Exception:  # noqa: BLE001 - not recorded: nothing to check
            return None
        return None

    def _model(self, g: Geometry):
        from onnx import helper

        T = ELEM[g.dtype]
        B, sq, Hq, Hkv, d, past = g.B, g.sq, g.Hq, g.Hkv, g.d, g.past
        vi = helper.make_tensor_value_info
        given = [vi("query", T, [B, sq, Hq * d]), vi("key", T, [B, sq, Hkv * d]),
                 vi("value", T, [B, sq, Hkv * d])]
        if past > 0:
            given += [vi("past_key", T, [B, Hkv, past, d]), vi("past_value", T, [B, Hkv, past, d])]
        given += [vi("seqlens_k", INT32, [B]), vi("total_sequence_length", INT32, [])]
        if g.sink == "per_head":
            given.append(vi("head_sink", T, [Hq]))
        schema = _schema()
        order = [i.name for i in schema.inputs]
        missing = [i.name for i in given if i.name not in order]
        if missing:
            raise KernelError(f"kernel: {self.name}: the installed {OP} schema has no input "
                              f"{', '.join(missing)} (its inputs: {', '.join(order)})")
        have = {i.name for i in given}
        names = [n if n in have else "" for n in order]
        while names and not names[-1]:
            names.pop()
        attrs = {"num_heads": Hq, "kv_num_heads": Hkv, "scale": g.scale,
                 "local_window_size": g.window if g.window > 0 else -1}
        if "softcap" in schema.attributes:
            attrs["softcap"] = g.softcap
        if "smooth_softmax" in schema.attributes:
            attrs["smooth_softmax"] = int(g.sink == "smooth")
        attrs = self._attributes(attrs, g)
        node = helper.make_node(OP, names, ["output", "present_key", "present_value"],
                                domain=DOMAIN, name="gqa", **attrs)
        outs = [vi("output", T, [B, sq, Hq * d]),
                vi("present_key", T, [B, Hkv, past + sq, d]),
                vi("present_value", T, [B, Hkv, past + sq, d])]
        graph = helper.make_graph([node], "refattn_gqa", given, outs)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid(DOMAIN, self.opset())],
                                 ir_version=IR_VERSION, producer_name="refattn")

    def _attributes(self, attrs: dict, g: Geometry) -> dict:
        """The node's attributes (a seam for tests that build a deliberately wrong node)."""
        return attrs

    # ---- feeds and execution -----------------------------------------------------------------
    @staticmethod
    def _zero_inputs(g: Geometry):
        dt = np.float16 if g.dtype == "fp16" else np.float32
        q = np.zeros((g.B, g.sq, g.Hq, g.d), dt)
        kv = np.zeros((g.B, g.Hkv, g.skv, g.d), dt)
        sink = np.zeros(g.Hq, np.float16) if g.sink == "per_head" else None
        return q, kv, kv, sink

    def _feeds(self, g: Geometry, q, k, v, sink) -> dict[str, np.ndarray]:
        """ORT's inputs, in the I/O dtype (bf16 as uint16 bit patterns): q (B, Sq, Hq, d) and
        the cache k, v (B, Hkv, >= skv, d) cut into the chunk's rows and the past."""
        B, sq, Hkv, d, past, skv = g.B, g.sq, g.Hkv, g.d, g.past, g.skv
        if q.shape != (B, sq, g.Hq, d):
            raise ValueError(f"q: expected shape {(B, sq, g.Hq, d)}, got {q.shape}")
        for arg, a in (("k", k), ("v", v)):
            if a.ndim != 4 or a.shape[:2] != (B, Hkv) or a.shape[3] != d or a.shape[2] < skv:
                raise ValueError(f"{arg}: expected shape ({B}, {Hkv}, S_cap >= {skv}, {d}), "
                                 f"got {a.shape}")
        if sink is not None and sink.shape != (g.Hq,):
            raise ValueError(f"sink: expected shape ({g.Hq},), got {sink.shape}")

        def chunk(a):  # (B, Hkv, Sq, d) -> (B, Sq, Hkv * d)
            return a[:, :, past:skv].transpose(0, 2, 1, 3).reshape(B, sq, Hkv * d)

        feeds = {"query": q.reshape(B, sq, g.Hq * d), "key": chunk(k), "value": chunk(v)}
        if past > 0:
            feeds["past_key"], feeds["past_value"] = k[:, :, :past], v[:, :, :past]
        if sink is not None:
            feeds["head_sink"] = sink
        feeds = {n: self._io(g.dtype, n, a) for n, a in feeds.items()}
        feeds["seqlens_k"] = np.full(B, skv - 1, np.int32)
        feeds["total_sequence_length"] = np.array(skv, np.int32)
        return feeds

    @staticmethod
    def _io(dtype: str, name: str, a: np.ndarray) -> np.ndarray:
        """``a`` as a contiguous array of the I/O dtype; bf16 as its bit patterns (the harness
        holds bf16 values in float32, so the top 16 bits carry them exactly)."""
        if dtype == "fp16":
            return np.ascontiguousarray(a, dtype=np.float16)
        a = np.ascontiguousarray(a, dtype=np.float32)
        if dtype == "fp32":
            return a
        bits = a.view(np.uint32)
        if name != "head_sink" and np.any(bits & 0xFFFF):
            raise ValueError(f"{name}: values are not bf16 (low 16 bits of a float32 set)")
        return (bits >> 16).astype(np.uint16)

    def _execute(self, session, g: Geometry, feeds: dict[str, np.ndarray]) -> np.ndarray:
        """One run through an IO binding: inputs as OrtValues over the arrays, the output into
        a host array of the I/O dtype (uint16 bit patterns for bf16), the present cache left
        where the provider allocates it."""
        ort = _ort()
        elem = ELEM[g.dtype]
        io = session.io_binding()
        for name, a in feeds.items():
            ov = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(a, elem) if a.dtype == np.uint16
                  else ort.OrtValue.ortvalue_from_numpy(a))
            io.bind_ortvalue_input(name, ov)
        np_dt = {"fp16": np.float16, "fp32": np.float32, "bf16": np.uint16}[g.dtype]
        out = np.empty((g.B, g.sq, g.Hq * g.d), np_dt)
        ov = (ort.OrtValue.ortvalue_from_numpy_with_onnx_type(out, elem) if g.dtype == "bf16"
              else ort.OrtValue.ortvalue_from_numpy(out))
        io.bind_ortvalue_output("output", ov)
        io.bind_output("present_key")
        io.bind_output("present_value")
        session.run_with_iobinding(io)
        return out


__all__ = ["Geometry", "OrtKernel"]
