"""Same-process A/B of kernel variants: the kernel of one git revision against another's, or
one config against the same with other ``-D`` macros, timed on the same inputs in the same
process, with their outputs compared bit for bit and against the reference.

    python -m hipkernel.ab --variant HEAD~5@wgmma_m16_b64 --variant .@wgmma_m16_b64 \\
        --variant s4=.@wgmma_m16_b64+KV_STAGES=4 --shape gptoss-16384@0 --json ab.json

A variant is ``[LABEL=]REV@CONFIG[+MACRO=VALUE...]``:

    REV     a git revision, whose ``hipkernel/kernels/`` is read with ``git show`` (the
            committed files, not the working tree); ``.`` for the working tree; or a
            directory holding a copy of a tree's ``hipkernel/kernels/`` (for a machine
            without the history: ``mkdir d && git archive REV hipkernel/kernels | tar -x -C d``)
    CONFIG  a config name (``wgmma_m16_b64``, ``mma_m8_b64_w2``, ``m4_b64``, ...): the kernel
            path, the launch geometry and the ``-D`` macros (``hipkernel.config``) of the
            current tree
    +M=V    a ``-D`` macro added or overridden (``KV_STAGES``, ``LOOKAHEAD``, ``MIN_BLOCKS``,
            ``PRODUCER_REGS``, ...); not the ones that fix the geometry (HEAD_DIM, M_TILES,
            BKV, WARP_M, WS, PACK, QWALK: choose another config); KV_STAGES also sizes the dynamic shared
            memory of a wgmma or wgspan variant, and SMEM_PLUS=n adds n bytes to it (for a
            variant that keeps more in shared memory than its config says); SINK_MODE=m is
            not a ``-D`` macro but the launches' ``sink_mode`` (0 none, 1 a per-head sink,
            the default, 2 smooth): the same kernel timed without its sink

Every variant of a shape runs on one set of resident inputs (``hipkernel.timing.Resident``,
per-head sink unless SINK_MODE says otherwise): kernel-only time (``timing.burst_ms``: n
back-to-back launches between two events, median of reps), ``--passes`` times over the
variants in turn. Each row says whether the output is bit-identical to the first variant's
with the same key tile (``bkv``: the tiles fix the rounding) and sink mode, and its relL2
against the fp32 reference of its sink mode where the shape is small enough
(``--ref-max-pairs``). A shape's FLOPs are ``hipkernel.timing.flops``.

A burst hides the host's launch cost only while a launch outlasts it. Each row also has
``host_ms``, the host's time to enqueue one launch in those bursts (``timing.burst_timing``), and
``host_bound`` when that reaches HOST_BOUND of the burst time: then the device waited
between launches and the row times the host (on the H200, a 512-row chunk under a 128-key
window: 0.045 ms a launch in a burst against 0.0156 in ``refattn bench``, whose calls wait
behind a GPU sleep). Compare such shapes with the bench, not here.

A variant may hang the GPU (a pipeline that deadlocks never returns from its events). With
``--json`` the file is rewritten after every row and names the variant about to be timed
(``running``), and ``--hang-s`` (default 120) arms a watchdog around each timing: when one
has not returned in that time the process prints its stacks and exits with status 1, and
the file keeps every row done before it and says which variant it was. (On the H200 a
device call that ran a hanging variant without these lost its 10 minutes and every row.)

A variant the device cannot launch (its block's shared memory over the device's limit, say
a stage count more than the tile's budget) is named with the backend's reason as it is
compiled, and skipped: the others are still timed (its ``compiled`` entry has ``skipped``).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hipkernel import api
from hipkernel.config import WGMMA_PATHS, KernelConfig

ROOT = Path(__file__).resolve().parent.parent
WORKTREE = "."
GEOMETRY_MACROS = ("HEAD_DIM", "M_TILES", "BKV", "WARP_M", "WS", "PACK", "QWALK")
SINK_MODES = {0: "none", 1: "per_head", 2: "smooth"}  # +SINK_MODE=m: the launches' sink_mode
HOST_BOUND = 0.8  # enqueue time / burst time from which a row times the host
_VARIANT = re.compile(r"(?:(?P<label>[\w.-]+)=)?(?P<rev>[^@=+\s]+)@(?P<config>\w+)"
                      r"(?P<macros>(?:\+\w+=-?\d+)*)\Z")


@dataclass(frozen=True)
class Variant:
    """One kernel variant: the source of ``rev`` compiled for ``config`` with ``macros``."""

    label: str
    rev: str
    config: KernelConfig
    macros: dict = field(default_factory=dict)

    def defines(self, d: int) -> dict:
        return {**api.kernel_defines(d, self.config),
                **{k: v for k, v in self.macros.items() if k != "SINK_MODE"}}

    @property
    def sink_mode(self) -> int:
        """The launches' sink_mode (SINK_MODE; 1, a per-head sink, by default)."""
        return self.macros.get("SINK_MODE", 1)

    def shared_mem(self, d: int) -> int:
        """The dynamic shared memory of a launch: the config's, with KV_STAGES overridden,
        plus SMEM_PLUS bytes (a variant that keeps more in shared memory than its config)."""
        return self.config.dynamic_smem_bytes(d, self.macros.get("KV_STAGES")) + self.macros.get("SMEM_PLUS", 0)


