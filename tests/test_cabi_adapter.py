"""The ``cabi`` adapter (refattn/adapters/cabi.py, docs/c-abi.md): a ``_v3`` C entry point
verified through ctypes.

The C example (examples/c_v3/gqa_v3.c) is compiled with the system C compiler into a
temporary directory, as it is and with each of its fault switches; the adapter's marshalling
is checked against recording entry points (ctypes callbacks), on host memory and on device
memory through the recording backend of tests/fake_backend.py, which is also how hipkernel's
C route (hipkernel/cabi.py) is driven here without a GPU."""

from __future__ import annotations

import ctypes
import hashlib
import math
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from refattn.adapters import cabi
from refattn.cases import Case, load_suite, make_inputs
from refattn.kernels import KernelError, get_kernel, parse_kernel_name
from refattn.reference import attention
from refattn.runner import run_case, run_matrix
from tests.fake_backend import RecordingBackend

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "c_v3"
SYMBOL = "gqa_flash_prefill_v3"
FAULTS = ("BROKEN_WINDOW", "DECLINE_WRITES_OUTPUT", "DECLINE_AFTER_FIRST")
SMALL_FLOPS = 2.5e9  # the extended suite's cases below this take the C example ~0.3 s each


# --------------------------------------------------------------------------- the libraries

@pytest.fixture(scope="module")
def libs(tmp_path_factory) -> dict[str, Path]:
    """``{"ok": path, <fault macro>: path}``: the example compiled as it is and with each fault
    switch, each to its own file (a process loads one file once)."""
    cc = shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler (cc) on PATH to build examples/c_v3/gqa_v3.c")
    out = tmp_path_factory.mktemp("cabi")
    built = {}
    for tag in ("ok",) + FAULTS:
        lib = out / f"libgqa_v3_{tag.lower()}.so"
        flags = [] if tag == "ok" else [f"-D{tag}"]
        subprocess.run([cc, "-O2", "-shared", "-fPIC", *flags, "-o", str(lib),
                        str(EXAMPLE / "gqa_v3.c"), "-lm"], check=True)
        built[tag] = lib
    return built


def _kernel(lib: Path):
    return get_kernel(f"cabi:{lib}:{SYMBOL}")


def _case(**kw) -> Case:
    base = dict(name="t", Hq=8, Hkv=2, d=64, sq=7, past_len=5, why="cabi adapter test")
    return Case(**{**base, **kw})


def _small(suite: str) -> list[Case]:
    return [c for c in load_suite(suite) if c.flops <= SMALL_FLOPS]


# --------------------------------------------------------------------------- naming

def test_a_variant_with_colons_and_slashes_survives_the_kernel_name_parser(libs):
    path = f"{libs['ok']}:{SYMBOL}"
    for spec in (f"cabi:{path}", f"refattn.adapters.cabi:CabiKernel:{path}"):
        entry, variant = parse_kernel_name(spec)
        assert entry.target == "refattn.adapters.cabi:CabiKernel" and variant == path
        k = get_kernel(spec)
        assert k.spec.library == libs["ok"] and k.spec.symbol == SYMBOL
        assert k.spec.dtype == "fp16" and k.spec.memory == "host" and not k.requires_gpu


def test_the_example_toml_names_the_library_beside_it(libs, tmp_path):
    shutil.copy(EXAMPLE / "gqa_v3.toml", tmp_path / "gqa_v3.toml")
    shutil.copy(libs["ok"], tmp_path / "libgqa_v3.so")
    k = get_kernel(f"cabi:{tmp_path / 'gqa_v3.toml'}")
    assert k.name == "gqa-v3-c" and k.spec.library == (tmp_path / "libgqa_v3.so").resolve()
    facts = k.facts()
    digest = hashlib.sha256((tmp_path / "libgqa_v3.so").read_bytes()).hexdigest()
    assert facts["library_sha256"] == digest and facts["symbol"] == SYMBOL
    assert facts["library_bytes"] == (tmp_path / "libgqa_v3.so").stat().st_size
    assert facts["dtype"] == "fp16" and facts["memory"] == "host"
    assert k.source_hash() == digest[:16]
    assert k.source_hash() != _kernel(libs["BROKEN_WINDOW"]).source_hash()


