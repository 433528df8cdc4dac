"""Launch the fused kernel on one bench shape a few times, for Nsight Compute to profile:

    ncu --clock-control none --section SpeedOfLight --section Occupancy \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        -k gqa_flash_prefill -s 2 -c 1 \
        python3 scripts/ncu_profile.py gptoss-512@8192 [--config mma_m8_b64_w2]

Shapes are ``refattn.bench`` shape names (benchmarks/shapes.toml). The config defaults to the one the autotuner
picks (the sweep's own launches run first; ``-s`` skips them only when you count them, so
give ``--config`` to profile exactly one config: then the launches are 2 warm-up + 1).

``--peer NAME`` launches a peer of the bench instead (``fa4``, ``sdpa``, ``cudnn``, ``flex``:
``refattn.adapters``), prepared once on the same shape's case with its per-head sink where
the peer takes one, and called ``--launches`` times; profile it with its own kernel name
(FlashAttention-4's forward: ``-k regex:'(?i)flash'``), so that both sides of a comparison
are the third launch of one process each:

    ncu --clock-control none ... -k regex:'(?i)flash' -s 2 -c 1 \
        python3 scripts/ncu_profile.py gptoss-16384@0 --peer fa4
"""

from __future__ import annotations

import argparse
import sys


def main(argv=None) -> int:
    from hipkernel.backends import get_backend
    from refattn.bench import parse_shape
    from hipkernel.config import config_from_name
    from hipkernel.timing import Resident

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("shape", help="a refattn.bench shape name, e.g. gptoss-512@8192 or gptoss-16384@0-w128")
    ap.add_argument("--config", default=None, help="a config name (e.g. mma_m8_b64_w2); default: autotuned")
    ap.add_argument("--peer", default=None, help="a bench peer to launch instead (fa4, sdpa, cudnn, flex)")
    ap.add_argument("--launches", type=int, default=3)
    args = ap.parse_args(argv)
    if args.peer is not None and args.config is not None:
        ap.error("--config: names a hipkernel config, not one of a peer (--peer)")
    try:
        shape = parse_shape(args.shape)
    except ValueError as e:
        ap.error(str(e))
    if shape.ragged or shape.dtype != "fp16":  # Resident holds one fp16 uniform batch
        ap.error(f"shape {shape.name}: profiles uniform fp16 shapes only (ragged and bf16 rows: "
                 f"refattn bench)")
    if args.peer is not None:
        return _launch_peer(ap, shape, args.peer, args.launches)
    g = shape.geometry
    cfg = config_from_name(args.config) if args.config else None
    be = get_backend("cuda")
    r = Resident(be, B=g["B"], Sq=shape.sq, Hq=g["Hq"], Hkv=g["Hkv"], d=g["d"], past_len=shape.past_len)
    try:
        for _ in range(args.launches):
            r.launch(window=shape.window, config=cfg)
        be.synchronize()
    finally:
        r.free()
    print(f"{args.shape}: {args.launches} launches of {args.config or 'the autotuned config'}")
    return 0


def _launch_peer(ap, shape, name: str, launches: int) -> int:
    """``launches`` calls of bench peer ``name`` on ``shape``'s case, prepared once."""
    from refattn.cases import make_inputs
    from refattn.kernels import KernelError, get_kernel

    try:
        peer = get_kernel(name)
    except KernelError as e:
        ap.error(f"--peer: {e}")
    if not getattr(peer, "peer", False) or not hasattr(peer, "prepare"):
        ap.error(f"--peer: {name} is not a bench peer with a prepared call (fa4, sdpa, cudnn, flex)")
    ok, why = peer.available()
    if not ok:
        ap.error(f"--peer: {name} is not available here: {why}")
    case = shape.case(sink=True)
    if not peer.supports(case):  # no sink there: the same shape without it
        case = shape.case(sink=False)
    if not peer.supports(case):
        ap.error(f"--peer: {name} does not run {shape.name}: {peer.unsupported_reason(case)}")
    call = peer.prepare(make_inputs(case))
    try:
        for _ in range(launches):
            call()
        peer.synchronize()
    finally:
        if call.close is not None:
            call.close()
    print(f"{shape.name}: {launches} calls of {name} ({case.sink} sink)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