def parse_variant(spec: str) -> Variant:
    """``[LABEL=]REV@CONFIG[+MACRO=VALUE...]`` -> :class:`Variant`; ValueError naming
    ``variant`` and what is wrong."""
    from hipkernel.config import config_from_name

    m = _VARIANT.match(str(spec).strip())
    if m is None:
        raise ValueError(f"variant: expected [LABEL=]REV@CONFIG[+MACRO=VALUE...], e.g. "
                         f"main@wgmma_m16_b64+KV_STAGES=4, got {spec!r}")
    try:
        config = config_from_name(m.group("config"))
    except ValueError as e:
        raise ValueError(f"variant {spec!r}: {e}") from None
    macros = {}
    for item in filter(None, m.group("macros").split("+")):
        name, value = item.split("=")
        if name in GEOMETRY_MACROS:
            raise ValueError(f"variant {spec!r}: {name} is fixed by the config "
                             f"({config.name}); name another config instead")
        macros[name] = int(value)
    if "KV_STAGES" in macros and (config.path not in WGMMA_PATHS or macros["KV_STAGES"] < 1):
        raise ValueError(f"variant {spec!r}: KV_STAGES is a wgmma-path macro (wgmma, wgspan; >= 1)")
    if "SMEM_PLUS" in macros and (config.path not in WGMMA_PATHS or macros["SMEM_PLUS"] < 0):
        raise ValueError(f"variant {spec!r}: SMEM_PLUS is extra dynamic shared memory (bytes "
                         f">= 0) of a wgmma or wgspan variant")
    if macros.get("SINK_MODE", 1) not in SINK_MODES:
        raise ValueError(f"variant {spec!r}: SINK_MODE is the launches' sink_mode, one of "
                         f"{tuple(SINK_MODES)} ({', '.join(SINK_MODES.values())})")
    label = m.group("label") or spec.strip()
    return Variant(label, m.group("rev"), config, macros)


def source_at(rev: str, path: str, repo: Path = ROOT) -> str:
    """The kernel of ``path`` as one translation unit, from git revision ``rev`` of ``repo``
    (``WORKTREE``: the files as they are; a directory: its ``hipkernel/kernels/``).
    ValueError naming the revision when git cannot show it."""
    if rev == WORKTREE:
        return api.kernel_source(path)
    kernel_dir = api.KERNEL_DIR.relative_to(ROOT).as_posix()
    copy = Path(rev) / kernel_dir
    if copy.is_dir():
        return api.inline_includes(lambda name: (copy / name).read_text(), api.KERNEL_FILES[path].name)

    def read(name: str) -> str:
        res = subprocess.run(["git", "-C", str(repo), "show", f"{rev}:{kernel_dir}/{name}"],
                             capture_output=True, text=True)
        if res.returncode != 0:
            raise ValueError(f"variant: git cannot show {kernel_dir}/{name} at {rev!r}: "
                             f"{res.stderr.strip()}")
        return res.stdout

    return api.inline_includes(read, api.KERNEL_FILES[path].name)


def _reference(r, window: int, sink_mode: int = 1) -> np.ndarray:
    from refattn.reference import attention

    h = r.host
    return attention(h["q"].astype(np.float32), h["k"].astype(np.float32),
                     h["v"].astype(np.float32), past_len=r.geom["past_len"], window=window,
                     sink=h["sink"].astype(np.float32) if sink_mode == 1 else None,
                     smooth_softmax=sink_mode == 2)


