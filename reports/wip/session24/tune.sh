#!/bin/bash
# Session 24: the wgmma tiles' knobs again, once the swizzled layout had freed the shared pipe.
# One H200: OUT=dir bash reports/wip/session24/tune.sh
export PYTHONPATH=.
ab() { python -m hipkernel.ab --passes 2 "$@" 2>&1 | grep -v "^wrote"; }
ab --variant base=.@wgmma_m16_b64 --variant s4=.@wgmma_m16_b64+KV_STAGES=4 \
   --variant s8=.@wgmma_m16_b64+KV_STAGES=8 --variant la3=.@wgmma_m16_b64+LOOKAHEAD=3 \
   --variant la1=.@wgmma_m16_b64+LOOKAHEAD=1 --variant nopp=.@wgmma_m16_b64+PINGPONG=0 \
   --variant m8b128ws=.@wgmma_m8_b128_ws --variant m8b64ws=.@wgmma_m8_b64_ws \
   --shape gptoss-16384@0 --shape gptoss-512@8192 --json $OUT/tune-d64.json
ab --variant base=.@wgmma_m8_b128_ws --variant m8b64ws=.@wgmma_m8_b64_ws \
   --variant p48=.@wgmma_m8_b128_ws+PRODUCER_REGS=48 --variant s2=.@wgmma_m8_b128_ws+KV_STAGES=2 \
   --variant m16b64=.@wgmma_m16_b64 --variant m8b64=.@wgmma_m8_b64 \
   --shape d128-16384@0 --shape d128-512@8192 --json $OUT/tune-d128.json
ab --variant mma=.@mma_m4_b32_p8_q4 --variant wg=.@wgmma_m16_b64 --variant wg4=.@wgmma_m4_b64 \
   --shape gptoss-16384@0-w128 --json $OUT/tune-w128.json
