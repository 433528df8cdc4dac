"""refattn's case matrix as pytest tests, in any repository: ``pytest --refattn-kernel SPEC``.

Installed with refattn (entry point ``pytest11``, name ``refattn.pytest_plugin``), or loaded
with ``-p refattn.pytest_plugin``::

    pytest --refattn-kernel mypkg.mod:MyKernel --refattn-suite seed -k w128

Options:
    --refattn-kernel SPEC   kernel to verify (repeatable): a registered name, ``module:Class``
                            or ``path/to/file.py:Class`` (:func:`refattn.kernels.get_kernel`)
    --refattn-suite NAME    case suite (repeatable; a name or a ``.toml`` path). Default:
                            seed, extended, contracts.

With ``--refattn-kernel`` the test module shipped in the package, ``refattn/matrix_tests.py``,
is added to the collection: one test per (kernel, case), node ids
``refattn/matrix_tests.py::test_case[<kernel>-<case name>]``, each judging
:func:`refattn.runner.run_case` and failing with the case's whole story. A kernel whose
``available()`` says no is skipped with its reason; the cases of a kernel with
``requires_gpu`` carry the ``gpu`` marker; on a CPU kernel, cases above :data:`SLOW_FLOPS`
useful FLOPs carry ``slow``. Without ``--refattn-kernel`` (and without a
``pytest_refattn_matrix`` hook, below) the plugin adds no tests and no markers, and changes
no environment variable: it is inert.

A repository with its own matrix tests reuses this machinery: a ``pytest_refattn_matrix(config)``
hook (in a conftest) returns a :class:`Matrix`, and every test that takes ``refattn_kernel``
and ``refattn_case`` (e.g. one that imports ``refattn.matrix_tests.test_case``) outside the
shipped module is parametrised over it, with the same ids and marks.

Several GPUs, whenever a matrix is in use: ``pytest -n N --dist loadgroup`` (pytest-xdist)
gives each worker its own device, pinned in ``pytest_configure`` before any backend
initialises (:func:`refattn.sharding.pin_environment`: ``CUDA_VISIBLE_DEVICES`` or
``HIP_VISIBLE_DEVICES``, ``HIPKERNEL_DEVICE=0``, ``REFATTN_THREADS`` to its share of the
CPUs), keeps every case of one autotune key on one worker (the ``xdist_group`` mark), and
makes ``-n auto`` the device count when a GPU kernel is selected. With
``$REFATTN_RESULTS_DIR`` set, every matrix case appends its judged Result (or its skip) as a
JSON line to a per-worker file there, which ``refattn run --gpus N`` merges.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

from refattn.sharding import MATRIX_NODEID, MATRIX_TESTS, RESULTS_DIR_ENV

PLUGIN_NAME = "refattn.pytest_plugin"
DEFAULT_SUITES = ("seed", "extended", "contracts")
SLOW_FLOPS = 5e10  # Case.flops above which a CPU kernel's case is marked slow
PARAMS = ("refattn_kernel_spec", "refattn_case")  # what a matrix test is parametrised over

MARKERS = (
    "gpu: needs a working GPU backend (skipped with a reason when none is present)",
    "slow: long-running CPU test",
    "xdist_group(name): keep these tests on one pytest-xdist worker under --dist loadgroup "
    "(one autotune key)",
)


@dataclass(frozen=True)
class Matrix:
    """Which kernels over which suites. ``kernels``: the specs, or a callable giving them
    (called at collection, so defaults that import the kernel registry stay out of
    ``pytest_configure``). The option names are what error messages blame.
    ``gpu_initialised``: an optional probe, True when a GPU backend has already initialised
    in this process (a worker pinned after that may not see its device)."""

    kernels: Sequence[str] | Callable[[], Sequence[str]]
    suites: Sequence[str] = DEFAULT_SUITES
    kernel_option: str = "--refattn-kernel"
    suite_option: str = "--refattn-suite"
    gpu_initialised: Callable[[], bool] | None = None

    @property
    def explicit(self) -> bool:
        """Kernels named by the user: one that cannot be imported is a usage error (a
        default one is skipped with the reason instead)."""
        return not callable(self.kernels)

    def kernel_specs(self) -> list[str]:
        return list(dict.fromkeys(self.kernels() if callable(self.kernels) else self.kernels))


class _Hooks:
    @pytest.hookspec(firstresult=True)
    def pytest_refattn_matrix(self, config) -> Matrix | None:
        """The :class:`Matrix` of this repository's own matrix tests (tests taking
        ``refattn_kernel`` and ``refattn_case`` outside ``refattn/matrix_tests.py``), or None."""


_CLI = pytest.StashKey[object]()  # Matrix | None, from --refattn-kernel / --refattn-suite
_HOOKED = pytest.StashKey[object]()  # Matrix | None, from pytest_refattn_matrix
_PARAMS = pytest.StashKey[dict]()  # id(Matrix) -> its pytest.param list
_ADAPTERS = pytest.StashKey[dict]()  # spec -> adapter, or the reason it cannot run here
_DEVICES = pytest.StashKey[object]()  # the controller's visible devices
_PIN = pytest.StashKey[dict]()  # this worker's pin: worker, var, device


def pytest_addhooks(pluginmanager):
    pluginmanager.add_hookspecs(_Hooks)


def pytest_addoption(parser):
    g = parser.getgroup("refattn", "refattn case matrix (refattn.pytest_plugin)")
    g.addoption("--refattn-kernel", action="append", dest="refattn_kernel_specs", metavar="SPEC",
                default=None,
                help="verify this kernel over refattn's cases (repeatable): a registered name, "
                     "package.module:Class or path/to/file.py:Class. Without it the plugin adds "
                     "no tests.")
    g.addoption("--refattn-suite", action="append", dest="refattn_suite_names", metavar="NAME",
                default=None,
                help="case suite for --refattn-kernel (repeatable; a name or a .toml path). "
                     f"Default: {', '.join(DEFAULT_SUITES)}.")


# --------------------------------------------------------------------------- which matrix

def cli_matrix(config) -> Matrix | None:
    """The matrix of ``--refattn-kernel`` / ``--refattn-suite``, or None without them."""
    if _CLI not in config.stash:
        specs = config.getoption("refattn_kernel_specs", None)
        suites = config.getoption("refattn_suite_names", None)
        if not specs and suites:
            raise pytest.UsageError("--refattn-suite: needs --refattn-kernel SPEC (the kernel "
                                    "to run the suites on)")
        for s in specs or ():
            if not s.strip():
                raise pytest.UsageError(f"--refattn-kernel: expected a kernel name, got {s!r}")
        config.stash[_CLI] = (Matrix(tuple(specs), tuple(dict.fromkeys(suites or DEFAULT_SUITES)))
                              if specs else None)
    return config.stash[_CLI]


def hooked_matrix(config) -> Matrix | None:
    """The matrix a ``pytest_refattn_matrix`` hook returns, or None."""
    if _HOOKED not in config.stash:
        m = config.hook.pytest_refattn_matrix(config=config)
        if m is not None and not isinstance(m, Matrix):
            raise pytest.UsageError(f"pytest_refattn_matrix: expected a "
                                    f"refattn.pytest_plugin.Matrix or None, got {type(m).__name__}")
        config.stash[_HOOKED] = m
    return config.stash[_HOOKED]


def active_matrices(config) -> list[Matrix]:
    return [m for m in (cli_matrix(config), hooked_matrix(config)) if m is not None]


def _is_matrix_module(path) -> bool:
    try:
        return Path(path).resolve() == MATRIX_TESTS
    except (OSError, TypeError):
        return False


def matrix_for(config, module_path) -> Matrix:
    """The matrix a test in ``module_path`` is parametrised over: the shipped module's is the
    command line's; any other module's is the hook's (else the command line's)."""
    cli = cli_matrix(config)
    m = cli if _is_matrix_module(module_path) else (hooked_matrix(config) or cli)
    if m is None:
        raise pytest.UsageError(f"{module_path}: refattn's case matrix needs a kernel: "
                                f"--refattn-kernel SPEC")
    return m


# --------------------------------------------------------------------------- parametrisation

def matrix_params(matrix: Matrix) -> list:
    """One ``pytest.param(spec, case)`` per (kernel, case), id ``<spec>-<case name>``, marked
    ``gpu`` (kernel with ``requires_gpu``) or ``slow`` (a CPU kernel's case above
    :data:`SLOW_FLOPS`), and ``xdist_group`` by the case's autotune key. A bad suite or
    kernel is a :class:`pytest.UsageError` naming the option."""
    from refattn.cases import CaseError, load_suites
    from refattn.kernels import KernelError, parse_kernel_name
    from refattn.sharding import group_key

    try:
        cases = load_suites(list(matrix.suites))
    except CaseError as e:
        raise pytest.UsageError(f"{matrix.suite_option}: {e}") from None
    params = []
    for spec in matrix.kernel_specs():
        try:
            entry, variant = parse_kernel_name(spec)
        except KernelError as e:
            raise pytest.UsageError(f"{matrix.kernel_option}: {e}") from None
        entry.load()
        if entry.error and matrix.explicit:
            raise pytest.UsageError(f"{matrix.kernel_option}: kernel {spec!r}: {entry.error}")
        gpu = entry.requires_gpu_for(variant)
        for c in cases:
            marks = [pytest.mark.gpu] if gpu else ([pytest.mark.slow] if c.flops > SLOW_FLOPS else [])
            # one autotune key -> one xdist worker under --dist loadgroup (refattn.sharding)
            marks.append(pytest.mark.xdist_group(name=group_key(c)))
            params.append(pytest.param(spec, c, id=f"{spec}-{c.name}", marks=marks))
    return params


def _params(config, matrix: Matrix) -> list:
    cache = config.stash.setdefault(_PARAMS, {})
    if id(matrix) not in cache:
        cache[id(matrix)] = matrix_params(matrix)
    return cache[id(matrix)]


def pytest_generate_tests(metafunc):
    """Parametrise tests that take ``refattn_kernel`` and ``refattn_case`` over the matrix."""
    if not set(PARAMS) <= set(metafunc.fixturenames):
        return
    m = matrix_for(metafunc.config, metafunc.module.__file__)
    metafunc.parametrize(PARAMS, _params(metafunc.config, m))


def pytest_pycollect_makemodule(module_path, parent):
    """The shipped module's node id is ``refattn/matrix_tests.py`` wherever refattn lies, so
    ids, ``--deselect`` and reports read the same from a wheel as from a source tree."""
    if _is_matrix_module(module_path):
        return pytest.Module.from_parent(parent, path=module_path, nodeid=MATRIX_NODEID)
    return None


def _names_matrix_module(config) -> bool:
    base = config.invocation_params.dir
    for arg in config.args:
        path = Path(str(arg).split("::", 1)[0])
        if _is_matrix_module(path if path.is_absolute() else base / path):
            return True
    return False


@pytest.fixture
def refattn_kernel(request, refattn_kernel_spec):
    """The adapter for ``refattn_kernel_spec`` (built once per session); skips with the
    reason when it cannot be built or says it is not available here."""
    from refattn.kernels import KernelError, get_kernel, kernel_available

    cache = request.config.stash.setdefault(_ADAPTERS, {})
    spec = refattn_kernel_spec
    if spec not in cache:
        try:
            adapter = get_kernel(spec)
            ok, reason = kernel_available(adapter)
            cache[spec] = adapter if ok else f"{spec} is not available here: {reason}"
        except KernelError as e:
            cache[spec] = str(e)
    got = cache[spec]
    if isinstance(got, str):
        pytest.skip(got)
    return got


@pytest.fixture
def refattn_record(request):
    """``record(result)``: with ``$REFATTN_RESULTS_DIR`` set, append the judged Result of this
    matrix test to this worker's JSON-lines file there; otherwise nothing."""
    results_dir = os.environ.get(RESULTS_DIR_ENV)
    params = _matrix_params(request.node)

    def record(result) -> None:
        if not results_dir or params is None:
            return
        from refattn.sharding import append_row, result_row

        spec = params["refattn_kernel_spec"]
        kernel = request.config.stash.get(_ADAPTERS, {}).get(spec)
        append_row(results_dir, _worker_id(), result_row(
            result, kernel_spec=spec, kernel_name=str(getattr(kernel, "name", spec)),
            case=params["refattn_case"], worker_id=_worker_id(),
            device=_pinned_device(request.config), nodeid=request.node.nodeid))

    return record


