"""The ``refattn`` command line: list the case matrix, run a kernel over it, and (plugged in
by their own modules) the mutant kill matrix, reports and benchmarks.

Exit codes: 0 everything acceptable; 1 a case failed (fail, contract-violation, error);
2 a usage error, a bad case file, or an unknown or unavailable kernel (one clear line on
stderr, no traceback).

Subcommands are a table (:data:`SUBCOMMANDS`), name -> :class:`Subcommand`. ``cases``,
``kernels`` and ``run`` live here; ``mutants``, ``report`` and ``bench`` are imported lazily
from the modules named in the table, each of which provides ``add_arguments(parser)`` and
``run(args) -> int``. Only the module of the subcommand being run is imported; when it is
missing the subcommand says ``not available: <reason>`` and exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

EXIT_OK, EXIT_FAIL, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A user error reported as one line and exit status 2."""


@dataclass
class Subcommand:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None
    run: Callable[[argparse.Namespace], int] | None = None
    module: str | None = None  # lazy: a module with add_arguments(parser) and run(args) -> int
    description: str = ""
    epilog: str = ""

    def resolve(self) -> tuple[Callable, Callable]:
        """(add_arguments, run), importing ``module`` if needed; raises UsageError if it can't."""
        if self.run is not None:
            return self.add_arguments or (lambda p: None), self.run
        try:
            mod = importlib.import_module(self.module)
        except Exception as e:  # noqa: BLE001 - reported as "not available"
            raise UsageError(f"not available: cannot import {self.module}: {type(e).__name__}: {e}") from None
        run = getattr(mod, "run", None)
        if not callable(run):
            raise UsageError(f"not available: {self.module} has no run(args) function")
        return getattr(mod, "add_arguments", lambda p: None), run


# --------------------------------------------------------------------------- output helpers

def _console(stderr: bool = False):
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would exit(1) here; the command line ends a closed pipe in one place (main)
            self.quiet = True
            raise BrokenPipeError(32, "Broken pipe")

    stream = sys.stderr if stderr else sys.stdout
    terminal = stream.isatty()
    return _Console(file=stream, width=None if terminal else 200, highlight=False,
                    no_color=not terminal)


_STYLE = {"pass": "green", "declined": "cyan", "fail": "bold red",
          "contract-violation": "bold magenta", "error": "bold red"}


def _e(x) -> str:
    return "-" if x is None else f"{x:.2e}"


def _safe_name(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._+-]", "_", name)


def check_outputs(args, file_options=("json",), dir_options=()) -> None:
    """Check the output paths among ``args`` before any work: a path that cannot be written
    is a usage error naming its option (exit 2), not a traceback once the work is done.
    A missing parent directory is created now."""
    from refattn.fileio import check_output_dir, check_output_file

    for opt in file_options:
        value = getattr(args, opt, None)
        if value:
            setattr(args, opt, str(check_output_file(f"--{opt}", value)))
    for opt in dir_options:
        value = getattr(args, opt, None)
        if value:
            setattr(args, opt, str(check_output_dir(f"--{opt}", value)))


def write_outputs(text: str, paths: list[Path], command: str) -> bool:
    """Write ``text`` atomically to each of ``paths``. A path that fails even so (the disk
    filled, a directory was removed meanwhile) is reported in one line on stderr and the
    text is kept in a temporary file whose name is printed, so a finished run is never lost.
    Returns whether every path was written."""
    import tempfile

    from refattn.fileio import atomic_write_text

    ok = True
    for path in paths:
        try:
            atomic_write_text(path, text)
        except OSError as e:
            fd, keep = tempfile.mkstemp(prefix=f"refattn-{command}-", suffix=".json")
            with open(fd, "w", encoding="utf-8") as f:
                f.write(text)
            print(f"refattn {command}: error: cannot write {path}: {e.strerror or e}; "
                  f"the results are in {keep}", file=sys.stderr)
            ok = False
    return ok


# --------------------------------------------------------------------------- cases

def _add_suite_option(p: argparse.ArgumentParser, default_help: str) -> None:
    p.add_argument("--suite", action="extend", nargs="+", metavar="NAME",
                   help=f"suite name (cases/NAME.toml) or path to a .toml file; several may follow "
                        f"one --suite, and --suite may repeat. {default_help}")


