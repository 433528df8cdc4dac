#!/bin/bash
# Session 29, call 7: the bench record of kernel 7149d8c1 again, with the rounds in a
# carryover-balanced order (10 rounds; hipkernel.bench carryover_orders).
export PYTHONPATH=. PYTHONUNBUFFERED=1 HIPKERNEL_CACHE_DIR=/tmp/hkcache
timeout 380 python -m hipkernel.gpu_session --out $OUT --only bench > $OUT/bench-session.log 2>&1
echo "bench rc $?"; tail -32 $OUT/bench-session.log
