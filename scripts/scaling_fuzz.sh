#!/usr/bin/env bash
# How `refattn fuzz --gpus` and `refattn run --gpus` scale on a host of two GPUs, from an
# installed wheel. Builds the wheel of this tree (its tracked and untracked, not ignored files,
# as `make wheel-check` does) in a temporary directory, installs it into a fresh venv and, from
# an empty directory where the tree is not importable, times one after the other:
#   refattn fuzz --kernel hipkernel --examples $EXAMPLES --gpus 1, then --gpus 2
#   refattn run  --kernel hipkernel --suite <every shipped suite> --gpus 1, then --gpus 2
#   refattn run  --kernel $THIRD    --suite <every shipped suite> --gpus 1, then --gpus 2
# after compiling every kernel module into a fresh disk cache (hipkernel.scaling.warm_cache),
# so no timed run pays compiles another one reads from disk. $OUT gets fuzz-gpus1.json,
# fuzz-gpus2.json, run-gpus1.json, run-gpus2.json, run-third-gpus{1,2}.json, warmup.json,
# scaling.json (hipkernel.scaling.wheel_runs_body: the host facts, each command's wall time
# and exit status, per pair the speed-up against its target and, for the matrix runs, whether
# the merged two-GPU results equal the one-GPU results case for case (their outcomes; and
# their relL2, or which cases a re-tuned config rounded otherwise), with the per-test slowdown)
# and scaling.log (their output).
# The host may be offline: the wheel is built without build isolation ($PYTHON's setuptools
# and wheel; where they cannot build it, with isolation, which needs the package index)
# and installed without its dependencies into a venv whose path ends with $PYTHON's
# site-packages (a .pth file: --system-site-packages would give the base interpreter's when
# $PYTHON is itself a venv's), where numpy, rich, threadpoolctl, mpmath, hypothesis,
# pytest-xdist and cuda-bindings must be.
#   OUT=dir bash scripts/scaling_fuzz.sh          (PYTHON=python3, EXAMPLES=2000 by default)
# Exit status: 0 every command exited 0 and every merged matrix equals its one-GPU run; 1 not
# (a failing case, say); 2 fewer than two GPUs visible, or the wheel could not be built or
# installed.
set -euo pipefail
: "${OUT:?set OUT to the output directory}"
PYTHON=${PYTHON:-python3}
EXAMPLES=${EXAMPLES:-2000}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
# the kernel the harness did not build: hipkernel's flash_prefill_v3 through the C route by
# default (THIRD=fa4 where FlashAttention-4 is installed)
THIRD=${THIRD:-cabi:$ROOT/examples/c_v3/hipkernel_v3.toml}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
unset PYTHONPATH REFATTN_CASES_DIR REFATTN_FAKE_GPUS PYTEST_ADDOPTS PYTEST_DISABLE_PLUGIN_AUTOLOAD

