"""`refattn sanitize`: compute-sanitizer's memcheck and racecheck over the case matrix of
any kernel, on tight caches, and the reading of the tool's logs.

Each tool runs ``python -m refattn run --kernel K ... --spare 0`` (every case's KV cache
exactly ``skv`` rows long, no canary rows after it), so a read past a sequence's keys leaves
the allocation, where memcheck sees it, instead of landing on a NaN canary. The log of each
tool is kept (``--logs DIR``) and read back by :func:`parse_sanitizer_summary`; a run passes
when every tool finished with a summary, no error, hazard, warning or leak, and the target
exited 0 (every case passed or was declined). ``compute-sanitizer`` must be on ``PATH`` (or
given with ``--sanitizer``); a kernel that launches nothing on a GPU gives clean logs that
check nothing, so the command refuses a kernel without ``requires_gpu`` unless ``--cpu-ok``.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SANITIZER_TOOLS = {
    # tool -> extra compute-sanitizer options. --error-exitcode makes a finding fail the run
    # even when the target itself exits 0.
    "memcheck": "--tool memcheck --leak-check full --error-exitcode 3",
    "racecheck": "--tool racecheck --error-exitcode 3",
    "initcheck": "--tool initcheck --error-exitcode 3",
    "synccheck": "--tool synccheck --error-exitcode 3",
}


_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+)\s+errors?\b")
_RACE_SUMMARY = re.compile(r"RACECHECK SUMMARY:\s*(\d+)\s+hazards?\s+displayed\s*"
                           r"\(\s*(\d+)\s+errors?,\s*(\d+)\s+warnings?\s*\)")
_LEAK_SUMMARY = re.compile(r"LEAK SUMMARY:\s*(\d+)\s+bytes?\s+leaked\s+in\s+(\d+)\s+allocations?")
_PROGRAM_HIT = re.compile(r"Program hit\s+(\S+)")
_REPORT = re.compile(r"^=+\s+((?:Invalid|Error|Uninitialized|Barrier|Race|Warning|Malloc|"
                     r"Leaked|Address|Misaligned)\b.*)$", re.M)
_TARGET_ERROR = "Target application returned an error"
# per-launch lines of a target that prints them (hipkernel.reliability's sanitize target)
_LAUNCH_OK = re.compile(r"^  ok  ", re.M)
_LAUNCH_BAD = re.compile(r"^  BAD ", re.M)
# a target that stops at its own time budget says so (hipkernel.reliability's sanitize target),
# so that the tool finishes and prints its summary over the launches it made
_BUDGET_STOP = re.compile(r"time budget of [\d.]+ s reached after (\d+) of (\d+) cases")


def parse_sanitizer_summary(text: str, tool: str | None = None) -> dict:
    """Read compute-sanitizer's output (its lines start with ``=========``).

    The final lines it documents: ``ERROR SUMMARY: N error(s)`` (memcheck, initcheck,
    synccheck), ``RACECHECK SUMMARY: N hazard(s) displayed (E error(s), W warning(s))``
    (racecheck), ``LEAK SUMMARY: B bytes leaked in A allocations`` (memcheck with
    ``--leak-check full``); and ``Target application returned an error`` when the target
    exited non-zero. Summaries of several processes are summed. ``ok`` needs at least one
    summary (a log without one means the tool or the target died), zero errors, hazards,
    warnings and leaked bytes, and no target error or ``Program hit`` API error.
    ``target_cases`` is how many of its cases a target with a time budget reached (it said
    so), else None: the summary then covers those cases' launches only."""
    errs = [int(n) for n in _ERROR_SUMMARY.findall(text)]
    races = [tuple(map(int, m)) for m in _RACE_SUMMARY.findall(text)]
    leaks = [tuple(map(int, m)) for m in _LEAK_SUMMARY.findall(text)]
    if tool is None:
        tool = "racecheck" if races else ("memcheck" if leaks else "unknown")
    hazards = sum(r[0] for r in races) if races else None
    warnings = sum(r[2] for r in races) if races else None
    errors = sum(errs) + sum(r[1] for r in races)
    leaked = sum(b for b, _ in leaks) if leaks else None
    hits = sorted(set(_PROGRAM_HIT.findall(text)))
    target_error = _TARGET_ERROR in text
    n_summaries = len(errs) + len(races)
    launches_ok = len(_LAUNCH_OK.findall(text))
    launches_bad = len(_LAUNCH_BAD.findall(text))
    traceback_seen = "Traceback (most recent call last)" in text
    budget = _BUDGET_STOP.search(text)
    problems = []
    if n_summaries == 0:
        problems.append("no ERROR/RACECHECK SUMMARY line: the tool or the target did not finish")
    if errors:
        problems.append(f"{errors} error(s)")
    if hazards:
        problems.append(f"{hazards} hazard(s)")
    if warnings:
        problems.append(f"{warnings} warning(s)")
    if leaked:
        problems.append(f"{leaked} bytes leaked")
    if target_error:
        problems.append("the target application returned an error")
    if hits:
        problems.append("API errors: " + ", ".join(hits))
    if launches_bad:
        problems.append(f"{launches_bad} launch(es) of the target judged BAD")
    if traceback_seen:
        problems.append("the target raised (a Python traceback)")
    return {
        "tool": tool, "errors": errors, "hazards": hazards, "warnings": warnings,
        "leaked_bytes": leaked, "leaked_allocations": sum(a for _, a in leaks) if leaks else None,
        "summaries": n_summaries, "target_error": target_error, "program_hits": hits,
        "first_reports": _REPORT.findall(text)[:10], "problems": problems, "ok": not problems,
        "launches_ok": launches_ok, "launches_bad": launches_bad, "traceback": traceback_seen,
        # the cases the target reached before its time budget (None: it ran them all)
        "target_cases": ({"run": int(budget.group(1)), "of": int(budget.group(2))}
                         if budget else None),
    }


