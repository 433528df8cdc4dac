export PYTHONPATH=.
ab() { python -m hipkernel.ab --passes 2 "$@" 2>&1 | grep -v "^wrote"; }
# second call: the per-tile cuts on top of PINGPONG=0
ab --variant nopp=.@wgmma_m16_b64+PINGPONG=0 --variant pp=.@wgmma_m16_b64 \
   --variant ld=.@wgmma_m16_b64+PINGPONG=0+L_DEFER=1 --variant mt=.@wgmma_m16_b64+PINGPONG=0+MAX_TREE=1 \
   --variant rr=.@wgmma_m16_b64+PINGPONG=0+LOAD_RR=1 --variant all=.@wgmma_m16_b64+PINGPONG=0+L_DEFER=1+MAX_TREE=1+LOAD_RR=1 \
   --variant ldmt=.@wgmma_m16_b64+PINGPONG=0+L_DEFER=1+MAX_TREE=1 \
   --shape gptoss-16384@0 --shape gptoss-512@8192 --json $OUT/cuts-d64.json
ab --variant base=.@wgmma_m8_b128_ws --variant ldmt=.@wgmma_m8_b128_ws+L_DEFER=1+MAX_TREE=1 \
   --variant pp=.@wgmma_m8_b128_ws+PINGPONG=1 \
   --shape d128-16384@0 --shape d128-512@8192 --json $OUT/cuts-d128.json