# --------------------------------------------------------------------------- the C example

def test_the_example_passes_the_small_cases_of_seed_and_extended(libs):
    cases = _small("seed") + _small("extended")
    assert len(cases) >= 20 and {c.d for c in cases} == {64, 128}
    assert any(c.window > 0 for c in cases) and {c.sink for c in cases} == {"none", "per_head",
                                                                              "smooth"}
    m = run_matrix(_kernel(libs["ok"]), cases)
    bad = [(r.case, r.outcome, r.note) for r in m.results if r.outcome != "pass"]
    assert bad == []


def test_the_example_declines_other_head_dims_and_what_the_abi_cannot_carry(libs):
    k = _kernel(libs["ok"])
    results = {r.case: r for r in run_matrix(k, load_suite("contracts")).results}
    assert all(r.outcome == "declined" for r in results.values()), {
        n: (r.outcome, r.note) for n, r in results.items()}
    for name in ("contract-d80", "contract-d96", "contract-d256"):
        assert results[name].note.endswith(cabi.DECLINED_BY_ENTRY_POINT)
    assert "no softcap" in results["contract-softcap30"].note
    assert "takes fp16 elements" in results["contract-bf16"].note
    assert k.unsupported_reason(_case(d=64)) is None and k.supports(_case(d=128))


def test_a_window_shifted_by_one_fails_the_window_cases(libs):
    k = _kernel(libs["BROKEN_WINDOW"])
    windowed = [c for c in _small("extended") if c.window > 0 and c.sq <= 128]
    assert len(windowed) >= 3
    assert [r.outcome for r in run_matrix(k, windowed).results] == ["fail"] * len(windowed)
    unwindowed = [c for c in _small("extended") if c.window < 0 and c.flops < 1e8]
    assert unwindowed and all(r.outcome == "pass" for r in run_matrix(k, unwindowed).results)


def test_a_decline_that_writes_the_output_is_a_contract_violation(libs):
    k = _kernel(libs["DECLINE_WRITES_OUTPUT"])
    case = _case(d=80)
    assert not k.supports(case)
    assert k.unsupported_reason(case).endswith("and wrote its output buffer")
    r = run_case(k, case)
    assert r.outcome == "contract-violation" and "touched the output buffer" in r.note


def test_a_geometry_computed_once_then_declined_fails(libs):
    # Only the first call of the process computes: supports() saw 0, run() gets -1.
    k = _kernel(libs["DECLINE_AFTER_FIRST"])
    r = run_case(k, _case())
    assert r.supported is True and r.outcome == "fail"
    assert r.note == "declined a case it claims to support"


# --------------------------------------------------------------------------- recording entry points

PROTO = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 5), *([ctypes.c_int] * 9),
                         ctypes.c_float)
PROTO_EXTRA = ctypes.CFUNCTYPE(ctypes.c_int, *([ctypes.c_void_p] * 5), *([ctypes.c_int] * 9),
                               ctypes.c_float, ctypes.c_int, ctypes.c_double)
ARG_NAMES = ("q", "k", "v", "sink", "out", "B", "Sq", "Hq", "Hkv", "d", "S_cap", "past_len",
             "window", "sink_mode", "scale")


class Recorder:
    """An entry point in Python: records each call's arguments and answers with
    ``behave(call)`` (default: return -1, writing nothing)."""

    def __init__(self):
        self.calls: list[dict] = []
        self.behave = lambda call: -1

    def __call__(self, *args):
        call = dict(zip(ARG_NAMES, args))
        call["extra"] = args[len(ARG_NAMES):]
        self.calls.append(call)
        try:
            return self.behave(call)
        except Exception as e:  # noqa: BLE001 - an exception cannot cross the C frame
            call["error"] = repr(e)
            return -3


