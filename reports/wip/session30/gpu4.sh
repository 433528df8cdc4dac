#!/bin/bash
# Session 30, call 4: the wgspan window tile with the sink logit loaded behind the block's
# first rounds and Q, against a4e2f531 (base2/ = git archive main hipkernel/kernels before it):
# refattn bench of the window shapes (per call, after a GPU sleep; the 512-row ones are
# host-bound in bursts) from a copy of the tree with base2's kernels and from this tree, in
# turn, twice; ab bursts at 16384@0 w128 and 4096@8192 w128 with and without the sink; then
# every GPU record of this tree (scripts/h200_records_one_call.sh).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
W=reports/wip/session30
t0=$(date +%s); el() { echo $(( $(date +%s) - t0 )); }
mkdir -p /tmp/bt && tar --exclude=./reports --exclude=./.venv -cf - . | tar -xf - -C /tmp/bt
rm -rf /tmp/bt/hipkernel/kernels && cp -r $W/base2/hipkernel/kernels /tmp/bt/hipkernel/
S=gptoss-512@512-w128,gptoss-512@8192-w128,gptoss-512@15872-w128,gptoss-16384@0-w128
for i in 1 2; do
  (cd /tmp/bt && timeout 40 python -m refattn bench --shapes $S --peers none --no-ceilings --json $OUT/wb-base-$i.json > $OUT/wb-base-$i.log 2>&1)
  echo "bench base $i rc $? at $(el) s"
  timeout 40 python -m refattn bench --shapes $S --peers none --no-ceilings --json $OUT/wb-new-$i.json > $OUT/wb-new-$i.log 2>&1
  echo "bench new $i rc $? at $(el) s"
done
timeout 50 python -m hipkernel.ab --variant base=$W/base2@wgspan_m4_b136_p8_q4 --variant new=.@wgspan_m4_b136_p8_q4 \
    --variant base0=$W/base2@wgspan_m4_b136_p8_q4+SINK_MODE=0 --variant new0=.@wgspan_m4_b136_p8_q4+SINK_MODE=0 \
    --shape gptoss-16384@0-w128 --shape gptoss-4096@8192-w128 --passes 2 --json $OUT/ab-wgspan.json --hang-s 30 > $OUT/ab-wgspan.log 2>&1
echo "ab rc $? at $(el) s"; grep -v HOST-BOUND $OUT/ab-wgspan.log | tail -16
OUT=$OUT timeout 450 bash scripts/h200_records_one_call.sh > $OUT/records-call.log 2>&1
echo "records rc $? at $(el) s"; tail -5 $OUT/records-call.log
