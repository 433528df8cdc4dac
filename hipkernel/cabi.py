"""hipkernel's ``flash_prefill_v3`` as a C function pointer with the ``_v3`` ABI.

The ABI is the one refattn's ``cabi`` adapter calls (docs/c-abi.md)::

    int f(const void *q, const void *k, const void *v, const void *sink, void *out,
          int B, int Sq, int Hq, int Hkv, int d, int S_cap, int past_len, int window,
          int sink_mode, float scale);

:data:`flash_prefill_v3_c` is a ``ctypes.CFUNCTYPE`` callback of that prototype. Called (from
C, or from Python through ctypes), it maps ``sink_mode`` 0/1/2 to ``"none"``, ``"per_head"``,
``"smooth"`` and calls :func:`hipkernel.api.flash_prefill_v3` on the device pointers with the
backend :func:`device_runtime` gives (``hipkernel.backends.get_backend()``, looked up at each
call), so the buffers and the launch share one backend. It returns what that returns: 0
(computed) or -1 (declined before any device call, ``out`` untouched). An exception (invalid
arguments raise ``ValueError`` in the API; a backend error) cannot cross a C frame, so it is
printed to stderr, kept in :data:`LAST_ERROR`, and the call returns :data:`ERROR_STATUS`.

Named in a refattn spec file (examples/c_v3/hipkernel_v3.toml)::

    callable = "hipkernel.cabi:flash_prefill_v3_c"
    memory = "device"
    device_runtime = "hipkernel.backends:get_backend"
"""

from __future__ import annotations

import ctypes
import hashlib
import sys
import traceback
from pathlib import Path

from hipkernel import api, backends

SINK_MODES = {0: "none", 1: "per_head", 2: "smooth"}  # the ABI's int -> the API's name
ERROR_STATUS = -2  # an exception was raised inside the call: nothing is known to be computed
V3_PROTOTYPE = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 5), *([ctypes.c_int] * 9),
                                ctypes.c_float)
LAST_ERROR: str | None = None  # the traceback of the last call that returned ERROR_STATUS


def device_runtime():
    """The backend the entry point launches on: ``hipkernel.backends.get_backend()``."""
    return backends.get_backend()


def call_v3(q, k, v, sink, out, B: int, Sq: int, Hq: int, Hkv: int, d: int, S_cap: int,
            past_len: int, window: int, sink_mode: int, scale: float) -> int:
    """The ABI's arguments as :func:`hipkernel.api.flash_prefill_v3` takes them (a NULL
    pointer, None from ctypes, as 0; ``sink_mode`` by name; the sink pointer only for
    ``sink_mode == 1``). ValueError naming ``sink_mode`` for a value outside 0, 1, 2."""
    if sink_mode not in SINK_MODES:
        raise ValueError(f"sink_mode: expected 0 (none), 1 (per_head) or 2 (smooth), "
                         f"got {sink_mode!r}")
    ptr = [int(p or 0) for p in (q, k, v, sink, out)]
    return api.flash_prefill_v3(device_runtime(), ptr[0], ptr[1], ptr[2],
                                ptr[3] if sink_mode == 1 else 0, ptr[4], B=B, Sq=Sq, Hq=Hq,
                                Hkv=Hkv, d=d, S_cap=S_cap, past_len=past_len, window=window,
                                sink_mode=SINK_MODES[sink_mode], scale=float(scale))


def _entry(q, k, v, sink, out, B, Sq, Hq, Hkv, d, S_cap, past_len, window, sink_mode, scale):
    global LAST_ERROR
    try:
        status = int(call_v3(q, k, v, sink, out, B, Sq, Hq, Hkv, d, S_cap, past_len, window,
                             sink_mode, scale))
    except Exception:  # noqa: BLE001 - an exception must not unwind through a C frame
        LAST_ERROR = traceback.format_exc()
        print(f"hipkernel.cabi: flash_prefill_v3_c returns {ERROR_STATUS}:\n{LAST_ERROR}",
              file=sys.stderr, end="")
        return ERROR_STATUS
    LAST_ERROR = None
    return status


flash_prefill_v3_c = V3_PROTOTYPE(_entry)


def source_hash() -> str:
    """sha256 over the kernel sources (``hipkernel.api.source_hash``), the API module and this
    module: what a result of the C route depends on."""
    h = hashlib.sha256(api.source_hash().encode())
    for path in (Path(api.__file__), Path(__file__)):
        h.update(b"\0" + path.read_bytes())
    return h.hexdigest()


__all__ = ["ERROR_STATUS", "SINK_MODES", "V3_PROTOTYPE", "call_v3", "device_runtime",
           "flash_prefill_v3_c", "source_hash"]
