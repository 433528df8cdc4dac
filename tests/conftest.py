"""pytest plumbing for the case matrix.

Options:
    --kernel NAME   kernel(s) for tests/test_matrix.py, repeatable (a registered name, a
                    name:variant, or package.module:Class). Default: ``model`` plus every
                    registered GPU kernel (skipped, with the reason, where it cannot run).
    --suite NAME    suite(s) for the matrix, repeatable. Default: seed, extended, contracts.

Several GPUs: ``pytest -n auto --dist loadgroup`` (pytest-xdist) runs one worker per visible
GPU, each pinned to its own device before any backend initialises, and keeps every case of one
autotune key on one worker (see "several GPUs" below and refattn/sharding.py).

Matrix test ids are ``<kernel>-<case name>``, so ``-k gptoss-sink-past8192-w128`` or
``-k "model and w128"`` narrows a run. Cases of a kernel that needs a GPU carry the ``gpu``
marker (``-m "not gpu"`` deselects them). On a CPU kernel, cases above ``SLOW_FLOPS`` useful
FLOPs (the four unwindowed past_len=8192 seed cases, ~30-40 s each for the NumPy model plus
the fp64 reference on a 2-core machine) carry the ``slow`` marker.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a source tree: refattn, hipkernel, tests.helpers_kernels
    sys.path.insert(0, str(ROOT))

DEFAULT_SUITES = ("seed", "extended", "contracts")
DEFAULT_KERNEL = "model"
SLOW_FLOPS = 5e10  # Case.flops above which a CPU kernel's case is marked slow


def pytest_addoption(parser):
    g = parser.getgroup("refattn", "refattn case matrix")
    g.addoption("--kernel", action="append", dest="refattn_kernels", metavar="NAME", default=None,
                help="kernel for the case matrix (repeatable): reference, model, hipkernel[:cuda|:hip] "
                     "or package.module:Class. Default: model plus every registered GPU kernel.")
    g.addoption("--suite", action="append", dest="refattn_suites", metavar="NAME", default=None,
                help=f"case suite for the matrix (repeatable). Default: {', '.join(DEFAULT_SUITES)}.")


def matrix_kernel_names(config) -> list[str]:
    """--kernel values, or ``model`` plus every registered kernel that needs a GPU."""
    names = config.getoption("refattn_kernels")
    if names:
        return list(dict.fromkeys(names))
    from refattn.kernels import available_kernels

    gpu = [n for n, e in available_kernels().items() if n != DEFAULT_KERNEL and e.requires_gpu]
    return [DEFAULT_KERNEL, *gpu]


def matrix_suites(config) -> list[str]:
    return list(config.getoption("refattn_suites") or DEFAULT_SUITES)


def pytest_generate_tests(metafunc):
    """Parametrise tests that take ``kernel_name`` and ``case`` over kernels x cases."""
    if not {"kernel_name", "case"} <= set(metafunc.fixturenames):
        return
    from refattn.cases import CaseError, load_suites
    from refattn.kernels import KernelError, parse_kernel_name
    from refattn.sharding import group_key

    try:
        cases = load_suites(matrix_suites(metafunc.config))
    except CaseError as e:
        raise pytest.UsageError(f"--suite: {e}") from None
    params = []
    for spec in matrix_kernel_names(metafunc.config):
        try:
            entry, _ = parse_kernel_name(spec)
        except KernelError as e:
            raise pytest.UsageError(f"--kernel: {e}") from None
        gpu = entry.load().requires_gpu
        for c in cases:
            marks = [pytest.mark.gpu] if gpu else ([pytest.mark.slow] if c.flops > SLOW_FLOPS else [])
            # one autotune key -> one xdist worker under --dist loadgroup (refattn.sharding)
            marks.append(pytest.mark.xdist_group(name=group_key(c)))
            params.append(pytest.param(spec, c, id=f"{spec}-{c.name}", marks=marks))
    metafunc.parametrize(("kernel_name", "case"), params)


_ADAPTERS: dict[str, object] = {}  # spec -> adapter, or the reason it cannot run here


@pytest.fixture
def kernel(kernel_name):
    """The adapter for ``kernel_name`` (built once per session); skips with the reason when it
    cannot be imported, built, or run here."""
    from refattn.kernels import KernelError, get_kernel, kernel_available

    if kernel_name not in _ADAPTERS:
        try:
            adapter = get_kernel(kernel_name)
            ok, reason = kernel_available(adapter)
            _ADAPTERS[kernel_name] = adapter if ok else f"{kernel_name} is not available here: {reason}"
        except KernelError as e:
            _ADAPTERS[kernel_name] = str(e)
    got = _ADAPTERS[kernel_name]
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.fixture
def suite_dir(tmp_path, monkeypatch):
    """A fresh cases directory in $REFATTN_CASES_DIR; returns ``write(name, text) -> Path``."""
    d = tmp_path / "cases"
    d.mkdir()
    monkeypatch.setenv("REFATTN_CASES_DIR", str(d))

    def write(name: str, text: str) -> Path:
        p = d / f"{name}.toml"
        p.write_text(text)
        return p

    write.dir = d
    return write


# --------------------------------------------------------------------------- several GPUs
#
# ``pytest -n N --dist loadgroup`` (pytest-xdist): the controller counts the visible devices
# without initialising CUDA/HIP (refattn.sharding.visible_devices: $CUDA_VISIBLE_DEVICES,
# $HIP_VISIBLE_DEVICES, ``nvidia-smi -L``, the KFD topology) and hands the list to every
# worker; worker gwN sets CUDA_VISIBLE_DEVICES (or HIP_VISIBLE_DEVICES) to the N-th entry,
# HIPKERNEL_DEVICE=0 and, unless already set, REFATTN_THREADS to its share of the host's
# usable CPUs (the size of the fp64 reference's thread pool, so N workers do not oversubscribe
# the host; the header line reports it) in pytest_configure. That is early enough: before it,
# a worker has only imported pytest, its plugins and this file (whose top level imports
# nothing of refattn, hipkernel or cuda); test modules are imported at collection, after
# configure; and even an imported cuda-bindings reads the variable only at cuInit, which
# hipkernel.backends does lazily on the first get_backend(). ``-n auto`` is the device count
# when a GPU kernel is selected (xdist's CPU count otherwise). With $REFATTN_RESULTS_DIR set,
# every matrix case appends its judged Result as a JSON line to a per-worker file there
# (``refattn run --gpus`` merges them).

_DEVICES = None  # the controller's visible devices (refattn.sharding.Devices), computed once
_PINNED: dict = {}  # this worker's pin: worker, var, device


def _visible_devices():
    global _DEVICES
    if _DEVICES is None:
        from refattn.sharding import visible_devices

        _DEVICES = visible_devices()
    return _DEVICES


def _gpu_kernel_selected(config) -> bool:
    from refattn.kernels import KernelError, parse_kernel_name

    for spec in matrix_kernel_names(config):
        try:
            entry, _ = parse_kernel_name(spec)
        except KernelError:
            continue  # reported by pytest_generate_tests
        if entry.load().requires_gpu:
            return True
    return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per visible GPU when a GPU kernel is selected; else None, which
    leaves xdist's default (the CPU count, or $PYTEST_XDIST_AUTO_NUM_WORKERS)."""
    from refattn.sharding import auto_num_workers

    return auto_num_workers(_gpu_kernel_selected(config), _visible_devices())


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: give each worker the controller's device list (the parent's view)."""
    node.workerinput["refattn_devices"] = _visible_devices().to_dict()


def _pin_worker(config, workerinput) -> None:
    from refattn.sharding import Devices, pin_environment, visible_devices

    wid = workerinput.get("workerid")
    info = workerinput.get("refattn_devices")
    devices = Devices.from_dict(info) if info else visible_devices()
    backends = sys.modules.get("hipkernel.backends")
    if backends is not None and getattr(backends, "_INSTANCES", None):
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"refattn: a GPU backend initialised in worker {wid} before its device was pinned; "
            f"{devices.var} may not take effect"), stacklevel=2)
    dev = pin_environment(wid, devices, workers=workerinput.get("workercount"))
    _PINNED.update(worker=wid, var=devices.var if dev is not None else None, device=dev)


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # Registered here as well as by xdist, so --strict-markers holds without pytest-xdist.
    config.addinivalue_line("markers", "xdist_group(name): keep these tests on one pytest-xdist "
                                       "worker under --dist loadgroup (one autotune key)")
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        _pin_worker(config, workerinput)


def pytest_report_header(config):
    n = getattr(config.option, "numprocesses", None)
    if getattr(config, "workerinput", None) is not None or not n or not isinstance(n, int):
        return None
    from refattn.sharding import device_for_worker, threads_note

    d = _visible_devices()
    if not len(d):
        return f"refattn: no GPU visible ({d.source}); workers are not pinned"
    plan = ", ".join(f"gw{i}->{device_for_worker(f'gw{i}', d)}" for i in range(min(n, 8)))
    lines = [f"refattn: {len(d)} device(s) from {d.source}; {d.var}: {plan}"
             + (" ..." if n > 8 else "") + f"; {threads_note(n)}"]
    if config.getoption("dist", "no") != "loadgroup":
        lines.append("refattn: add --dist loadgroup to keep each autotune key on one worker")
    return lines


def _worker_id():
    return os.environ.get("PYTEST_XDIST_WORKER")


def _pinned_device():
    var = _PINNED.get("var")
    return os.environ.get(var) if var else None


def _matrix_params(item):
    cs = getattr(item, "callspec", None)
    if cs is None or not {"kernel_name", "case"} <= set(cs.params):
        return None
    return cs.params


@pytest.fixture(autouse=True)
def _refattn_record_results(request, monkeypatch):
    """With $REFATTN_RESULTS_DIR set, a matrix test's judged Result is appended to this
    worker's JSON-lines file there: the module's ``run_case`` is wrapped for the test."""
    from refattn.sharding import RESULTS_DIR_ENV

    results_dir = os.environ.get(RESULTS_DIR_ENV)
    params = _matrix_params(request.node)
    run_case = getattr(request.module, "run_case", None)
    if not results_dir or params is None or run_case is None:
        return

    def recording_run_case(kernel, case, *args, **kwargs):
        from refattn.sharding import append_row, result_row

        result = run_case(kernel, case, *args, **kwargs)
        append_row(results_dir, _worker_id(), result_row(
            result, kernel_spec=params["kernel_name"],
            kernel_name=str(getattr(kernel, "name", params["kernel_name"])), case=case,
            worker_id=_worker_id(), device=_pinned_device(), nodeid=request.node.nodeid))
        return result

    monkeypatch.setattr(request.module, "run_case", recording_run_case)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With $REFATTN_RESULTS_DIR set, a skipped matrix case (kernel not available on this
    worker) is recorded too, with the reason."""
    outcome = yield
    report = outcome.get_result()
    from refattn.sharding import RESULTS_DIR_ENV

    results_dir = os.environ.get(RESULTS_DIR_ENV)
    params = _matrix_params(item)
    if results_dir and params is not None and report.skipped and report.when == "setup":
        from refattn.sharding import append_row, skip_row

        lr = report.longrepr
        reason = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        append_row(results_dir, _worker_id(), skip_row(
            kernel_spec=params["kernel_name"], case=params["case"], reason=reason,
            worker_id=_worker_id(), device=_pinned_device(), nodeid=item.nodeid))


# CI gates a landing, so it replays the same hypothesis examples every run (derandomize);
# local runs keep exploring new ones. Set CI=1 to reproduce CI's examples.
try:
    import os as _os

    from hypothesis import settings as _hsettings

    _hsettings.register_profile("ci", derandomize=True, database=None)
    if _os.environ.get("CI"):
        _hsettings.load_profile("ci")
except ImportError:  # hypothesis is in the test extra; without it those tests don't import
    pass
