#!/bin/bash
# Session 27, call 3: on the TMA producer, FlashAttention-3's intra-warpgroup overlap
# (session 26's OVERLAP, reports/wip/session27/overlap-tma.patch applied in ov/), with and
# without the ping-pong; and at d 64 the producer tiles (TMA) against the self-loading
# four-warpgroup tile the tuner picks there.
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
X=reports/wip/session27/ov
timeout 280 python -m hipkernel.ab --variant tma=.@wgmma_m8_b128_ws \
    --variant tma_np=.@wgmma_m8_b128_ws+PINGPONG=0 \
    --variant ov=$X@wgmma_m8_b128_ws+OVERLAP=1 --variant ov_np=$X@wgmma_m8_b128_ws+OVERLAP=1+PINGPONG=0 \
    --shape d128-16384@0 --shape d128-512@8192 \
    --passes 2 --json $OUT/ab-ov-d128.json --hang-s 60 > $OUT/ab-ov-d128.log 2>&1
echo "ab rc $?" >> $OUT/ab-ov-d128.log
tail -17 $OUT/ab-ov-d128.log
timeout 280 python -m hipkernel.ab --variant m16=.@wgmma_m16_b64 \
    --variant ws64=.@wgmma_m8_b64_ws --variant ws128=.@wgmma_m8_b128_ws \
    --variant ov64=$X@wgmma_m8_b64_ws+OVERLAP=1 --variant ov128=$X@wgmma_m8_b128_ws+OVERLAP=1 \
    --shape gptoss-16384@0 --shape gptoss-512@8192 \
    --passes 2 --json $OUT/ab-ws-d64.json --hang-s 60 > $OUT/ab-ws-d64.log 2>&1
echo "ab rc $?" >> $OUT/ab-ws-d64.log
tail -21 $OUT/ab-ws-d64.log