def stopped_clean(parsed: dict) -> bool:
    """A sanitizer log cut short (a time limit) before its summary with nothing wrong in what
    it did print: no report, no error, no BAD launch, no target error. Such a run checked
    ``launches_ok`` launches and found nothing, but it is not a completed run."""
    return (parsed["summaries"] == 0 and parsed["launches_ok"] > 0 and not parsed["first_reports"]
            and not parsed["errors"] and not parsed["launches_bad"] and not parsed["target_error"]
            and not parsed["program_hits"] and not parsed["traceback"])


DEFAULT_TOOLS = ("memcheck", "racecheck")


def target_command(kernel: str, suites, match=(), python: str | None = None) -> list[str]:
    """The process each tool wraps: ``refattn run`` over ``suites`` on tight caches."""
    cmd = [python or sys.executable, "-m", "refattn", "run", "--kernel", kernel, "--spare", "0", "-q"]
    for s in suites:
        cmd += ["--suite", s]
    for m in match or ():
        cmd += ["-k", m]
    return cmd


def tool_command(tool: str, target: list[str], sanitizer: str = "compute-sanitizer") -> list[str]:
    if tool not in SANITIZER_TOOLS:
        raise ValueError(f"--tool: expected one of {', '.join(SANITIZER_TOOLS)}, got {tool!r}")
    return [sanitizer, *SANITIZER_TOOLS[tool].split(), *target]