def _cases_args(p: argparse.ArgumentParser) -> None:
    _add_suite_option(p, "Default: every suite.")
    p.add_argument("--json", action="store_true", help="print the cases as JSON instead of a table")
    p.add_argument("--coverage", action="store_true",
                   help="print the coverage table (refattn.coverage): per axis value and per "
                        "interacting pair, the cases that hit it; unhit required cells are marked "
                        "UNHIT. Exit 1 when a suite that declares complete = true leaves one unhit")
    p.add_argument("--per-case", action="store_true",
                   help="with --coverage: the cells each case hits, and each suite's unhit cells")
    p.add_argument("--q-tiles", type=_tile_list, default=None, metavar="T,T,...",
                   help="with --coverage: query-row tile sizes the Sq axis is relative to "
                        "(default 16,32,64,128)")
    p.add_argument("--kv-tiles", type=_tile_list, default=None, metavar="T,T,...",
                   help="with --coverage: key tile sizes the skv and window axes are relative to "
                        "(default 16,32,64,128)")
    p.add_argument("--tiles-of", default=None, metavar="KERNEL",
                   help="with --coverage: the tile sizes KERNEL's adapter reports (tile_sizes()), "
                        "for the Sq, skv and window axes; --q-tiles / --kv-tiles override")
    p.add_argument("--limit", type=_count_of("name", "names"), default=4, metavar="N",
                   help="with --coverage: case names shown per cell (default 4; --json lists all)")


