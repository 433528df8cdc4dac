#!/bin/bash
# Session 26, call 4: Nsight Compute of the three tiles that miss (kernel of b942b58:
# LOAD_RR and PINGPONG defaults): d 128 16k, d 64 16k, 16k window 128.
OUT=$OUT/ncu timeout 500 bash scripts/ncu_h200.sh "d128-16384@0 wgmma_m8_b128_ws" \
    "gptoss-16384@0 wgmma_m16_b64" "gptoss-16384@0-w128 wgspan_m4_b136_p8_q4"
