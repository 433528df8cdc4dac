"""`refattn record`: every check a kernel's adapter unlocks, run in turn, each written as a
stamped record into one directory that `refattn report` reads.

    refattn record --kernel K [--out DIR] [--suite S ...] [--examples N] [--runs N]

writes, for the kernel K (its file names use the adapter's name):

* ``run-<name>.json``: the case matrix (``refattn run``);
* ``fuzz-<name>.json``: ``refattn fuzz`` with ``--examples`` cases;
* ``determinism-<name>.json``: ``refattn determinism`` with ``--runs`` runs, each variant;
* ``mutants-<name>.json``: the kill matrix (``refattn mutants``), only when the adapter
  declares ``mutants``; an adapter without is listed as such, not refused.

Each record carries ``kernel_spec`` and the adapter's ``kernel_source_hash``, so the report
judges it against that kernel's source as it is then (``refattn.records``). A check that
fails still writes its record and the next check still runs; the exit status is 1 when any
check failed, 2 on a usage error (before anything runs). Then
``refattn report --in DIR --update-baseline`` makes the first baseline and
``refattn report --in DIR --check`` compares every later one with it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

DEFAULT_EXAMPLES = 200


def add_arguments(p: argparse.ArgumentParser) -> None:
    from refattn.cli import _add_suite_option, _count_of

    p.add_argument("--kernel", required=True, metavar="NAME",
                   help="the kernel: a registered name or an import path package.module:Class "
                        "or path/to/file.py:Class")
    p.add_argument("--out", default="reports", metavar="DIR", help="where the records go (default: reports)")
    _add_suite_option(p, "Default: seed, extended and contracts.")
    p.add_argument("--examples", type=_count_of("example", "examples"), default=DEFAULT_EXAMPLES,
                   metavar="N", help=f"fuzz examples (default {DEFAULT_EXAMPLES})")
    p.add_argument("--runs", type=_count_of("run", "runs", minimum=2), default=3, metavar="N",
                   help="determinism runs of each case (default 3)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn record --kernel examples/numpy_kernel.py:NumpyKernel --out myreports\n"
                "  refattn report --in myreports --update-baseline\n\n"
                "exit status: 0 every check passed, 1 one failed (its record is still written), 2 usage error")


def _sub(name: str, argv: list[str]) -> int:
    """``refattn <name> argv...`` in this process, through the CLI's own parser."""
    from refattn import cli

    print(f"record: refattn {name} {' '.join(argv)}", file=sys.stderr, flush=True)
    return cli._main([name, *argv])


def run(args) -> int:
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _safe_name
    from refattn.fileio import check_output_dir
    from refattn.kernels import get_kernel, kernel_available, parse_kernel_name

    out = check_output_dir("--out", Path(args.out))
    kernel = get_kernel(args.kernel)
    ok, reason = kernel_available(kernel)
    if not ok:
        raise UsageError(f"kernel: {args.kernel!r} is not available here: {reason}")
    name = _safe_name(str(getattr(kernel, "name", args.kernel)))
    suites = [a for s in (args.suite or ["seed", "extended", "contracts"]) for a in ("--suite", s)]
    quiet = ["-q"] if args.quiet else []
    steps = [
        ("run", ["--kernel", args.kernel, *suites, "--report", str(out), *quiet]),
        ("fuzz", ["--kernel", args.kernel, "--examples", str(args.examples),
                  "--json", str(out / f"fuzz-{name}.json"), *quiet]),
        ("determinism", ["--kernel", args.kernel, *suites, "--runs", str(args.runs),
                         "--json", str(out / f"determinism-{name}.json"), *quiet]),
    ]
    if parse_kernel_name(args.kernel)[0].load().mutants:
        steps.append(("mutants", ["--kernel", args.kernel, *suites,
                                  "--json", str(out / f"mutants-{name}.json"), *quiet]))
    elif not args.quiet:
        print(f"record: {args.kernel} declares no mutants: no kill matrix", file=sys.stderr, flush=True)
    codes = {}
    for step, argv in steps:
        codes[step] = _sub(step, argv)
    failed = [s for s, c in codes.items() if c != EXIT_OK]
    print(f"record: {'FAILED: ' + ', '.join(failed) if failed else 'OK'}: "
          f"{', '.join(f'{s} {c}' for s, c in codes.items())} (exit status of each) into {out}")
    return EXIT_FAIL if failed else EXIT_OK