def _tile_list(text: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected tile sizes like 16,32,64, got {text!r}") from None
    if not vals or any(t < 2 for t in vals):
        raise argparse.ArgumentTypeError(f"expected tile sizes >= 2, got {text!r}")
    return vals


def _cases_run(args) -> int:
    from refattn.cases import cases_dir, list_suites, load_suites, suite_description

    names = args.suite or list_suites()
    if not names:
        raise UsageError(f"no case files in {cases_dir()}")
    if args.per_case and not args.coverage:
        raise UsageError("--per-case: needs --coverage")
    cases = load_suites(names)
    if args.coverage:
        return _cases_coverage(args, names, cases)
    if args.json:
        doc = {"schema": 1, "cases_dir": str(cases_dir()),
               "suites": {n: suite_description(n) for n in dict.fromkeys(names)},
               "cases": [c.to_dict() for c in cases]}
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table(title=f"{len(cases)} cases from {', '.join(dict.fromkeys(names))}")
    for col in ("suite", "case", "geometry", "seed contract", "why"):
        t.add_column(col, overflow="fold")
    for c in cases:
        t.add_row(c.suite, c.name, c.describe(), c.seed_contract or "", c.why)
    _console().print(t)
    return EXIT_OK


def _cases_coverage(args, names, cases) -> int:
    """``refattn cases --coverage``: the coverage table of ``cases``, and per suite whether
    it hits every required cell (exit 1 when one that declares ``complete`` does not)."""
    from refattn.cases import load_suite, suite_complete
    from refattn.coverage import DEFAULT_TILES, coverage, table_rows

    own_tiles = DEFAULT_TILES
    if args.tiles_of:
        from refattn.kernels import kernel_tile_sizes, parse_kernel_name

        entry = parse_kernel_name(args.tiles_of)[0].load()
        if entry.factory is None:
            raise UsageError(f"--tiles-of: kernel {args.tiles_of!r}: {entry.error}")
        own_tiles = kernel_tile_sizes(entry.factory)
        if own_tiles is None:
            raise UsageError(f"--tiles-of: the adapter of {args.tiles_of!r} has no tile_sizes()")
    tiles = {"q": args.q_tiles or own_tiles["q"], "kv": args.kv_tiles or own_tiles["kv"]}
    cov = coverage(cases, tiles)
    suites = {}
    for n in dict.fromkeys(names):
        own = load_suite(n)
        suites[own[0].suite if own else str(n)] = {
            "complete_declared": suite_complete(n), "n_cases": len(own),
            "unhit_required": coverage(own, tiles).unhit_required()}
    broken = [s for s, v in suites.items() if v["complete_declared"] and v["unhit_required"]]
    if args.json:
        doc = {"schema": 1, "suites": suites, "coverage": cov.to_json()}
        if args.per_case:
            doc["per_case"] = cov.per_case
        print(json.dumps(doc, indent=2))
        return EXIT_FAIL if broken else EXIT_OK
    from rich.table import Table

    out = _console()
    unhit = cov.unhit_required()
    t = Table(title=f"coverage of {len(cases)} cases from {', '.join(dict.fromkeys(names))} "
                    f"(q tiles {','.join(map(str, tiles['q']))}; kv tiles "
                    f"{','.join(map(str, tiles['kv']))}): "
                    + (f"{len(unhit)} required cells UNHIT" if unhit
                       else "every required cell hit"))
    for col in ("axis", "value", "", "cases", "names"):
        t.add_column(col, overflow="fold")
    for axis, value, mark, count, who in table_rows(cov, args.limit):
        style = "bold red" if mark == "UNHIT" else None
        t.add_row(axis, value, mark, count, who, style=style)
    out.print(t)
    if args.per_case:
        pc = Table(title="cells per case")
        for col in ("case", "cells"):
            pc.add_column(col, overflow="fold")
        for cid, cells in cov.per_case.items():
            pc.add_row(cid, "; ".join(f"{k}={','.join(v)}" for k, v in cells.items() if v))
        out.print(pc)
    for s, v in suites.items():
        claim = " (declares complete = true)" if v["complete_declared"] else ""
        state = "every required cell hit"
        if v["unhit_required"]:
            state = (f"{len(v['unhit_required'])} required cells unhit: "
                     + ", ".join(v["unhit_required"]))
        if args.per_case or v["complete_declared"]:
            out.print(f"suite {s}{claim}: {state}", markup=False, highlight=False)
    if unhit:
        out.print("UNHIT required cells: " + ", ".join(unhit), markup=False, highlight=False)
    for s in broken:
        print(f"refattn cases: suite {s} declares complete = true but leaves required cells unhit",
              file=sys.stderr)
    return EXIT_FAIL if broken else EXIT_OK


# --------------------------------------------------------------------------- kernels

def _kernels_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _kernels_run(args) -> int:
    from refattn.kernels import KernelError, available_kernels, best_kernel, kernel_available

    rows = []
    for name, entry in available_kernels().items():
        ok, reason = False, entry.error or ""
        if entry.importable:
            try:
                ok, reason = kernel_available(entry())
            except KernelError as e:
                reason = str(e)
            except Exception as e:  # noqa: BLE001
                reason = f"{type(e).__name__}: {e}"
        rows.append({"name": name, "target": entry.target, "origin": entry.origin,
                     "gpu": entry.requires_gpu, "available": ok, "reason": reason})
    best, why = best_kernel()
    if args.json:
        print(json.dumps({"schema": 1, "best": best, "best_why": why, "kernels": rows}, indent=2))
        return EXIT_OK
    from rich.table import Table

    t = Table(title=f"kernels (default for `refattn run`: {best}, {why})")
    for col in ("name", "target", "origin", "gpu", "available", "reason"):
        t.add_column(col, overflow="fold")
    for r in rows:
        t.add_row(r["name"], r["target"], r["origin"], "yes" if r["gpu"] else "",
                  "[green]yes[/]" if r["available"] else "[red]no[/]", r["reason"])
    _console().print(t)
    return EXIT_OK


# --------------------------------------------------------------------------- run

def _run_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernel", metavar="NAME",
                   help="kernel to run: a registered name (reference, model, hipkernel), optionally "
                        "with a variant (hipkernel:cuda), or an import path package.module:Class; "
                        "model and hipkernel take @CONFIG, one tile config for every case "
                        "(hipkernel:hip@wmma_m4_b64). "
                        "Default: hipkernel when a GPU backend works, else model.")
    _add_suite_option(p, "Default: seed (none when --case is given).")
    p.add_argument("--case", action="append", metavar="'KEY = VALUE, ...'",
                   help="one case given inline, as the body of a TOML inline table (the keys of a "
                        "case file; name and why may be left out): 'Hq = 8, Hkv = 2, d = 64, sq = 3, "
                        "past_len = 5, window = 2, sink = \"per_head\"' (repeatable)")
    p.add_argument("-k", dest="match", action="append", metavar="SUBSTRING",
                   help="only cases whose name contains SUBSTRING (repeatable: any of them)")
    p.add_argument("--spare", type=_count_of("row", "rows", minimum=0), default=None, metavar="ROWS",
                   help="rows of NaN canaries after every case's cache (0: a tight cache, where a "
                        "read past the keys leaves the allocation; what refattn sanitize uses); "
                        "default: each case's own")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH ('-' = stdout; "
                   "the table then goes to stderr)")
    p.add_argument("--report", metavar="DIR", help="write DIR/run-<kernel>.json")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.add_argument("--gpus", metavar="N", type=_gpu_count, default=1,
                   help="spread the cases over N GPUs: runs `pytest -n N --dist loadgroup` on the "
                        "matrix test shipped in refattn (refattn/matrix_tests.py, through "
                        "refattn.pytest_plugin; needs pytest-xdist), one worker pinned to each "
                        "visible device, every autotune key on one worker; the results are merged "
                        "into the same table and JSON. Default 1: in-process")