def _matrix_params(item):
    cs = getattr(item, "callspec", None)
    if cs is None or not set(PARAMS) <= set(cs.params):
        return None
    return cs.params


# --------------------------------------------------------------------------- several GPUs

def _visible_devices(config):
    if _DEVICES not in config.stash:
        from refattn.sharding import visible_devices

        config.stash[_DEVICES] = visible_devices()
    return config.stash[_DEVICES]


def pin_worker(config, workerinput, probe: Callable[[], bool] | None = None) -> dict:
    """Pin this xdist worker to its device (the controller's list in ``workerinput``, else
    this process's view) and its thread share; returns ``{worker, var, device}``. ``probe``
    says whether a GPU backend already initialised here, which gets a config-time warning."""
    from refattn.sharding import Devices, pin_environment, visible_devices

    wid = workerinput.get("workerid")
    info = workerinput.get("refattn_devices")
    devices = Devices.from_dict(info) if info else visible_devices()
    if probe is not None and probe():
        config.issue_config_time_warning(pytest.PytestConfigWarning(
            f"refattn: a GPU backend initialised in worker {wid} before its device was pinned; "
            f"{devices.var} may not take effect"), stacklevel=2)
    dev = pin_environment(wid, devices, workers=workerinput.get("workercount"))
    return {"worker": wid, "var": devices.var if dev is not None else None, "device": dev}


