#!/bin/bash
# Session 26, call 3: three consumer warpgroups with the producer at d 128 (wgmma_m12_b64_ws:
# 192 rows a block, 1.5x the rows a K/V tile serves), Q in shared memory so that 152
# registers a consumer hold the rest; config.py temporarily allows m_tiles 12 with ws.
export PYTHONPATH=.
X=reports/wip/session26/ov
P=+SMEM_PLUS=50176
timeout 420 python -m hipkernel.ab --variant base=.@wgmma_m8_b128_ws \
    --variant m12s4=$X@wgmma_m12_b64_ws+QSMEM=1+KV_STAGES=4$P \
    --variant m12s5=$X@wgmma_m12_b64_ws+QSMEM=1+KV_STAGES=5$P \
    --variant m12s4np=$X@wgmma_m12_b64_ws+QSMEM=1+KV_STAGES=4+PINGPONG=0$P \
    --variant m12ov=$X@wgmma_m12_b64_ws+QSMEM=1+KV_STAGES=4+OVERLAP=1$P \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 2 --json $OUT/ab-m12.json --hang-s 60 > $OUT/ab-m12.log 2>&1
echo "ab rc $?" >> $OUT/ab-m12.log
tail -30 $OUT/ab-m12.log