@pytest.fixture
def stub(monkeypatch, tmp_path):
    """A recorder behind a ctypes function pointer in a module of its own, plus a helper that
    writes a spec file naming it and builds the adapter."""
    rec = Recorder()
    mod = types.ModuleType("_cabi_stub")
    mod.ENTRY, mod.ENTRY_EXTRA = PROTO(rec), PROTO_EXTRA(rec)
    mod.runtime = RecordingBackend()
    mod.device_runtime = lambda: mod.runtime
    monkeypatch.setitem(sys.modules, "_cabi_stub", mod)

    def build(*, entry="ENTRY", **keys):
        lines = [f'callable = "_cabi_stub:{entry}"'] + [f"{k} = {v}" for k, v in keys.items()]
        path = tmp_path / "stub.toml"
        path.write_text("\n".join(lines) + "\n")
        return get_kernel(f"cabi:{path}")

    rec.mod = mod
    rec.build = build
    return rec


def _as_array(ptr: int, dtype, shape) -> np.ndarray:
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return np.frombuffer((ctypes.c_char * n).from_address(ptr), dtype=dtype).reshape(shape)


def test_host_marshalling_pointers_ints_scale_and_sink_modes(stub):
    k = stub.build(entry="ENTRY_EXTRA", extra_args='[{type = "int", value = 7}, '
                                                  '{type = "double", value = 0.25}]')
    seen = {}

    def behave(call):
        if call["sink"]:
            seen["sink"] = _as_array(call["sink"], np.float16, (call["Hq"],)).copy()
        seen["q"] = _as_array(call["q"], np.float16, (call["B"], call["Sq"], call["Hq"],
                                                      call["d"])).copy()
        return -1

    stub.behave = behave
    for sink, mode in (("none", 0), ("per_head", 1), ("smooth", 2)):
        case = _case(sink=sink, window=3, B=2, spare=9)
        inputs = make_inputs(case)
        stub.calls.clear()
        assert not k.supports(case)
        status, out = k.run(inputs)
        assert status == -1 and out is inputs.out and inputs.out_intact()
        probe, call = stub.calls
        for c in (probe, call):
            assert (c["B"], c["Sq"], c["Hq"], c["Hkv"], c["d"]) == (2, 7, 8, 2, 64)
            assert (c["S_cap"], c["past_len"], c["window"], c["sink_mode"]) == (21, 5, 3, mode)
            assert c["scale"] == pytest.approx(1 / math.sqrt(64), rel=1e-7)
            assert c["extra"] == (7, 0.25)
            assert all(c[p] for p in ("q", "k", "v", "out"))
            assert bool(c["sink"]) == (mode == 1)
        assert seen["q"].tobytes() == inputs.q.tobytes()  # the last call saw the real q
        if mode == 1:
            assert seen.pop("sink").tobytes() == inputs.sink.tobytes()
    k.run(make_inputs(_case(scale=0.5)))
    assert stub.calls[-1]["scale"] == 0.5


def test_the_probe_is_cached_per_geometry_not_per_seed(stub):
    k = stub.build()
    for seed in (0, 1, 2):
        assert not k.supports(_case(seed=seed))
    assert len(stub.calls) == 1
    assert not k.supports(_case(past_len=6)) and len(stub.calls) == 2


def test_a_status_other_than_0_or_minus_1_is_passed_through(stub):
    k = stub.build()
    stub.behave = lambda call: 3
    r = run_case(k, _case())
    assert r.outcome == "contract-violation" and r.status == 3


def test_a_library_that_writes_its_inputs_is_an_error(stub):
    k = stub.build()

    def behave(call):
        ctypes.memset(call["k"], 0, 2)
        return 0

    stub.behave = behave
    r = run_case(k, _case())
    assert r.outcome == "error" and "wrote its input k" in r.note


