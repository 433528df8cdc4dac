# sass_all.py KDIR OUT.json [--mutants]: sha256 of the SASS of every sm_90a / sm_80 build of the
# kernels in KDIR (a hipkernel/kernels directory: the tree's, or `git archive REV
# hipkernel/kernels`'s), so that two runs tell whether a refactor moved any machine code.
# Offline: NVRTC, then hipkernel.sass.disassemble (nvdisasm). Session 30 ran an earlier form
# that called cuobjdump from a scratch venv; this one reads the same instruction lines.
import hashlib
import json
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from hipkernel import api, sass
from hipkernel.backends import cuda
from hipkernel.build import _compiles_for, kernel_variants

kd = Path(sys.argv[1])


def one(args):
    v, target = args
    src = api.inline_includes(lambda n: (kd / n).read_text(), api.KERNEL_FILES[v.path].name)
    r = cuda.compile_offline(src, v.defines, target, kernel_name=api.KERNEL_NAME)
    text = "\n".join(sass.disassemble(r.binary))
    return f"{target} {v.d} {v.config}", hashlib.sha256(text.encode()).hexdigest(), r.regs, r.spills


if __name__ == "__main__":
    work = [(v, t) for v in kernel_variants("--mutants" in sys.argv)
            for t in ("sm_90a", "sm_80") if _compiles_for(v, t)]
    with ProcessPoolExecutor(8) as ex:
        res = {k: (h, r, s) for k, h, r, s in ex.map(one, work)}
    Path(sys.argv[2]).write_text(json.dumps(res, indent=1))
    print(len(res), "variants")
