#!/bin/bash
# one call: the first run's CuPy kernels; the queued VAD (GPU tests, 60-minute file old/new); #72 sweep; invariance
source .gpu-bundle/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
T0=$(date +%s); left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
mkdir -p $OUT/fr $OUT/cupy_first_run
export CUPY_CACHE_SAVE_CUDA_SOURCE=1
timeout 100 python3 tools/first_result.py --out $OUT/fr --cases transcribe_first_run > $OUT/fr/log.txt 2>&1
echo "first run rc=$? at $(( $(date +%s) - T0 )) s"; grep -o '"case": "[a-z0-9_]*", "[a-z_]*": [0-9.]*' $OUT/fr/log.txt
C=${CUPY_CACHE_DIR:-$HOME/.cupy/kernel_cache}; ls -la $C > $OUT/cupy_first_run/list.txt 2>&1
(cd $C 2>/dev/null && tar czf $OUT/cupy_first_run/sources.tgz *.cu); unset CUPY_CACHE_SAVE_CUDA_SOURCE
(for i in $(seq 0 11); do timeout 240 python3 .gpu-run/sweep2.py --warm $i 12 > $OUT/warm$i.log 2>&1 & done; wait) &
WARM=$!
timeout 120 python3 -m pytest -q -m gpu tests/asr/test_vad.py tests/asr/test_asr_gpu.py -k "vad or probabilities or warm" -p no:cacheprovider > $OUT/vadtests.log 2>&1
echo "vad tests rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/vadtests.log
wait $WARM; echo "warm done at $(( $(date +%s) - T0 )) s"; cat $OUT/warm*.log | grep -c FAIL
P=packages/glm_asr/src/glm_asr/pipeline.py; cp $P /tmp/new_pipeline.py
for v in new old new; do
  L=$(left); [ $L -lt 330 ] && break
  if [ $v = old ]; then cp .gpu-run/old/pipeline.py $P; else cp /tmp/new_pipeline.py $P; fi
  mkdir -p $OUT/$v-$L
  timeout 100 python3 tools/first_result.py --out $OUT/$v-$L --cases long_file_60min_vad,long_file_60min > $OUT/$v-$L/log.txt 2>&1
  echo "$v rc=$? at $(( $(date +%s) - T0 )) s"; grep -o '"case": "[a-z0-9_]*", "[a-z_]*": [0-9.]*, "first_realtime_factor": [0-9.]*' $OUT/$v-$L/log.txt
done
cp /tmp/new_pipeline.py $P
timeout $(( $(left) - 70 )) python3 .gpu-run/sweep2.py --time $OUT/sweep2.json > $OUT/sweep2.log 2>&1
echo "sweep rc=$? at $(( $(date +%s) - T0 )) s"
timeout $(( $(left) - 3 )) python3 -m pytest -q -x tests/runtime/test_engine_gpu.py -k tokens_do_not_depend -p no:cacheprovider > $OUT/inv.log 2>&1
echo "invariance rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/inv.log
