"""The case matrix as one pytest test, shipped in the package (refattn.pytest_plugin).

``pytest --refattn-kernel SPEC`` collects this module; the plugin parametrises
:func:`test_case` over every (kernel, case), ids ``<kernel>-<case name>``. A supported case
must pass its derived gate; an unsupported one must be declined cleanly. A repository's own
matrix test module may import :func:`test_case` to run the same test over its own matrix
(a ``pytest_refattn_matrix`` hook). ``refattn run --gpus N`` runs this module under
pytest-xdist.
"""

import pytest

from refattn.runner import run_case


def test_case(refattn_kernel, refattn_case, refattn_record):
    result = run_case(refattn_kernel, refattn_case)
    refattn_record(result)
    if not result.acceptable:
        pytest.fail(result.failure_message(), pytrace=False)