def _compute_into(call, dtype, get):
    """Attention of the call's buffers (read with ``get(ptr, dtype, shape)``) in fp32."""
    B, Sq, Hq, Hkv, d, S_cap = (call[n] for n in ("B", "Sq", "Hq", "Hkv", "d", "S_cap"))
    skv = call["past_len"] + Sq
    q = get(call["q"], dtype, (B, Sq, Hq, d))
    k = get(call["k"], dtype, (B, Hkv, S_cap, d))[:, :, :skv]
    v = get(call["v"], dtype, (B, Hkv, S_cap, d))[:, :, :skv]
    sink = get(call["sink"], dtype, (Hq,)) if call["sink_mode"] == 1 else None
    return attention(q, k, v, past_len=call["past_len"], window=call["window"], sink=sink,
                     smooth_softmax=call["sink_mode"] == 2, scale=call["scale"],
                     dtype=np.float32)


def test_an_fp32_library_gets_fp32_buffers_and_its_own_output_is_judged(stub):
    k = stub.build(dtype='"fp32"')

    def behave(call):
        out = _compute_into(call, np.float32, _as_array)
        _as_array(call["out"], np.float32, out.shape)[...] = out
        return 0

    stub.behave = behave
    for case in (_case(sink="per_head", window=4), _case(dtype="bf16", sink="smooth")):
        r = run_case(k, case)
        assert r.outcome == "pass", r.note


# --------------------------------------------------------------------------- device memory

def _device_reader(rt: RecordingBackend):
    return lambda ptr, dtype, shape: np.frombuffer(bytes(rt._mem[ptr]), dtype=dtype).reshape(shape)


def test_device_memory_marshalling_through_a_runtime(stub):
    k = stub.build(memory='"device"', device_runtime='"_cabi_stub:device_runtime"')
    rt = stub.mod.runtime
    assert k.requires_gpu and type(k).requires_gpu is False
    assert cabi.spec_requires_gpu(str(k.spec.toml))
    assert cabi.CabiKernel.variant_requires_gpu(str(k.spec.toml))
    assert not cabi.CabiKernel.variant_requires_gpu(f"/x/lib.so:{SYMBOL}")
    assert k.available() == (True, f"python:_cabi_stub:ENTRY, fp16, device memory "
                                   f"(RecordingBackend)")

    def behave(call):
        if call["d"] != 64:
            return -1
        out = _compute_into(call, np.float16, _device_reader(rt)).astype(np.float16)
        rt._mem[call["out"]][:] = out.tobytes()
        return 0

    stub.behave = behave
    case = _case(sink="per_head", window=5)
    r = run_case(k, case)
    assert r.outcome == "pass", r.note
    ops = [c[0] for c in rt.calls]
    # probe: 5 allocs, q/k/v/sink zero-filled, canary out uploaded; then the real call
    assert ops.count("alloc") == ops.count("free") == 10 and rt._mem == {}
    assert ops.count("memset") == 4 and ops.count("htod") == 1 + 5
    assert ops.count("synchronize") == ops.count("dtoh") == 2
    assert len(stub.calls) == 2  # the probe, then the case
    allocs = [c[1] for c in rt.calls if c[0] == "alloc"][5:]
    kv = 2 * 2 * case.s_cap * 64
    assert allocs == [2 * 7 * 8 * 64, kv, kv, 2 * 8, 2 * 7 * 8 * 64]
    rt.calls.clear()
    r = run_case(k, _case(d=80))
    assert r.outcome == "declined" and r.note.endswith(cabi.DECLINED_BY_ENTRY_POINT)
    assert rt._mem == {} and [c[0] for c in rt.calls].count("dtoh") == 2


def test_a_device_decline_that_writes_is_seen_byte_for_byte(stub):
    k = stub.build(memory='"device"', device_runtime='"_cabi_stub:device_runtime"')
    rt = stub.mod.runtime

    def behave(call):
        rt._mem[call["out"]][0] ^= 1  # one bit of the canary
        return -1

    stub.behave = behave
    assert not k.supports(_case())
    assert k.unsupported_reason(_case()).endswith("and wrote its output buffer")
    r = run_case(k, _case())
    assert r.outcome == "contract-violation" and "touched the output buffer" in r.note
    assert rt._mem == {}


