"""pytest plumbing for this repository's tests; the case matrix's machinery (parametrisation,
ids, marks, the kernel fixture, pinning xdist workers to GPUs, result rows for
``refattn run --gpus``) is refattn's pytest plugin, ``refattn.pytest_plugin``, loaded through
``addopts`` in pyproject.toml. This file only says which matrix the repository's own
``tests/test_matrix.py`` runs (the ``pytest_refattn_matrix`` hook).

Options:
    --kernel NAME   kernel(s) for tests/test_matrix.py, repeatable (a registered name, a
                    name:variant, package.module:Class or path/to/file.py:Class). Default:
                    ``model`` plus every registered GPU kernel (skipped, with the reason,
                    where it cannot run).
    --suite NAME    suite(s) for the matrix, repeatable. Default: seed, extended, contracts, ragged, bf16.

Several GPUs: ``pytest -n auto --dist loadgroup`` (pytest-xdist) runs one worker per visible
GPU, each pinned to its own device before any backend initialises, and keeps every case of one
autotune key on one worker (refattn/pytest_plugin.py, refattn/sharding.py). That is early
enough: before the plugin's ``pytest_configure``, a worker has only imported pytest, its
plugins and this file (whose top level imports nothing of hipkernel or cuda); test modules are
imported at collection, after configure; and even an imported cuda-bindings reads the variable
only at cuInit, which hipkernel.backends does lazily on the first get_backend().

Matrix test ids are ``<kernel>-<case name>``, so ``-k gptoss-sink-past8192-w128`` or
``-k "model and w128"`` narrows a run. Cases of a kernel that needs a GPU carry the ``gpu``
marker (``-m "not gpu"`` deselects them). On a CPU kernel, cases above
``refattn.pytest_plugin.SLOW_FLOPS`` useful FLOPs (the four unwindowed past_len=8192 seed
cases, ~30-40 s each for the NumPy model plus the fp64 reference on a 2-core machine) carry
the ``slow`` marker.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a source tree: refattn, hipkernel, tests.helpers_kernels
    sys.path.insert(0, str(ROOT))

from refattn import pytest_plugin  # noqa: E402 - after the path, for a bare source tree

# The plugin's defaults, plus what serving runs: ragged batches and bf16.
DEFAULT_SUITES = (*pytest_plugin.DEFAULT_SUITES, "ragged", "bf16")
DEFAULT_KERNEL = "model"


def pytest_addoption(parser):
    g = parser.getgroup("refattn", "refattn case matrix")
    g.addoption("--kernel", action="append", dest="refattn_kernels", metavar="NAME", default=None,
                help="kernel for the case matrix (repeatable): reference, model, hipkernel[:cuda|:hip], "
                     "package.module:Class or path/to/file.py:Class. Default: model plus every "
                     "registered GPU kernel.")
    g.addoption("--suite", action="append", dest="refattn_suites", metavar="NAME", default=None,
                help=f"case suite for the matrix (repeatable). Default: {', '.join(DEFAULT_SUITES)}.")


def default_kernel_names() -> list[str]:
    """``model`` plus every registered kernel that needs a GPU."""
    from refattn.kernels import available_kernels

    gpu = [n for n, e in available_kernels().items() if n != DEFAULT_KERNEL and e.requires_gpu]
    return [DEFAULT_KERNEL, *gpu]


def matrix_kernel_names(config) -> list[str]:
    """--kernel values, or :func:`default_kernel_names`."""
    names = config.getoption("refattn_kernels")
    return list(dict.fromkeys(names)) if names else default_kernel_names()


def matrix_suites(config) -> list[str]:
    return list(config.getoption("refattn_suites") or DEFAULT_SUITES)


def _gpu_backend_initialised() -> bool:
    """Whether a hipkernel GPU backend exists in this process already (then a worker's device
    pin may come too late)."""
    backends = sys.modules.get("hipkernel.backends")
    return bool(backends is not None and getattr(backends, "_INSTANCES", None))


@pytest.hookimpl(optionalhook=True)
def pytest_refattn_matrix(config):
    """tests/test_matrix.py runs ``--kernel`` x ``--suite`` (kernels named on the command line
    must import; the default GPU kernels are skipped with the reason where they cannot run)."""
    names = config.getoption("refattn_kernels")
    return pytest_plugin.Matrix(
        kernels=tuple(dict.fromkeys(names)) if names else default_kernel_names,
        suites=tuple(matrix_suites(config)), kernel_option="--kernel", suite_option="--suite",
        gpu_initialised=_gpu_backend_initialised)


_PINNED: dict = {}  # the last pin made through _pin_worker


def _pin_worker(config, workerinput) -> None:
    """The plugin's worker pin (:func:`refattn.pytest_plugin.pin_worker`) with this
    repository's backend check, recorded in ``_PINNED``."""
    _PINNED.update(pytest_plugin.pin_worker(config, workerinput, _gpu_backend_initialised))


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


@pytest.fixture
def tripwire(monkeypatch):
    """Fail if the reference gets as far as computing: an invalid call must be refused before
    any work (tests/test_reference_bad_input.py, tests/test_ragged_reference.py)."""
    import refattn.reference as reference

    def _attention(*a, **kw):
        raise AssertionError("reference computed on invalid input")
    monkeypatch.setattr(reference, "_attention", _attention)
