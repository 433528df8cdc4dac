"""`refattn mutants`: run the mutation kill matrix (see ``refattn.killmatrix``)."""

from __future__ import annotations

import argparse
import sys
from contextlib import ExitStack
from pathlib import Path

from refattn.cli import (EXIT_FAIL, EXIT_OK, UsageError, _add_suite_option, _console, _count_of,
                         _progress_printer, check_outputs, write_outputs)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", default="model", metavar="NAME",
                   help="a kernel whose adapter implements mutants of the catalogue (its class "
                        "attribute `mutants`, docs/adapters.md), optionally forced to one variant "
                        "with @VARIANT; default: model. A kernel that declares none is refused "
                        "(exit 2): there is nothing to switch on")
    _add_suite_option(p, "Default: seed and extended.")
    p.add_argument("--mutant", action="append", metavar="NAME",
                   help="run only this mutant (repeatable); default: the whole catalogue")
    p.add_argument("-k", dest="match", action="append", metavar="SUBSTRING",
                   help="only cases whose name contains SUBSTRING (repeatable)")
    p.add_argument("--json", metavar="PATH", help="write the kill matrix as JSON ('-' = stdout)")
    p.add_argument("-j", "--jobs", metavar="N", type=_count_of("process", "processes"), default=1,
                   help="run the clean kernel and the mutants in N processes (default 1; each "
                        "builds its own inputs and references; a GPU kernel's share one GPU)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn mutants\n  refattn mutants --jobs 2\n"
                "  refattn mutants --kernel hipkernel --json reports/gpu/mutants.json\n"
                "  refattn mutants --mutant no_nan_guard -k w128\n\n"
                "exit status: 0 clean kernel passes and every mutant is killed, 1 otherwise, 2 usage "
                "error or a kernel that implements no mutants")


def run(args) -> int:
    from refattn.cases import load_suites
    from refattn.kernels import get_kernel, kernel_available, parse_kernel_name
    from refattn.killmatrix import KernelByName, format_grid, run_kill_matrix
    from refattn.mutants import by_name

    check_outputs(args, ("json",))
    for name in args.mutant or []:
        try:
            by_name(name)
        except ValueError as e:
            raise UsageError(str(e)) from None
    entry = parse_kernel_name(args.kernel)[0].load()
    if not entry.importable:
        raise UsageError(f"kernel: {args.kernel!r} is unavailable: {entry.error}")
    declared = entry.mutants
    if not declared:
        raise UsageError(f"kernel: {args.kernel!r} declares no mutants: the kill matrix switches on "
                         "the catalogue mutants an adapter implements, listed in its class attribute "
                         "`mutants` (docs/adapters.md)")
    missing = sorted(set(args.mutant or ()) - declared)
    if missing:
        raise UsageError(f"--mutant: {args.kernel!r} does not implement {', '.join(missing)} "
                         f"(it implements {', '.join(sorted(declared))})")
    names = sorted(set(args.mutant) if args.mutant else declared)
    probe = get_kernel(args.kernel)
    ok, reason = kernel_available(probe)
    if not ok:
        raise UsageError(f"kernel: {args.kernel!r} is not available here: {reason}")
    cases = load_suites(args.suite or ["seed", "extended"])
    if args.match:
        cases = [c for c in cases if any(s in c.name for s in args.match)]
        if not cases:
            raise UsageError(f"-k: no case name contains {' or '.join(map(repr, args.match))}")

    n_mut = len(names)
    done = {"kernels": 0}

    def make_kernel(mutants):
        done["kernels"] += 1
        if not args.quiet:
            label = ", ".join(sorted(mutants)) or "clean kernel"
            print(f"[{done['kernels']}/{n_mut + 1}] {label}", file=sys.stderr, flush=True)
        return get_kernel(args.kernel, mutants=mutants)

    def kernel_done(i, n, mutants):
        if not args.quiet:
            label = ", ".join(sorted(mutants)) or "clean kernel"
            print(f"[{i}/{n}] done: {label}", file=sys.stderr, flush=True)

    if args.jobs > 1:  # processes: the kernel is rebuilt there by name; a line as each ends
        if not args.quiet:
            print(f"{n_mut + 1} kernels over {len(cases)} cases in {args.jobs} processes",
                  file=sys.stderr, flush=True)
        km = run_kill_matrix(KernelByName(args.kernel), cases, names=names,
                             jobs=args.jobs, on_kernel_done=kernel_done)
    else:
        with ExitStack() as stack:
            progress = None if args.quiet else _progress_printer(stack)
            km = run_kill_matrix(make_kernel, cases, names=names, progress=progress)

    from refattn.fileio import json_text

    from refattn.kernels import kernel_source_hash

    doc = {**km.to_json(), "kernel_spec": args.kernel.split("@", 1)[0],
           "kernel_source_hash": kernel_source_hash(probe)}
    text = json_text(doc)
    written = write_outputs(text, [Path(args.json)] if args.json and args.json != "-" else [],
                            "mutants")
    out = _console(stderr=args.json == "-")
    out.print(format_grid(km), markup=False, highlight=False)
    survivors = [m.name for m in km.mutants if not m.killed and m.must_kill]
    equivalent = [m.name for m in km.mutants if not m.killed and not m.must_kill]
    seed_blind = [m.name for m in km.mutants if m.killed and not m.killed_by_seed_gate]
    n_killed = sum(m.killed for m in km.mutants)
    out.print(f"{'OK' if km.ok else 'FAILED'}: {n_killed}/{len(km.mutants)} "
              f"mutants killed over {len(cases)} cases; clean kernel "
              f"{'passes' if km.clean_ok else 'fails'}"
              + (f"; surviving: {', '.join(survivors)}" if survivors else "")
              + (f"; equivalent at fp16 output (not observable): {', '.join(equivalent)}" if equivalent else "")
              + (f"; the seed gate alone misses: {', '.join(seed_blind)}" if seed_blind else ""),
              markup=False)
    if args.json == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    return EXIT_OK if km.ok and written else EXIT_FAIL
