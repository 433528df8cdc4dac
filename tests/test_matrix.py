"""The case matrix as pytest tests: every (kernel, case) pair, ids ``<kernel>-<case name>``.

Kernels and suites come from ``--kernel`` / ``--suite`` (tests/conftest.py); by default the
CPU model plus every registered GPU kernel over the seed, extended and contracts suites. A
supported case must pass the derived gate; an unsupported one must be declined cleanly.
"""

import pytest

from refattn.runner import run_case


def test_case(kernel, case):
    result = run_case(kernel, case)
    if not result.acceptable:
        pytest.fail(result.failure_message(), pytrace=False)