def test_device_memory_without_a_runtime_is_unavailable_naming_the_key(stub, monkeypatch):
    monkeypatch.setattr(cabi, "default_device_runtime", lambda: None)
    k = stub.build(memory='"device"')
    ok, reason = k.available()
    assert not ok and "device_runtime" in reason and reason.startswith("kernel:")


# --------------------------------------------------------------------------- hipkernel's C route

def test_hipkernel_c_route_marshals_the_abi_into_the_api(monkeypatch):
    from hipkernel import api
    from hipkernel import cabi as hcabi

    got = []

    def record(backend, q, k, v, sink, out, **kw):
        got.append((backend, (q, k, v, sink, out), kw))
        return -1 if kw["d"] == 96 else 0

    fake = RecordingBackend()
    monkeypatch.setattr(api, "flash_prefill_v3", record)
    monkeypatch.setattr("hipkernel.backends.get_backend", lambda name=None: fake)
    fn = ctypes.cast(hcabi.flash_prefill_v3_c, ctypes.c_void_p).value
    call = PROTO(fn)
    assert call(0x100, 0x200, 0x300, 0x400, 0x500, 1, 7, 8, 2, 64, 20, 5, 3, 1, 0.125) == 0
    assert call(0x100, 0x200, 0x300, 0x400, 0x500, 1, 7, 8, 2, 96, 20, 5, -1, 2, 0.5) == -1
    assert call(0x100, 0x200, 0x300, None, 0x500, 2, 7, 8, 2, 64, 20, 5, -1, 0, 0.5) == 0
    (b1, p1, kw1), (_, p2, kw2), (_, p3, kw3) = got
    assert b1 is fake and p1 == (0x100, 0x200, 0x300, 0x400, 0x500)
    assert kw1 == dict(B=1, Sq=7, Hq=8, Hkv=2, d=64, S_cap=20, past_len=5, window=3,
                       sink_mode="per_head", scale=0.125)
    assert p2[3] == 0 and kw2["sink_mode"] == "smooth" and kw2["window"] == -1
    assert p3[3] == 0 and kw3["sink_mode"] == "none" and kw3["B"] == 2
    assert call(0x100, 0x200, 0x300, 0, 0x500, 1, 7, 8, 2, 64, 20, 5, 3, 5, 0.5) == -2
    assert "sink_mode: expected 0" in hcabi.LAST_ERROR and len(got) == 3


def test_hipkernel_c_route_runs_end_to_end_on_the_recording_backend(monkeypatch):
    """The spec of examples/c_v3/hipkernel_v3.toml on the recording backend: buffers are
    allocated, uploaded and freed through it and the kernel's launch gets them. The backend
    computes nothing, so a supported case comes back as the uploaded canaries (NaN): a fail,
    which is what the runner must say of an output nobody wrote."""
    monkeypatch.setenv("HIPKERNEL_TUNE", "0")
    fake = RecordingBackend()
    monkeypatch.setattr("hipkernel.backends.get_backend", lambda name=None: fake)
    k = get_kernel(f"cabi:{EXAMPLE / 'hipkernel_v3.toml'}")
    assert k.name == "hipkernel-v3-cabi" and k.requires_gpu and k.available()[0]
    assert len(k.source_hash()) == 16
    case = _case(sink="per_head", window=4)
    r = run_case(k, case)
    assert r.supported is True and r.outcome == "fail" and r.n_nan == 7 * 8 * 64
    run_allocs = [c for c in fake.calls if c[0] == "alloc"][5:]
    assert fake._mem == {}  # everything freed
    real = fake.launches[-1]["args"]
    assert len(fake.launches) == 2  # the probe's launch, then the case's
    assert real[5:13] == [7, 8, 2, case.s_cap, 5, 4, 1, pytest.approx(0.125)]
    assert [n for _, n in run_allocs] == [2 * 7 * 8 * 64, 2 * 2 * case.s_cap * 64,
                                          2 * 2 * case.s_cap * 64, 2 * 8, 2 * 7 * 8 * 64]
    fake.calls.clear()
    fake.launches.clear()
    r = run_case(k, _case(d=96))
    assert r.outcome == "declined" and fake.launches == [] and fake._mem == {}


