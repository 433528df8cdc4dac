# sass_all.py KDIR OUT.json [--mutants]: sha256 of the SASS of every sm_90a / sm_80 variant
import sys, json, hashlib, subprocess, re
from pathlib import Path
from concurrent.futures import ProcessPoolExecutor
from hipkernel import api
from hipkernel.build import kernel_variants, _compiles_for
from hipkernel.backends import cuda
CUOBJ = "/tmp/dis/lib/python3.11/site-packages/nvidia/cu13/bin/cuobjdump"
kd = Path(sys.argv[1])
def one(args):
    v, target, i = args
    src = api.inline_includes(lambda n: (kd / n).read_text(), api.KERNEL_FILES[v.path].name)
    r = cuda.compile_offline(src, v.defines, target, kernel_name=api.KERNEL_NAME)
    f = Path(f"/tmp/s30/k{i}.cubin"); f.write_bytes(r.binary)
    sass = subprocess.run([CUOBJ, "-sass", str(f)], capture_output=True, text=True).stdout
    sass = "\n".join(l for l in sass.splitlines() if "Function" in l or re.match(r"\s+/\*[0-9a-f]{4}\*/", l))
    return f"{target} {v.d} {v.config}", hashlib.sha256(sass.encode()).hexdigest(), r.regs, r.spills
work = []
for v in kernel_variants("--mutants" in sys.argv):
    for t in ("sm_90a", "sm_80"):
        if _compiles_for(v, t):
            work.append((v, t, len(work)))
with ProcessPoolExecutor(8) as ex:
    res = {k: (h, r, s) for k, h, r, s in ex.map(one, work)}
Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
print(len(res), "variants")
