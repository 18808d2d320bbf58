#!/bin/bash
# A (fresh machine first): first_result at HEAD, every compile cache emptied
source .gpu-bundle/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
T0=$(date +%s); left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
mkdir -p $OUT/fr $OUT/fr2 $OUT/cupy_first_run
export CUPY_CACHE_SAVE_CUDA_SOURCE=1     # the first run's CuPy kernels with their sources, to see which they are
timeout $(( $(left) - 300 )) python3 tools/first_result.py --out $OUT/fr --cases transcribe_first_run > $OUT/fr/log.txt 2>&1
echo "first run rc=$? at $(( $(date +%s) - T0 )) s"; grep -o '"case": "[a-z0-9_]*", "[a-z_]*": [0-9.]*' $OUT/fr/log.txt
C=${CUPY_CACHE_DIR:-$HOME/.cupy/kernel_cache}; ls -la $C > $OUT/cupy_first_run/list.txt 2>&1
(cd $C 2>/dev/null && tar czf $OUT/cupy_first_run/sources.tgz *.cu) ; ls $C 2>/dev/null | grep -vc '\.cu$'
timeout $(( $(left) - 5 )) python3 tools/first_result.py --out $OUT/fr2 --cases ${CASES:-transcribe_again,prebuild,transcribe_after_prebuild,generate_after_prebuild,gpt2_batch1,clip_30s} > $OUT/fr2/log.txt 2>&1
echo "first_result rc=$? at $(( $(date +%s) - T0 )) s"; grep -o '"case": "[a-z0-9_]*", "[a-z_]*": [0-9.]*' $OUT/fr2/log.txt
unset CUPY_CACHE_SAVE_CUDA_SOURCE