def _probe(matrices):
    probes = [m.gpu_initialised for m in matrices if m.gpu_initialised is not None]
    return (lambda: any(p() for p in probes)) if probes else None


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    matrices = active_matrices(config)
    if not matrices:
        return  # inert
    for line in MARKERS:
        config.addinivalue_line("markers", line)
    workerinput = getattr(config, "workerinput", None)
    if workerinput is not None:
        config.stash[_PIN] = pin_worker(config, workerinput, _probe(matrices))
    if cli_matrix(config) is not None and not _names_matrix_module(config):
        config.args.append(str(MATRIX_TESTS))


def pytest_sessionstart(session):
    """Check ``--refattn-kernel`` / ``--refattn-suite`` before collection, so a bad one is a
    usage error (exit 4) rather than a collection error."""
    m = cli_matrix(session.config)
    if m is not None:
        _params(session.config, m)


def _gpu_kernel_selected(config) -> bool:
    from refattn.kernels import KernelError, parse_kernel_name

    for m in active_matrices(config):
        for spec in m.kernel_specs():
            try:
                entry, variant = parse_kernel_name(spec)
            except KernelError:
                continue  # reported at collection
            if entry.load().requires_gpu_for(variant):
                return True
    return False


# tryfirst: xdist's own implementation (the CPU count) is a first result too, and an entry-point
# plugin registered after this one would otherwise be asked first.
@pytest.hookimpl(optionalhook=True, tryfirst=True)
def pytest_xdist_auto_num_workers(config):
    """``-n auto``: one worker per visible GPU when a GPU kernel is selected; else None, which
    leaves xdist's default (the CPU count, or $PYTEST_XDIST_AUTO_NUM_WORKERS)."""
    if not active_matrices(config):
        return None
    from refattn.sharding import auto_num_workers

    return auto_num_workers(_gpu_kernel_selected(config), _visible_devices(config))


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """Controller: give each worker the controller's device list (the parent's view)."""
    if active_matrices(node.config):
        node.workerinput["refattn_devices"] = _visible_devices(node.config).to_dict()