# the devices --gpus sees (refattn.sharding.visible_devices), before anything is built
seen=$(cd "$ROOT" && "$PYTHON" -c 'from refattn.sharding import visible_devices as v
d = v(); print(len(d), d.source)') || { echo "scaling_fuzz: no refattn for $PYTHON" >&2; exit 2; }
if [ "${seen%% *}" -lt 2 ]; then
  echo "scaling_fuzz: needs 2 GPUs, sees ${seen%% *} (${seen#* })" >&2
  exit 2
fi

d=$(mktemp -d)
trap 'rm -rf "$d"' EXIT
mkdir -p "$d/src" "$d/dist" "$d/empty"
cd "$ROOT"
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  git ls-files -z -co --exclude-standard | tar --null -T - --ignore-failed-read -cf - \
    | tar -xf - -C "$d/src"
else
  tar --exclude=./.venv --exclude=./.git --exclude=./build --exclude='*.egg-info' -cf - . \
    | tar -xf - -C "$d/src"
fi
# offline first (the build backend of $PYTHON), else an isolated build from the index
"$PYTHON" -m pip wheel -q --no-deps --no-build-isolation -w "$d/dist" "$d/src" 2>/dev/null \
  || "$PYTHON" -m pip wheel -q --no-deps -w "$d/dist" "$d/src" || exit 2
whl=$(ls "$d"/dist/refattn-*.whl)
"$PYTHON" -m venv "$d/venv" || exit 2
py="$d/venv/bin/python"
"$PYTHON" -c 'import site, sysconfig; p = sysconfig.get_paths()
print("\n".join(dict.fromkeys([p["purelib"], p["platlib"], *site.getsitepackages()])))' \
  > "$("$py" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/host-site.pth"
"$py" -m pip install -q --no-deps --no-index "$whl" || exit 2
refattn="$d/venv/bin/refattn"
cd "$d/empty"
export HIPKERNEL_CACHE_DIR="$d/hkcache" PYTHONUNBUFFERED=1
"$py" -c 'import pathlib, sys, refattn, hipkernel, refattn.cases as c
site = pathlib.Path(sys.argv[1]).resolve()
where = [pathlib.Path(refattn.__file__), pathlib.Path(hipkernel.__file__), c.cases_dir()]
bad = [str(p) for p in where if site not in p.resolve().parents]
sys.exit(f"scaling_fuzz: not from the wheel: {bad}" if bad else 0)' "$d/venv" || exit 2
echo "== $whl installed; $seen"

"$py" -c 'import json; from hipkernel.scaling import warm_cache; print(json.dumps(warm_cache()))' \
  > "$OUT/warmup.json" || exit 2
suites=$("$py" -c 'from refattn.cases import list_suites; print(" ".join(list_suites()))')
: > "$d/times.tsv"
timed() {  # NAME COMMAND...: its wall time (ms) and exit status go to times.tsv
  local name=$1 t0 rc=0
  shift
  echo "== $name: $*" | tee -a "$OUT/scaling.log"
  t0=$(date +%s%N)
  "$@" >> "$OUT/scaling.log" 2>&1 || rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( ($(date +%s%N) - t0) / 1000000 ))" >> "$d/times.tsv"
  echo "   exit $rc after $(( ($(date +%s%N) - t0) / 1000000 )) ms"
}
for g in 1 2; do
  timed "fuzz-gpus$g" "$refattn" fuzz --kernel hipkernel --examples "$EXAMPLES" --gpus "$g" \
    --json "$OUT/fuzz-gpus$g.json"
done
for g in 1 2; do
  # shellcheck disable=SC2086  # one word per suite
  timed "run-gpus$g" "$refattn" run --kernel hipkernel --suite $suites --gpus "$g" -q \
    --json "$OUT/run-gpus$g.json"
done
# the same matrix of a kernel the harness did not build, through its adapter
for g in 1 2; do
  # shellcheck disable=SC2086
  timed "run-third-gpus$g" "$refattn" run --kernel "$THIRD" --suite $suites --gpus "$g" -q \
    --json "$OUT/run-third-gpus$g.json"
done

"$py" - "$d/times.tsv" "$OUT" "$seen" "$suites" "$EXAMPLES" "$THIRD" <<'EOF'
import json, sys
from pathlib import Path

from hipkernel.scaling import host_facts, wheel_runs_body

times, out, seen, suites, examples, third = sys.argv[1:]
runs, docs = {}, {}
for line in Path(times).read_text().splitlines():
    name, rc, ms = line.split("\t")
    doc = Path(out) / f"{name}.json"
    if doc.is_file():
        docs[name] = json.loads(doc.read_text())
    runs[name] = {"exit": int(rc), "wall_s": int(ms) / 1000, "ok": docs.get(name, {}).get("ok")}
body = wheel_runs_body(runs, docs, host=host_facts(), devices=seen, suites=suites.split(),
                       examples=int(examples))
body["third_party_kernel"] = third
(Path(out) / "scaling.json").write_text(json.dumps(body, indent=2) + "\n")
print(json.dumps({"pairs": body["pairs"], "ok": body["ok"]}))
sys.exit(0 if body["ok"] else 1)
EOF