def _count_of(one: str, many: str, minimum: int = 1) -> Callable[[str], int]:
    """An argparse ``type``: a whole number >= ``minimum`` of ``one`` / ``many`` (the error
    says which)."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number of {many}, got {text!r}") from None
        if n < minimum:
            least = f"1 {one}" if minimum == 1 else f"{minimum} {many}"
            raise argparse.ArgumentTypeError(f"expected at least {least}, got {n}")
        return n
    return parse


_gpu_count = _count_of("GPU", "GPUs")


def _progress_printer(stack):
    """A ``progress(i, n, case, result)`` callback: a rich bar on a TTY, plain lines otherwise."""
    if sys.stderr.isatty():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                       TimeElapsedColumn(), console=_console(stderr=True), transient=True)
        stack.enter_context(bar)
        task = None

        def progress(i, n, case, result):
            nonlocal task
            if task is None:
                task = bar.add_task("", total=n)
            if result is None:
                bar.update(task, description=case.name)
            else:
                bar.update(task, advance=1)
        return progress

    def plain(i, n, case, result):
        if result is not None:
            rel = f"relL2 {result.rel_l2:.2e}" if result.rel_l2 is not None else result.note
            t = f"{result.time_s:.2f} s" if result.time_s is not None else "-"
            print(f"[{i + 1:>{len(str(n))}}/{n}] {result.outcome:<18} {case.name}  {rel}  ({t})",
                  file=sys.stderr, flush=True)
    return plain


def _results_table(m):
    from rich.table import Table

    t = Table(title=f"kernel {m.kernel}: {', '.join(m.suites)}")
    t.add_column("case", overflow="fold")
    t.add_column("outcome")
    t.add_column("relL2", justify="right")
    t.add_column("max-abs @ (b,h,row,col)")
    t.add_column("gate relL2 / max-abs", justify="right")
    t.add_column("seed gate")
    t.add_column("time", justify="right")
    for r in m.results:
        at = "" if r.max_abs_at is None else " @ (" + ",".join(map(str, r.max_abs_at)) + ")"
        if r.n_nan or r.n_inf:
            maxabs = f"{r.n_nan} NaN, {r.n_inf} Inf"
        else:
            maxabs = "-" if r.max_abs is None else f"{r.max_abs:.2e}{at}"
        gate = "-" if r.gate is None else f"{_e(r.gate)} / {_e(r.gate_max_abs)}"
        seed = "-" if r.seed_gate_pass is None else ("pass" if r.seed_gate_pass else "fail")
        tm = "-" if r.time_s is None else f"{r.time_s:.3f} s"
        t.add_row(r.case, f"[{_STYLE.get(r.outcome, '')}]{r.outcome}[/]", _e(r.rel_l2), maxabs,
                  gate, seed, tm)
    return t


def _run_sharded(args, name: str, cases, progress):
    """``--gpus N``: the cases through ``pytest -n N --dist loadgroup`` (refattn.sharding)."""
    from refattn.sharding import ShardError, run_sharded, visible_devices

    devices = visible_devices()
    if not args.quiet:
        print(f"refattn run: {len(cases)} cases on {args.gpus} pytest-xdist workers; "
              f"{len(devices)} device(s) visible ({devices.source})"
              + ("; workers will share devices" if 0 < len(devices) < args.gpus else ""),
              file=sys.stderr, flush=True)
    try:
        return run_sharded(name, args.suite or ["seed"], cases, args.gpus, progress=progress)
    except ShardError as e:
        raise UsageError(str(e)) from None


def _inline_cases(texts) -> list:
    """The ``--case`` cases, named ``inline`` (``inline-2``, ... when there are several)."""
    from refattn.cases import CaseError, case_from_text

    texts = texts or []
    out = []
    for i, text in enumerate(texts, 1):
        try:
            out.append(case_from_text(text, name="inline" if len(texts) == 1 else f"inline-{i}"))
        except CaseError as e:
            raise UsageError(f"--case: {e}") from None
    return out


def _run_run(args) -> int:
    from contextlib import ExitStack

    from refattn.cases import load_suites
    from refattn.kernels import (best_kernel, get_kernel, kernel_available, kernel_facts,
                                 kernel_source_hash)
    from refattn.runner import run_matrix

    check_outputs(args, ("json",), ("report",))
    sharded = getattr(args, "gpus", 1) > 1
    name, why = (args.kernel, f"{args.kernel}, named by --kernel") if args.kernel else best_kernel()
    kernel = get_kernel(name)
    if not args.quiet:
        print(f"run: kernel {getattr(kernel, 'name', name)} ({why})", file=sys.stderr, flush=True)
    if not sharded:  # sharded: each worker checks on its own pinned device (skips -> exit 2)
        ok, reason = kernel_available(kernel)
        if not ok:
            raise UsageError(f"kernel: {name!r} is not available here: {reason}")
    cases = load_suites(args.suite or ([] if args.case else ["seed"])) + _inline_cases(args.case)
    if args.match:
        cases = [c for c in cases if any(s in c.name for s in args.match)]
        if not cases:
            raise UsageError(f"-k: no case name contains {' or '.join(map(repr, args.match))}")
    if args.spare is not None:
        from dataclasses import replace

        cases = [replace(c, spare=args.spare) for c in cases]

    with ExitStack() as stack:
        progress = None if args.quiet else _progress_printer(stack)
        if sharded:
            m = _run_sharded(args, name, cases, progress)
        else:
            m = run_matrix(kernel, cases, progress=progress)
    m.kernel_spec = name
    m.kernel_source_hash = kernel_source_hash(kernel)
    m.kernel_facts = kernel_facts(kernel)

    from refattn.fileio import json_text

    text = json_text(m.to_json())
    # The files first: a closed pipe or a console error while printing loses nothing.
    paths = [Path(args.json)] if args.json and args.json != "-" else []
    if args.report:
        paths.append(Path(args.report) / f"run-{_safe_name(m.kernel)}.json")
    written = write_outputs(text, paths, "run")
    out = _console(stderr=args.json == "-")
    out.print(_results_table(m))
    c = m.counts()
    line = ", ".join(f"{n} {o}" for o, n in c.items() if n)
    out.print(f"{'OK' if m.ok else 'FAILED'}: kernel {m.kernel}, {len(m.results)} cases: {line} "
              f"in {m.elapsed_s:.1f} s")
    from rich.text import Text

    for r in m.failures():
        out.print(Text("\n" + r.failure_message(), style="bold"))  # no markup: messages hold brackets
    if args.json == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    return EXIT_OK if m.ok and written else EXIT_FAIL


# --------------------------------------------------------------------------- the table

SUBCOMMANDS: dict[str, Subcommand] = {
    "cases": Subcommand(
        "list the case matrix", _cases_args, _cases_run,
        description="List the cases of one or more suites, with the bug each exists to catch.",
        epilog="examples:\n  refattn cases\n  refattn cases --suite seed --json"),
    "kernels": Subcommand(
        "list the registered kernels and whether they can run here", _kernels_args, _kernels_run,
        description="List the kernel adapters (entry-point group refattn.kernels; from a source "
                    "tree, the entry points of its pyproject.toml) and whether each can run here."),
    "run": Subcommand(
        "run a kernel over the case matrix", _run_args, _run_run,
        description="Run a kernel over the cases of one or more suites and judge every output "
                    "against the fp64 reference under the derived gate (docs/semantics.md, Tolerance model).",
        epilog="examples:\n"
               "  refattn run                                   # best kernel, seed suite\n"
               "  refattn run --kernel model --suite seed --suite extended\n"
               "  refattn run --kernel reference -k past8192 --json -\n"
               "  refattn run --kernel hipkernel:cuda --report reports/gpu\n"
               "  refattn run --kernel hipkernel:hip@wmma_m4_b64 --suite seed extended  # one config forced\n"
               "  refattn run --kernel hipkernel --suite seed extended --gpus 2  # one worker per GPU\n"
               "  refattn run --kernel mypkg.adapters:MyKernel   # any adapter class by import path\n"
               "  refattn run --kernel model --case 'Hq = 8, Hkv = 2, d = 64, sq = 3, window = 2'\n"
               "\nexit status: 0 all pass/declined, 1 a failure, 2 usage / case-file / kernel error"),
    "fuzz": Subcommand("random cases within a kernel's contract, a failure shrunk to a minimal case",
                       module="refattn.fuzz"),
    "determinism": Subcommand("run cases repeatedly and check that the outputs are bitwise identical",
                              module="refattn.determinism"),
    "sanitize": Subcommand("compute-sanitizer memcheck and racecheck over the case matrix",
                           module="refattn.sanitize"),
    "mutants": Subcommand("run the mutant kill matrix", module="refattn.mutants_cli"),
    "record": Subcommand("every check a kernel unlocks, each written as a stamped record for the report",
                         module="refattn.record"),
    "report": Subcommand("write the JSON + Markdown report", module="refattn.report"),
    "implementations": Subcommand("render the table of which implementation holds which feature, from run records",
                                  module="refattn.implementations"),
    # torch and the GPU runtimes are imported only when the benchmark runs
    "bench": Subcommand("benchmark a kernel against peers", module="refattn.bench"),
}


def _chosen(argv: list[str]) -> str | None:
    for tok in argv:
        if not tok.startswith("-"):
            return tok
    return None


def build_parser(chosen: str | None = None) -> argparse.ArgumentParser:
    """The parser. Only the ``chosen`` subcommand's lazy module is imported (for its arguments)."""
    from refattn import __version__

    parser = argparse.ArgumentParser(
        prog="refattn",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Numerical verification harness for fused GQA flash-attention prefill kernels: "
                    "sinks, smooth softmax, sliding windows, chunked prefill.",
        epilog="examples:\n"
               "  refattn cases --suite seed\n"
               "  refattn run --kernel model --suite seed\n"
               "  refattn run --kernel reference -k gptoss-sink --json -\n"
               "  refattn <command> --help\n"
               "\ncase files: cases/*.toml, or the directory in $REFATTN_CASES_DIR",
    )
    parser.add_argument("--version", action="version", version=f"refattn {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="command")
    sub.required = True
    for name, sc in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=sc.help, description=sc.description or sc.help, epilog=sc.epilog,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        if name == chosen:
            add_arguments, run = sc.resolve()
            add_arguments(p)
            p.set_defaults(_run=run)
    return parser


EXIT_BROKEN_PIPE = 128 + 13  # what a shell reports for a command ended by SIGPIPE


def _quiet_broken_pipe() -> int:
    """The reader of standard output went away (``refattn cases | head -1``): point stdout
    at /dev/null so the interpreter's final flush cannot raise again, and end quietly."""
    import os

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError, AttributeError):
        pass
    return EXIT_BROKEN_PIPE


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``refattn`` console script. Returns the exit status."""
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, not at exit, where a closed pipe would print a warning
        return code
    except BrokenPipeError:
        return _quiet_broken_pipe()


def _main(argv: list[str] | None) -> int:
    from refattn.args import EnvVarError, check_environment
    from refattn.cases import CaseError
    from refattn.fileio import OutputPathError
    from refattn.kernels import KernelError

    argv = list(sys.argv[1:] if argv is None else argv)
    chosen = _chosen(argv)
    if chosen not in SUBCOMMANDS:
        chosen = None  # let argparse report the bad choice
    try:
        parser = build_parser(chosen)
    except UsageError as e:
        print(f"refattn {chosen}: {e}", file=sys.stderr)
        return EXIT_USAGE
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        check_environment()
        return int(args._run(args))
    except (UsageError, CaseError, KernelError, EnvVarError, OutputPathError) as e:
        print(f"refattn {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("refattn: interrupted", file=sys.stderr)
        return 130