# --------------------------------------------------------------------------- bad specs

@pytest.mark.parametrize("body, where", [
    ('library = "libnone.so"\nsymbol = "f"\n', "kernel: library: no file"),
    ('symbol = "f"\n', "library: required key is missing"),
    ('library = "lib.so"\nsymbol = "f"\nthreads = 4\n', "threads: unknown key"),
    ('library = "lib.so"\nsymbol = "f"\ndtype = "bf16"\n', "dtype: expected one of 'fp16', "),
    ('library = "lib.so"\nsymbol = "f"\nmemory = "shared"\n', "memory: expected one of"),
    ('library = "lib.so"\nsymbol = "f"\nextra_args = [{type = "char", value = 1}]\n',
     "extra_args[0].type: expected one of"),
    ('library = "lib.so"\nsymbol = "f"\nextra_args = [{type = "int", value = 1.5}]\n',
     "extra_args[0].value: an int needs an integer"),
    ('library = "lib.so"\nsymbol = "f"\ndevice_runtime = "m:f"\n',
     'device_runtime: only memory = "device"'),
    ('callable = "no_such_module_xyz:f"\n', "kernel: callable: cannot import"),
    ('library = "lib.so"\nsymbol = "f"\ncallable = "m:f"\n', "library: give either"),
    ('library = "lib.so\n', "not valid TOML"),
])
def test_bad_spec_files_name_the_problem(tmp_path, body, where):
    path = tmp_path / "spec.toml"
    path.write_text(body)
    with pytest.raises(KernelError) as e:
        get_kernel(f"cabi:{path}")
    assert str(e.value).startswith("kernel:") and where in str(e.value)


def test_bad_library_specs_name_the_problem(libs, tmp_path):
    with pytest.raises(KernelError, match=r"^kernel: library: no file /no/such/libfoo\.so"):
        get_kernel("cabi:/no/such/libfoo.so:f")
    with pytest.raises(KernelError, match=rf"^kernel: symbol: .* has no symbol 'nope'"):
        get_kernel(f"cabi:{libs['ok']}:nope")
    junk = tmp_path / "junk.so"
    junk.write_text("not an ELF file")
    with pytest.raises(KernelError, match=r"^kernel: library: cannot load"):
        get_kernel(f"cabi:{junk}:f")
    with pytest.raises(KernelError, match=r"^kernel: cabi: expected"):
        get_kernel("cabi")
    with pytest.raises(KernelError, match=r"^kernel: cabi: expected /path/to/libfoo.so:symbol"):
        get_kernel("cabi:/no/symbol/given.so")
    with pytest.raises(KernelError, match=r"^kernel: .*missing\.toml: no such file"):
        get_kernel(f"cabi:{tmp_path / 'missing.toml'}")
    with pytest.raises(KernelError, match=r"cabi has no mutants"):
        get_kernel(f"cabi:{libs['ok']}:{SYMBOL}", mutants=frozenset({"no_nan_guard"}))


def test_the_default_device_runtime_is_the_registered_entry_point(stub, monkeypatch, tmp_path):
    (tmp_path / "pyproject.toml").write_text(
        '[project.entry-points."refattn.device_runtimes"]\n'
        'default = "_cabi_stub:device_runtime"\n')
    monkeypatch.setattr(cabi.importlib.metadata, "entry_points", lambda group: ())
    monkeypatch.setattr(cabi, "SOURCE_ROOT", tmp_path)
    assert cabi.default_device_runtime() == "_cabi_stub:device_runtime"
    k = stub.build(memory='"device"')
    assert k.available()[0] and k.facts()["device_runtime"] == "_cabi_stub:device_runtime"
    assert run_case(k, _case()).outcome == "declined" and stub.mod.runtime._mem == {}