def run(backend, variants: list[Variant], shapes: list, *, passes: int = 2, n: int = 20,
        reps: int = 7, ref_max_pairs: int = 2 ** 31, log=print, checkpoint=None,
        hang_s: float | None = None) -> dict:
    """Compile every variant for the head dims of ``shapes``, then time each shape's variants
    in turn, ``passes`` times, on one set of resident inputs. Returns the JSON document.
    ``checkpoint(doc)``, when given, sees the document so far before each timing (with
    ``running`` naming it) and after each row; ``hang_s`` arms ``faulthandler``'s watchdog
    around each timing (the module docstring)."""
    from refattn.metrics import rel_l2
    from hipkernel.timing import Resident, burst_timing, visible_pairs

    if not variants or not shapes:
        raise ValueError("variants and shapes: at least one of each")
    labels = [v.label for v in variants]
    if len(set(labels)) != len(labels):
        raise ValueError(f"variant: labels must differ, got {labels} (name them LABEL=...)")
    if hang_s is not None and not hang_s > 0:
        raise ValueError(f"hang_s: expected > 0 seconds, got {hang_s}")
    kernels, compiled, rows = {}, [], []
    doc = {"kind": "kernel_ab", "device": getattr(backend, "device_name", "?"),
           "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "passes": passes, "launches": n,
           "reps": reps, "compiled": compiled, "rows": rows, "running": None}
    save = checkpoint or (lambda d: None)
    for d in sorted({s.geometry["d"] for s in shapes}):
        for v in variants:
            if not v.config.fits(d):
                log(f"d{d} {v.label}: {v.config.name} does not fit at d={d}; skipped")
                continue
            k = backend.compile(source_at(v.rev, v.config.path), v.defines(d), api.KERNEL_NAME)
            info = getattr(k, "info", None)
            compiled.append(dict(d=d, variant=v.label, rev=v.rev, config=v.config.name,
                                 defines=v.defines(d), shared_mem=v.shared_mem(d),
                                 regs=getattr(info, "regs", None), spills=getattr(info, "spills", None)))
            log(f"d{d} {v.label}: {v.config.name} {v.defines(d)} regs {compiled[-1]['regs']} "
                f"spills {compiled[-1]['spills']} shared {v.shared_mem(d)}")
            # the launch's block and shared memory checked (and opted in) now, with no
            # arguments and no launch: a variant the device cannot launch is skipped here,
            # named with the reason, before anything is timed
            try:
                backend.prepare(k, (1, 1, 1), (v.config.threads, 1, 1), [], v.shared_mem(d))
            except ValueError as e:
                compiled[-1]["skipped"] = str(e)
                log(f"d{d} {v.label}: cannot launch on {doc['device']}; skipped: {e}")
                continue
            kernels[(d, v.label)] = k
    for shape in shapes:
        g = shape.geometry
        r = Resident(backend, B=g["B"], Sq=shape.sq, Hq=g["Hq"], Hkv=g["Hkv"], d=g["d"],
                     past_len=shape.past_len)
        try:
            pairs = g["B"] * g["Hq"] * visible_pairs(shape.sq, shape.past_len, shape.window)
            modes = sorted({v.sink_mode for v in variants})
            expected = ({m: _reference(r, shape.window, m) for m in modes}  # by sink mode
                        if pairs <= ref_max_pairs else {})
            first_of_tile: dict[tuple[int, int], np.ndarray] = {}
            for p in range(passes):
                for v in variants:
                    k = kernels.get((g["d"], v.label))
                    if k is None:
                        continue
                    if not v.config.supports(g["Hq"] // g["Hkv"]):
                        if p == 0:
                            log(f"{shape.name} {v.label}: {v.config.name} packs {v.config.pack} "
                                f"heads, G = {g['Hq'] // g['Hkv']}; skipped")
                        continue
                    doc["running"] = {"shape": shape.name, "variant": v.label, "pass": p}
                    save(doc)
                    backend.memset(r.ptr["out"], 0xFF, r.host["q"].nbytes)  # NaN: unwritten shows
                    grid = v.config.grid(shape.sq, g["Hq"], g["B"])
                    if hang_s is not None:
                        faulthandler.dump_traceback_later(hang_s, exit=True)
                    args = r.kernel_args(v.config, shape.window, v.sink_mode)
                    try:
                        ms, host_ms = burst_timing(backend, k, grid, (v.config.threads, 1, 1), args,
                                                   v.shared_mem(g["d"]), n=n, reps=reps)
                        out = r.output()
                    finally:
                        if hang_s is not None:
                            faulthandler.cancel_dump_traceback_later()
                    ref = first_of_tile.setdefault((v.config.bkv, v.sink_mode), out)
                    same = None if ref is out else bool(np.array_equal(ref.view(np.uint16),
                                                                       out.view(np.uint16)))
                    row = dict(shape=shape.name, variant=v.label, config=v.config.name, bkv=v.config.bkv,
                               **{"pass": p}, ms=ms, tflops=shape.flops() / ms / 1e9,
                               host_ms=host_ms, host_bound=host_ms >= HOST_BOUND * ms,
                               bit_identical=same, finite=bool(np.isfinite(out).all()),
                               sink_mode=v.sink_mode,
                               rel_l2=(float(rel_l2(out.astype(np.float32), expected[v.sink_mode]))
                                       if v.sink_mode in expected and p == 0 else None))
                    rows.append(row)
                    doc["running"] = None
                    save(doc)
                    log(f"{p} {shape.name:<20} {v.label:<24} {ms:9.4f} ms {row['tflops']:7.1f} TF/s "
                        f"same={same} finite={row['finite']} relL2={row['rel_l2']}"
                        + (f" HOST-BOUND (enqueue {host_ms:.4f} ms a launch)" if row["host_bound"] else ""))
        finally:
            r.free()
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m hipkernel.ab", description=__doc__.split("\n\n")[0].replace("\n", " "),
        epilog=__doc__[__doc__.index("    python -m"):], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", action="append", required=True, metavar="SPEC",
                    help="[LABEL=]REV@CONFIG[+MACRO=VALUE...] (repeat; the first is the baseline)")
    ap.add_argument("--shape", action="append", required=True, metavar="NAME",
                    help="a refattn.bench shape name, e.g. gptoss-16384@0 or gptoss-512@8192-w128 (repeat)")
    ap.add_argument("--passes", type=int, default=2, help="times over every variant (default 2)")
    ap.add_argument("--launches", type=int, default=20, help="back-to-back launches a sample (default 20)")
    ap.add_argument("--reps", type=int, default=7, help="samples, of which the median (default 7)")
    ap.add_argument("--ref-max-pairs", type=int, default=2 ** 31,
                    help="compare with the fp32 reference up to this many (row, key, head) pairs")
    ap.add_argument("--backend", default=None, help="cuda or hip (default: the first that works)")
    ap.add_argument("--json", type=Path, default=None,
                    help="write the rows here (rewritten after every row)")
    ap.add_argument("--hang-s", type=float, default=120.0, metavar="S",
                    help="a timing that has not returned after S seconds is taken for a hung "
                         "GPU: print the stacks and exit with status 1 (default 120; 0: never)")
    args = ap.parse_args(argv)
    from refattn.bench import parse_shape

    try:
        variants = [parse_variant(s) for s in args.variant]
        shapes = [parse_shape(s) for s in args.shape]
        for s in shapes:  # Resident holds one fp16 uniform batch
            if s.ragged or s.dtype != "fp16":
                raise ValueError(f"--shape {s.name}: an A/B runs uniform fp16 shapes only; time "
                                 f"ragged and bf16 rows with refattn bench")
        for name, x in (("passes", args.passes), ("launches", args.launches), ("reps", args.reps)):
            if x < 1:
                raise ValueError(f"{name}: expected >= 1, got {x}")
        if args.hang_s < 0:
            raise ValueError(f"--hang-s: expected >= 0 seconds, got {args.hang_s}")
    except ValueError as e:
        ap.error(str(e))
    from hipkernel.backends import get_backend

    command = "python -m hipkernel.ab " + " ".join(argv if argv is not None else sys.argv[1:])

    def write(doc: dict) -> None:  # whole, then renamed: a kill mid-write leaves the last one
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            tmp = args.json.with_name(args.json.name + ".tmp")
            tmp.write_text(json.dumps({**doc, "command": command}, indent=1, default=str) + "\n")
            tmp.replace(args.json)

    doc = run(get_backend(args.backend), variants, shapes, passes=args.passes, n=args.launches,
              reps=args.reps, ref_max_pairs=args.ref_max_pairs, checkpoint=write,
              hang_s=args.hang_s or None, log=lambda line: print(line, flush=True))
    write(doc)
    if args.json:
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
