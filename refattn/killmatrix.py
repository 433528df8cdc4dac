"""The mutation kill matrix: proof that the case matrix catches classic kernel bugs.

For a kernel family that can switch the mutants of ``refattn.mutants`` on (the CPU model and
the HIP kernel both can), run the clean kernel — it must pass every case — and then each
mutant over the same cases. A mutant is *killed* when at least one case fails under the
derived gate (or errors, or produces non-finite output). Next to it we record which cases
would have killed it under the seed harness's fixed gate (relL2 <= 0.01) alone, which is the
argument for the derived gate.

The fp64 reference of each case is computed once (the runner caches it), so the cost is one
kernel run per (mutant, case).
"""

from __future__ import annotations

from dataclasses import dataclass, field

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


def run_kill_matrix(make_kernel, cases, names=None, progress=None) -> KillMatrix:
    """``make_kernel(mutants: frozenset) -> adapter``; ``cases``: loaded cases;
    ``names``: mutant names to run (default: the whole catalogue)."""
    chosen = [m for m in MUTANTS if names is None or m.name in names]
    clean = make_kernel(frozenset())
    clean_res = run_matrix(clean, cases, progress=progress)
    results = []
    for m in chosen:
        res = run_matrix(make_kernel(frozenset({m.name})), cases, progress=progress)
        bad = [r for r in res.results if r.outcome in _BAD]
        results.append(MutantResult(
            name=m.name, breaks=m.breaks, killed=bool(bad),
            killed_by=[r.case for r in bad],
            killed_by_seed_gate=[r.case for r in res.results if _seed_gate_kills(r)],
            equivalent=m.equivalent))
    return KillMatrix(
        kernel=clean_res.kernel, cases=[c.name for c in cases], clean_ok=clean_res.ok,
        clean_failures=[r.case for r in clean_res.results if r.outcome not in ("pass", "declined")],
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
