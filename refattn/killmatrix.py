"""The mutation kill matrix: proof that the case matrix catches classic kernel bugs.

For a kernel family that can switch the mutants of ``refattn.mutants`` on (the CPU model and
the HIP kernel both can), run the clean kernel — it must pass every case — and then each
mutant over the same cases. A mutant is *killed* when at least one case fails under the
derived gate (or errors, or produces non-finite output). Next to it we record which cases
would have killed it under the seed harness's fixed gate (relL2 <= 0.01) alone, which is the
argument for the derived gate.

The fp64 reference and the inputs of each case are built once a process (the runner caches
them), so the cost is one kernel run per (mutant, case); ``jobs`` spreads the kernels over
processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

from refattn.mutants import MUTANTS
from refattn.runner import run_matrix

_BAD = ("fail", "error", "contract-violation")


@dataclass
class MutantResult:
    name: str
    breaks: str
    killed: bool
    killed_by: list[str] = field(default_factory=list)
    killed_by_seed_gate: list[str] = field(default_factory=list)
    equivalent: str | None = None  # why no fp16 output can show this bug (catalogue)

    @property
    def must_kill(self) -> bool:
        return self.equivalent is None

    def to_dict(self) -> dict:
        return {"name": self.name, "breaks": self.breaks, "killed": self.killed,
                "killed_by": self.killed_by, "killed_by_seed_gate": self.killed_by_seed_gate,
                "equivalent": self.equivalent}


@dataclass
class KillMatrix:
    kernel: str
    cases: list[str]
    clean_ok: bool
    clean_failures: list[str]
    mutants: list[MutantResult]

    @property
    def ok(self) -> bool:
        """The clean kernel passes and every mutant that can be observed is killed."""
        return self.clean_ok and all(m.killed for m in self.mutants if m.must_kill)

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "clean_ok": self.clean_ok,
                "clean_failures": self.clean_failures, "cases": self.cases, "ok": self.ok,
                "mutants": [m.to_dict() for m in self.mutants]}


def _seed_gate_kills(r) -> bool:
    """Would the seed harness (relL2 <= 0.01, NaN fails) have flagged this result?"""
    if r.outcome in ("error", "contract-violation"):
        return True
    return r.outcome == "fail" and not r.seed_gate_pass


@dataclass(frozen=True)
class KernelByName:
    """A ``make_kernel`` that pickles (what ``run_kill_matrix(..., jobs > 1)`` needs): the
    registry's kernel ``spec`` with the given mutants switched on."""

    spec: str

    def __call__(self, mutants: frozenset):
        from refattn.kernels import get_kernel

        return get_kernel(self.spec, mutants=mutants)


def in_processes(fn, items, jobs: int, done) -> None:
    """``done(item, fn(item))`` for each of ``items``, ``fn`` run in ``jobs`` spawned
    processes (``fn`` and the items must pickle), called in finishing order."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor, as_completed

    items = list(items)
    with ProcessPoolExecutor(min(jobs, len(items)),
                             mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = {pool.submit(fn, item): item for item in items}
        for f in as_completed(futures):
            done(futures[f], f.result())


@dataclass
class _Run:
    """One kernel over the cases, as much as the kill matrix keeps of it."""

    kernel: str
    bad: list[str]  # cases failed, errored or in contract violation
    not_acceptable: list[str]  # cases neither passed nor declined (none: the kernel is ok)
    seed_gate_kills: list[str]


def _judge(make_kernel, cases, mutants: frozenset, progress=None) -> _Run:
    res = run_matrix(make_kernel(mutants), cases, progress=progress)
    return _Run(kernel=res.kernel,
                bad=[r.case for r in res.results if r.outcome in _BAD],
                not_acceptable=[r.case for r in res.results if r.outcome not in ("pass", "declined")],
                seed_gate_kills=[r.case for r in res.results if _seed_gate_kills(r)])


def run_kill_matrix(make_kernel, cases, names=None, progress=None, *, jobs: int = 1,
                    on_kernel_done=None) -> KillMatrix:
    """``make_kernel(mutants: frozenset) -> adapter``; ``cases``: loaded cases;
    ``names``: mutant names to run (default: the whole catalogue).

    ``jobs > 1`` runs the clean kernel and the mutants in that many processes (``make_kernel``
    must pickle: :class:`KernelByName`); each process builds its own inputs and references.
    ``progress`` (per case) is for ``jobs == 1``; ``on_kernel_done(i, n, mutants)`` is called
    as each of the n kernels finishes, in finishing order."""
    if not (isinstance(jobs, int) and jobs >= 1):
        raise ValueError(f"jobs: expected an int >= 1, got {jobs!r}")
    chosen = [m for m in MUTANTS if names is None or m.name in names]
    sets = [frozenset()] + [frozenset({m.name}) for m in chosen]
    runs: dict[frozenset, _Run] = {}

    def done(mutants, run):
        runs[mutants] = run
        if on_kernel_done is not None:
            on_kernel_done(len(runs), len(sets), mutants)

    cases = list(cases)
    if jobs == 1:
        for mutants in sets:
            done(mutants, _judge(make_kernel, cases, mutants, progress))
    else:
        in_processes(partial(_judge, make_kernel, cases), sets, jobs, done)
    clean = runs[sets[0]]
    results = [MutantResult(name=m.name, breaks=m.breaks, killed=bool(runs[s].bad),
                            killed_by=runs[s].bad, killed_by_seed_gate=runs[s].seed_gate_kills,
                            equivalent=m.equivalent)
               for m, s in zip(chosen, sets[1:])]
    return KillMatrix(kernel=clean.kernel, cases=[c.name for c in cases],
                      clean_ok=not clean.not_acceptable, clean_failures=clean.not_acceptable,
                      mutants=results)


def format_grid(km: KillMatrix, width: int = 4) -> str:
    """Plain-text grid: mutant, killed?, #cases and first killers under each gate."""
    rows = [f"kill matrix for {km.kernel}: clean kernel {'passes' if km.clean_ok else 'FAILS ' + ', '.join(km.clean_failures)}",
            f"{'mutant':24} {'derived gate':14} {'seed gate':11} killed by (derived gate)"]
    for m in km.mutants:
        verdict = "killed" if m.killed else ("equivalent" if m.equivalent else "SURVIVES")
        d = f"{verdict} {len(m.killed_by):>3}"
        s = f"{'killed' if m.killed_by_seed_gate else 'survives'} {len(m.killed_by_seed_gate):>2}"
        first = ", ".join(m.killed_by[:width]) + (" ..." if len(m.killed_by) > width else "")
        rows.append(f"{m.name:24} {d:14} {s:11} {first}")
    return "\n".join(rows)
