#!/bin/bash
# Session 29, call 1: the wgmma tiles sum l on the tensor cores (l += P . 1, an m64n8k16 wgmma
# a 16-key step against a 2 KiB block of fp16 ones). The matrix with both wgmma tiles forced;
# same-process A/B against the landed kernel (base/ = git archive 0fa43a6 hipkernel/kernels).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session29
nvidia-smi --query-gpu=name,clocks.sm,power.draw,temperature.gpu --format=csv > $OUT/smi.txt
timeout 120 python scripts/mma_check.py --out $OUT/mc --sections matrix --configs wgmma_m16_b64,wgmma_m8_b128_ws > $OUT/mc.log 2>&1
echo "mma_check rc $?"; grep -E "== matrix|FAIL|fail" $OUT/mc.log | tail -6
timeout 200 python -m hipkernel.ab --variant base=$W/base@wgmma_m16_b64 --variant lmma=.@wgmma_m16_b64 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 --shape gptoss-4096@8192 \
    --passes 3 --json $OUT/ab-lmma-d64.json --hang-s 60 > $OUT/ab-lmma-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-lmma-d64.log; grep -v HOST-BOUND $OUT/ab-lmma-d64.log | tail -18
timeout 160 python -m hipkernel.ab --variant base=$W/base@wgmma_m8_b128_ws --variant lmma=.@wgmma_m8_b128_ws \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 3 --json $OUT/ab-lmma-d128.json --hang-s 60 > $OUT/ab-lmma-d128.log 2>&1
echo "ab rc $?" >> $OUT/ab-lmma-d128.log; grep -v HOST-BOUND $OUT/ab-lmma-d128.log | tail -12
