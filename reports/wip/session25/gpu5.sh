#!/bin/bash
# Session 25, fifth device call: ROW_CHAINS (flash_rows.h) on the wgspan tile and the wgmma d 64 tile.
export PYTHONPATH=.
timeout 150 python -m hipkernel.ab --variant c4=.@wgspan_m4_b136_p8_q4 \
    --variant c1=.@wgspan_m4_b136_p8_q4+ROW_CHAINS=1 --variant c2=.@wgspan_m4_b136_p8_q4+ROW_CHAINS=2 \
    --variant c4q8=.@wgspan_m4_b136_p8_q8 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 \
    --passes 2 --json $OUT/ab-span.json --hang-s 60 > $OUT/ab-span.log 2>&1
echo "ab rc $?" >> $OUT/ab-span.log
timeout 200 python -m hipkernel.ab --variant c1=.@wgmma_m16_b64 \
    --variant c2=.@wgmma_m16_b64+ROW_CHAINS=2 --variant c4=.@wgmma_m16_b64+ROW_CHAINS=4 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 \
    --passes 2 --json $OUT/ab-wg.json --hang-s 60 > $OUT/ab-wg.log 2>&1
echo "ab rc $?" >> $OUT/ab-wg.log