def run_tool(tool: str, target: list[str], log: Path, *, sanitizer: str = "compute-sanitizer",
             timeout: float | None = None) -> dict:
    """Run one tool over ``target``, its output to ``log``; the parsed summary with the exit
    status (``rc``), the command and the time taken."""
    cmd = tool_command(tool, target, sanitizer)
    t0 = time.perf_counter()
    with open(log, "w", encoding="utf-8") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = None
    parsed = parse_sanitizer_summary(log.read_text(encoding="utf-8", errors="replace"), tool)
    if rc is None:
        parsed["problems"].append(f"stopped at the time limit of {timeout:g} s")
    elif rc != 0 and not parsed["problems"]:
        parsed["problems"].append(f"exit status {rc} (a case failed under the tool)")
    parsed["ok"] = not parsed["problems"]
    return {**parsed, "rc": rc, "command": shlex.join(cmd), "log": str(log),
            "elapsed_s": round(time.perf_counter() - t0, 3)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from refattn.cli import _add_suite_option

    p.add_argument("--kernel", required=True, metavar="NAME",
                   help="the kernel: a registered name or an import path package.module:Class")
    _add_suite_option(p, "Default: seed and extended.")
    p.add_argument("-k", dest="match", action="append", metavar="SUBSTRING",
                   help="only cases whose name contains SUBSTRING (repeatable)")
    p.add_argument("--tool", action="append", choices=sorted(SANITIZER_TOOLS), metavar="TOOL",
                   help=f"a compute-sanitizer tool (repeatable; default {' and '.join(DEFAULT_TOOLS)}; "
                        f"known: {', '.join(SANITIZER_TOOLS)})")
    p.add_argument("--logs", metavar="DIR", help="keep each tool's log in DIR (default: a temporary directory)")
    p.add_argument("--json", metavar="PATH", help="write the parsed summaries as JSON")
    p.add_argument("--sanitizer", default="compute-sanitizer", metavar="PATH",
                   help="the compute-sanitizer executable (default: compute-sanitizer on PATH)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="time limit a tool (seconds)")
    p.add_argument("--cpu-ok", action="store_true",
                   help="run even a kernel that does not declare requires_gpu")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress output")
    p.epilog = ("examples:\n  refattn sanitize --kernel hipkernel --suite seed\n"
                "  refattn sanitize --kernel mypkg.adapters:MyKernel --tool memcheck --logs sanitizer/\n\n"
                "exit status: 0 every tool clean, 1 a finding (or a tool that did not finish), 2 usage error")


def run(args) -> int:
    from refattn.cli import EXIT_FAIL, EXIT_OK, UsageError, _console, check_outputs, write_outputs
    from refattn.fileio import check_output_dir, json_text
    from refattn.kernels import get_kernel, kernel_available, kernel_source_hash

    check_outputs(args, ("json",))
    kernel = get_kernel(args.kernel)
    if not getattr(kernel, "requires_gpu", False) and not args.cpu_ok:
        raise UsageError(f"kernel: {args.kernel!r} does not declare requires_gpu: compute-sanitizer "
                         "would check no device code (--cpu-ok runs it anyway)")
    ok, reason = kernel_available(kernel)
    if not ok:
        raise UsageError(f"kernel: {args.kernel!r} is not available here: {reason}")
    if shutil.which(args.sanitizer) is None:
        raise UsageError(f"--sanitizer: {args.sanitizer!r} is not an executable on PATH")
    if args.timeout is not None and not args.timeout > 0:
        raise UsageError(f"--timeout: expected seconds > 0, got {args.timeout}")
    suites = args.suite or ["seed", "extended"]
    from refattn.cases import load_suites

    load_suites(suites)  # a bad suite is a usage error here, not a log of one
    logs = Path(args.logs) if args.logs else Path(tempfile.mkdtemp(prefix="refattn-sanitize-"))
    check_output_dir("--logs", logs)
    target = target_command(args.kernel, suites, args.match)
    env_note = "" if os.environ.get("PYTHONPATH") is None else f" (PYTHONPATH={os.environ['PYTHONPATH']})"
    results = []
    for tool in args.tool or DEFAULT_TOOLS:
        if not args.quiet:
            print(f"sanitize: {tool} over {', '.join(suites)}{env_note}, log {logs / (tool + '.log')}",
                  file=sys.stderr, flush=True)
        r = run_tool(tool, target, logs / f"{tool}.log", sanitizer=args.sanitizer, timeout=args.timeout)
        results.append(r)
        if not args.quiet:
            print(f"sanitize: {tool}: {'clean' if r['ok'] else '; '.join(r['problems'])} "
                  f"in {r['elapsed_s']:.0f} s", file=sys.stderr, flush=True)
    doc = {"schema": 1, "kind": "sanitize", "kernel": str(getattr(kernel, "name", args.kernel)),
           "kernel_spec": args.kernel, "kernel_source_hash": kernel_source_hash(kernel),
           "suites": suites, "ok": all(r["ok"] for r in results), "tools": results}
    written = write_outputs(json_text(doc), [Path(args.json)] if args.json else [], "sanitize")
    out = _console()
    for r in results:
        out.print(f"  {r['tool']}: {'clean' if r['ok'] else 'FAILED: ' + '; '.join(r['problems'])} "
                  f"({r['log']})", markup=False)
    out.print(f"{'OK' if doc['ok'] else 'FAILED'}: kernel {doc['kernel']} under "
              f"{', '.join(r['tool'] for r in results)}", markup=False)
    return EXIT_OK if doc["ok"] and written else EXIT_FAIL