def pytest_report_header(config):
    n = getattr(config.option, "numprocesses", None)
    if (getattr(config, "workerinput", None) is not None or not n or not isinstance(n, int)
            or not active_matrices(config)):
        return None
    from refattn.sharding import device_for_worker, threads_note

    d = _visible_devices(config)
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


def _pinned_device(config):
    var = config.stash.get(_PIN, {}).get("var")
    return os.environ.get(var) if var else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """With $REFATTN_RESULTS_DIR set, a skipped matrix case (kernel not available on this
    worker) is recorded too, with the reason."""
    report = yield
    results_dir = os.environ.get(RESULTS_DIR_ENV)
    if not results_dir or not (report.skipped and report.when == "setup"):
        return report
    params = _matrix_params(item)
    if params is not None:
        from refattn.sharding import append_row, skip_row

        lr = report.longrepr
        reason = str(lr[2] if isinstance(lr, tuple) and len(lr) == 3 else lr)
        reason = reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason
        append_row(results_dir, _worker_id(), skip_row(
            kernel_spec=params["refattn_kernel_spec"], case=params["refattn_case"],
            reason=reason, worker_id=_worker_id(), device=_pinned_device(item.config),
            nodeid=item.nodeid))
    return report


__all__ = ["DEFAULT_SUITES", "MARKERS", "Matrix", "PARAMS", "SLOW_FLOPS", "active_matrices",
           "cli_matrix", "hooked_matrix", "matrix_for", "matrix_params", "pin_worker"]
