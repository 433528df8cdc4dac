"""The shapes of the JSON documents the harness writes and reads back, checked at read time.

``refattn report`` and ``python -m hipkernel.record --check`` read files that a run, a kill
matrix or a GPU run wrote, and that a person or a merge may have edited since. Each file
is checked here once, when it is read: a field of the wrong type (``"results": 5``, a hash
given as a number, a bench time given as a string, ``"rel_l2": Infinity``) is a problem
``FIELD: why`` naming the field's path (``results[3].rel_l2``), and the file is then left out,
so the code that builds the report only ever sees documents of the right shape.

A spec is a small tree:

* a type (``str``, ``int``, ``bool``, ``dict``, ``list``), or :data:`NUM` (a finite number, not
  a bool), or :data:`ANY`;
* ``Opt(spec)``: the value may be absent or null;
* ``[spec]``: a list whose every item matches;
* ``{key: spec}``: an object with these keys (others are allowed); a key is required unless
  its spec is ``Opt``;
* ``Map(spec)``: an object whose every value matches;
* ``Either(a, b, ...)``: one of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Opt:
    spec: object


@dataclass(frozen=True)
class Map:
    spec: object


@dataclass(frozen=True)
class Either:
    specs: tuple

    def __init__(self, *specs):
        object.__setattr__(self, "specs", specs)


class _Num:
    def __repr__(self):
        return "a finite number"


class _Any:
    def __repr__(self):
        return "anything"


NUM, ANY = _Num(), _Any()
_NAMES = {str: "a string", int: "an integer", bool: "true or false", dict: "an object", list: "a list"}


def _kind(x) -> str:
    if x is None:
        return "null"
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    return {bool: "a bool", int: "an integer", float: "a number", str: "a string", list: "a list",
            dict: "an object"}.get(type(x), type(x).__name__)


def _what(spec) -> str:
    if isinstance(spec, Opt):
        return _what(spec.spec) + " or null"
    if isinstance(spec, list):
        return "a list"
    if isinstance(spec, (dict, Map)):
        return "an object"
    if isinstance(spec, Either):
        return " or ".join(_what(s) for s in spec.specs)
    return _NAMES.get(spec, repr(spec))


def problems(value, spec, path: str = "") -> list[str]:
    """Every way ``value`` does not match ``spec``, as ``path: expected ..., got ...``."""
    where = path or "(top level)"
    if isinstance(spec, Opt):
        return [] if value is None else problems(value, spec.spec, path)
    if spec is ANY:
        return []
    if isinstance(spec, Either):
        if any(not problems(value, s, path) for s in spec.specs):
            return []
        return [f"{where}: expected {_what(spec)}, got {_kind(value)}"]
    if spec is NUM:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        return [] if ok else [f"{where}: expected a finite number, got {_kind(value)}"]
    if isinstance(spec, type):
        ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
        return [] if ok else [f"{where}: expected {_NAMES.get(spec, spec.__name__)}, got {_kind(value)}"]
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {_kind(value)}"]
        return [p for i, item in enumerate(value) for p in problems(item, spec[0], f"{path}[{i}]")]
    if isinstance(spec, Map):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {_kind(value)}"]
        return [p for k, item in value.items() for p in problems(item, spec.spec, _join(path, k))]
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{where}: expected an object, got {_kind(value)}"]
        out = []
        for key, sub in spec.items():
            if key not in value:
                if not isinstance(sub, Opt):
                    out.append(f"{_join(path, key)}: missing")
                continue
            out += problems(value[key], sub, _join(path, key))
        return out
    raise TypeError(f"not a spec: {spec!r}")


def _join(path: str, key) -> str:
    return f"{path}.{key}" if path else str(key)


# --------------------------------------------------------------------------- the documents

_COUNT = Opt(int)
RESULT = {  # refattn.runner.Result.to_dict
    "case": str, "suite": Opt(str), "outcome": str, "note": Opt(str), "status": _COUNT,
    "supported": Opt(bool), "rel_l2": Opt(NUM), "max_abs": Opt(NUM), "max_abs_at": Opt([int]),
    "gate": Opt(NUM), "gate_max_abs": Opt(NUM), "seed_gate_pass": Opt(bool),
    "baseline_rel_l2": Opt(NUM), "n_nan": _COUNT, "n_inf": _COUNT, "time_s": Opt(NUM),
    "params": Opt(dict),
}
_STAMP = {"kernel_spec": Opt(str), "kernel_source_hash": Opt(str)}
RUN = {"schema": Opt(int), "kernel": Opt(str), "results": [RESULT], "kernel_facts": Opt(dict),
       **_STAMP}  # MatrixResult.to_json
FUZZ = {"schema": Opt(int), "kind": str, "kernel": str, "ok": bool, "examples": int,  # refattn.fuzz
        "seed": Opt(int), "minimal": Opt({"describe": Opt(str), "command": Opt(str), "toml": Opt(str)}),
        **_STAMP}
DETERMINISM = {"schema": Opt(int), "kind": str, "kernel": str, "ok": bool, "runs": int,  # refattn.determinism
               "results": [{"case": str, "variant": Opt(str), "outcome": str}], **_STAMP}
MUTANT = {"name": str, "killed": bool, "breaks": Opt(str), "killed_by": Opt([str]),
          "killed_by_seed_gate": Opt([str]), "equivalent": Opt(Either(str, bool))}
KILL_MATRIX = {"schema": Opt(int), "kernel": Opt(str), "mutants": [MUTANT], "clean_ok": Opt(bool),
               "clean_failures": Opt([ANY]), "cases": Opt([ANY]), **_STAMP}

GPU_RECORD = {"schema": int, "kind": str, "kernel_source_hash": str, "device": str, "ok": bool,
              "date": Opt(str), "results": Opt([RESULT]), "kernel_spec": Opt(str)}
_PEER = {"status": Opt(str), "ms": Opt(NUM), "sink": Opt(bool)}
_TIMES = {"ms": Opt(NUM), "tflops": Opt(NUM)}
_MODE_RESULT = {"status": Opt(str), "ms": Opt(NUM), "tflops": Opt(NUM), "rel_l2": Opt(NUM),
                "variant": Opt(str), "reason": Opt(str)}
_ALT_PEER = Either(NUM, {"ms": Opt(NUM), "time_ms": Opt(NUM), "median_ms": Opt(NUM), "ratio": Opt(NUM)})
GPU_KINDS = {  # what each kind adds to GPU_RECORD
    "matrix": {"results": [RESULT]},
    "mutants": {"mutants": [MUTANT], "clean_ok": Opt(bool)},
    "mma_check": {"mutants": Opt(Either(Map(dict), [MUTANT]))},
    "torch": {"results": [RESULT], "checks": Map({"ok": bool}), "host": Opt([dict]),
              "chunked_16k": Opt(dict)},
    "measure": {"per_call": Opt([{"ms": Opt(NUM), "tflops": Opt(NUM)}]), "window128_spread": Opt(NUM),
                "window128_flat_within_10pct": Opt(bool), "chunked_16k": Opt(dict)},
    # refattn.bench's record: per shape, "results" keyed by adapter name, each its role and
    # one result per sink mode; records of the engine before it ("hipkernel" and "peers" per
    # shape) and the simpler "rows" body are read too
    "bench": {"kernel": Opt(str),
              "shapes": Opt([{"name": Opt(str), "geometry": Opt({"sink": Opt(bool)}),
                              "results": Opt(Map({"role": Opt(str), "sink": Opt(_MODE_RESULT),
                                                  "nosink": Opt(_MODE_RESULT)})),
                              "hipkernel": Opt({"sink": Opt(_TIMES), "nosink": Opt(_TIMES)}),
                              "peers": Opt(Map(_PEER))}]),
              "rows": Opt([{"peers": Opt(Either(Map(_ALT_PEER), [dict])),
                            "kernel_ms": Opt(NUM), "ms": Opt(NUM), "tflops": Opt(NUM)}]),
              "peers_available": Opt(Map(dict))},
}

BASELINE = {  # refattn.report's latest.json, as far as the diff reads it
    "schema": int, "generated": Opt(str),
    "cases": [{"kernel": Opt(str), "suite": Opt(str), "case": Opt(str), "outcome": Opt(str),
               "rel_l2": Opt(NUM), "note": Opt(str), "n_nan": _COUNT, "n_inf": _COUNT}],
    "kill_matrices": [{"kernel": Opt(str), "mutants": [{"name": Opt(str), "killed": Opt(bool),
                                                        "killed_by": Opt([ANY])}]}],
    "gpu_records": [{"file": Opt(str), "ok": Opt(bool)}],
    "bench": Opt([{"source": Opt(str), "rows": [{"case": Opt(str),
                                                  "peers": [{"peer": Opt(str), "ratio": Opt(NUM)}]}]}]),
}


def gpu_common_problems(rec) -> list[str]:
    """The problems of the fields every GPU record has (hash, kind, device, ok, ...)."""
    found = problems(rec, GPU_RECORD)
    if not found and not rec["kernel_source_hash"].strip():
        found.append("kernel_source_hash: empty")
    return found


def gpu_kind_problems(rec: dict) -> list[str]:
    """The problems of the fields a record's kind adds (``rec`` has passed the common check)."""
    return problems(rec, GPU_KINDS.get(rec["kind"], {}))


def gpu_record_problems(rec) -> list[str]:
    """The problems of one GPU record: the common fields, then its kind's."""
    return gpu_common_problems(rec) or gpu_kind_problems(rec)


__all__ = ["ANY", "BASELINE", "Either", "GPU_KINDS", "GPU_RECORD", "KILL_MATRIX", "Map", "NUM", "Opt",
           "RESULT", "RUN", "gpu_common_problems", "gpu_kind_problems", "gpu_record_problems", "problems"]
