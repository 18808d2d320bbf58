#!/bin/bash
# kernels: linear GPU tests, tf32 batch invariance, bench_kernels
source .gpu-bundle/setup.sh >/dev/null 2>&1
T0=$(date +%s)
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 170 python3 -m pytest -q -m gpu -n 8 tests/kernels/test_kernels_gpu.py -k "linear" -p no:cacheprovider > $OUT/lin.log 2>&1
echo "linear tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/lin.log | cut -c1-300
mkdir -p $OUT/bk; timeout 150 python3 tools/bench_kernels.py --out $OUT/bk > $OUT/bk/log.txt 2>&1
echo "bench rc=$? at $(( $(date +%s) - T0 )) s"
timeout 120 python3 -m pytest -q -x tests/runtime/test_engine_gpu.py -k "tokens_do_not_depend and tf32" -p no:cacheprovider > $OUT/inv.log 2>&1
echo "invariance rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/inv.log
