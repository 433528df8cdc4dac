"""The case matrix as pytest tests: every (kernel, case) pair, ids ``<kernel>-<case name>``.

The test is refattn's own, :func:`refattn.matrix_tests.test_case` (the one
``pytest --refattn-kernel`` runs in any repository), parametrised by refattn.pytest_plugin
over this repository's matrix: ``--kernel`` / ``--suite`` (tests/conftest.py), by default the
CPU model plus every registered GPU kernel over the seed, extended and contracts suites. A
supported case must pass the derived gate; an unsupported one must be declined cleanly.
"""

from refattn.matrix_tests import test_case

__all__ = ["test_case"]
