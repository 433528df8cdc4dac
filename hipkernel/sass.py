"""What ptxas made of a config: its SASS, offline, and the schedule facts the timings rest on.

    python -m hipkernel.sass --config wgmma_m8_b128_ws --head-dim 128 [--define OVERLAP=1]
                             [--sass PATH]

compiles the config's kernel with NVRTC for sm_90a (no GPU or driver), disassembles the cubin
with ``nvdisasm`` (pip ``nvidia-cuda-nvdisasm``; ``.ci/install-amd.sh`` installs it) and prints
its registers, spills and instruction counts, and for a wgmma tile under ``OVERLAP`` how many
``MUFU.EX2`` run between the wait for Q·Kᵀ and the wait for the owed P·V, and the longest run
of one opcode of the softmax there (:func:`softmax_runs`: where ptxas issues 55 ``MUFU.EX2`` back
to back, a warp waits between them where it could issue other work; docs/performance.md).

That last count is why this module exists. Under ``OVERLAP`` (kernels/gqa_flash_prefill_wgmma.hip)
a consumer issues tile t's Q·Kᵀ and tile t − 1's P·V, waits for the first
(``wgmma.wait_group 1``: SASS ``WARPGROUP.DEPBAR.LE gsb0, 0x1``), runs tile t's softmax, and
only then waits for the P·V (``wait_group 0``: ``... gsb0, 0x0``). Waiting early is always
legal, and ptxas did it: in kernel sources ``2ee6512e`` to ``7149d8c1`` it put the second
wait right after the first, ahead of every exp2, so the softmax never ran under the P·V (the
PTX had the order right).
``hk_wgmma_wait_all_after`` in kernels/wgmma.h pins it; :func:`exp2_between_waits` is the
check that it still holds (tests/test_sass.py, for every config with ``OVERLAP`` on).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

_WAIT = re.compile(r"\bWARPGROUP\.DEPBAR\.LE\s+gsb0\s*,\s*0x([0-9a-fA-F]+)")
_EXP2 = re.compile(r"\bMUFU\.EX2\b")
_OPCODE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]*)")


def find_nvdisasm() -> str | None:
    """The ``nvdisasm`` to use: ``$NVDISASM``, then one on PATH or under ``$CUDA_HOME/bin``, then
    one from the pip wheel ``nvidia-cuda-nvdisasm`` (``site-packages/nvidia/*/bin``); None when
    there is none."""
    env = os.environ.get("NVDISASM")
    if env:
        return env if Path(env).is_file() else None
    found = shutil.which("nvdisasm")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")):
        if home and (Path(home) / "bin" / "nvdisasm").is_file():
            return str(Path(home) / "bin" / "nvdisasm")
    try:
        import nvidia  # namespace package of NVIDIA's pip wheels
    except ImportError:
        return None
    for root in getattr(nvidia, "__path__", []):
        for cand in sorted(Path(root).glob("*/bin/nvdisasm")):
            if cand.is_file():
                return str(cand)
    return None


def disassemble(cubin: bytes, nvdisasm: str | None = None) -> list[str]:
    """The instruction lines (``/*addr*/ OPCODE ...``) of ``cubin``, in address order.
    Raises FileNotFoundError without an ``nvdisasm`` and RuntimeError when it fails."""
    tool = nvdisasm or find_nvdisasm()
    if tool is None:
        raise FileNotFoundError("nvdisasm not found (pip install nvidia-cuda-nvdisasm, or set NVDISASM)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "kernel.cubin"
        path.write_bytes(cubin)
        proc = subprocess.run([tool, str(path)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{tool} failed ({proc.returncode}): {proc.stderr.strip()[:500]}")
    return [line for line in proc.stdout.splitlines() if _OPCODE.match(line)]


def opcodes(lines: Sequence[str]) -> list[str]:
    """Each instruction line's opcode with its modifiers (``MUFU.EX2``, ``HGMMA.64x128x16.F32``),
    the guard predicate dropped."""
    return [m.group(1) for m in map(_OPCODE.match, lines) if m]


def exp2_between_waits(lines: Sequence[str]) -> int | None:
    """How many ``MUFU.EX2`` lie (in address order) between the first wait that leaves one
    wgmma group in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``) and the next wait for all
    (``gsb0, 0x0``): under ``OVERLAP``, the softmax that runs while the owed P·V does. None when
    the code has no such pair (no ``OVERLAP``)."""
    inside, count = False, 0
    for line in lines:
        wait = _WAIT.search(line)
        if wait:
            left = int(wait.group(1), 16)  # groups the wait leaves in flight
            if not inside and left == 1:
                inside = True
            elif inside and left == 0:
                return count
        elif inside and _EXP2.search(line):
            count += 1
    return None


SOFTMAX_OPCODES = ("FMNMX", "FFMA", "MUFU", "F2FP", "FADD")


def softmax_runs(lines: Sequence[str], ops: Sequence[str] = SOFTMAX_OPCODES) -> dict[str, int] | None:
    """The longest run of consecutive instructions (in address order) of each opcode of ``ops``
    (the opcode without its modifiers: ``MUFU.EX2`` counts as ``MUFU``) from the first wait
    that leaves one wgmma group in flight (``WARPGROUP.DEPBAR.LE gsb0, 0x1``: the wait for
    Q·Kᵀ under ``OVERLAP``) to the next wgmma issued (``HGMMA``): the softmax of a tile. 0 for
    an opcode that does not occur there; None without such a wait (no ``OVERLAP``)."""
    runs = {op: 0 for op in ops}
    inside, last, length = False, None, 0
    for line in lines:
        m = _OPCODE.match(line)
        if m is None:
            continue
        if not inside:
            wait = _WAIT.search(line)
            inside = wait is not None and int(wait.group(1), 16) == 1
            continue
        base = m.group(1).split(".")[0]
        if base == "HGMMA":
            return runs
        length = length + 1 if base == last else 1
        last = base
        if base in runs:
            runs[base] = max(runs[base], length)
    return runs if inside else None


@dataclass
class SassReport:
    config: str
    head_dim: int
    defines: dict
    regs: int | None
    spills: int | None
    instructions: int
    counts: Counter
    exp2_under_pv: int | None
    runs: dict | None = None  # softmax_runs

    def summary(self) -> str:
        top = ", ".join(f"{op} {n}" for op, n in self.counts.most_common(8))
        lines = [f"{self.config} d {self.head_dim}: {self.regs} registers, {self.spills} bytes spilled, "
                 f"{self.instructions} instructions ({top})",
                 f"  -D {' '.join(f'{k}={v}' for k, v in self.defines.items())}"]
        if self.exp2_under_pv is None:
            lines.append("  no wait_group 1 / wait_group 0 pair: OVERLAP is off")
        else:
            lines.append(f"  MUFU.EX2 between the wait for Q.K^T and the wait for the owed P.V: "
                         f"{self.exp2_under_pv}")
        if self.runs is not None:
            lines.append("  longest run of one opcode from the wait for Q.K^T to the next wgmma: "
                         + ", ".join(f"{op} {n}" for op, n in self.runs.items()))
        return "\n".join(lines)


def inspect(config: str, head_dim: int, extra: dict | None = None, sass_path: Path | None = None,
            target: str = "sm_90a") -> SassReport:
    """Compile ``config`` at ``head_dim`` (plus ``extra`` ``-D`` macros) for ``target`` with
    NVRTC and read its SASS. Raises ValueError for a config or head dim the tree does not
    have, BackendUnavailable without NVRTC, FileNotFoundError without nvdisasm."""
    from hipkernel import api
    from hipkernel.backends import cuda
    from hipkernel.config import HEAD_DIMS, config_from_name

    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim: expected one of {HEAD_DIMS}, got {head_dim}")
    cfg = config_from_name(config)
    defines = dict(api.kernel_defines(head_dim, cfg))
    defines.update(extra or {})
    res = cuda.compile_offline(api.kernel_source(cfg.path), defines, target, kernel_name=api.KERNEL_NAME)
    lines = disassemble(res.binary)
    if sass_path is not None:
        sass_path.write_text("\n".join(lines) + "\n")
    ops = opcodes(lines)
    return SassReport(config, head_dim, defines, res.regs, res.spills, len(ops), Counter(ops),
                      exp2_between_waits(lines), softmax_runs(lines))


def _define(text: str) -> tuple[str, int]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", name):
        raise argparse.ArgumentTypeError(f"--define: expected NAME=INT, got {text!r}")
    try:
        return name, int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--define: {name}'s value must be an integer, got {value!r}") from None


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hipkernel.sass", description=__doc__.split("\n")[0],
                                 epilog="Needs NVRTC (pip nvidia-cuda-nvrtc) and nvdisasm (pip "
                                        "nvidia-cuda-nvdisasm, or NVDISASM=path); no GPU.")
    ap.add_argument("--config", required=True, help="a config name, e.g. wgmma_m8_b128_ws")
    ap.add_argument("--head-dim", type=int, default=64, help="head dim (default 64)")
    ap.add_argument("--define", type=_define, action="append", default=[], metavar="NAME=INT",
                    help="a -D macro added or overridden (repeatable), e.g. OVERLAP=1")
    ap.add_argument("--target", default="sm_90a", help="NVRTC target (default sm_90a)")
    ap.add_argument("--sass", type=Path, metavar="PATH", help="also write the instruction lines here")
    args = ap.parse_args(argv)
    from hipkernel.backends import BackendUnavailable

    try:
        rep = inspect(args.config, args.head_dim, dict(args.define), args.sass, args.target)
    except ValueError as e:
        ap.error(str(e))
    except (BackendUnavailable, FileNotFoundError, RuntimeError) as e:
        print(f"hipkernel.sass: {e}", file=sys.stderr)
        return 2
    print(rep.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
