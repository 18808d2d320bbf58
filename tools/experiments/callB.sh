#!/bin/bash
# B: #72 tile sweep (TF32 M=512/4096, 3xTF32, elementwise tile), then the VAD's spill patches A/B
source .gpu-bundle/setup.sh >/dev/null 2>&1
nvidia-smi --query-gpu=name --format=csv,noheader
T0=$(date +%s); left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
N=14
for i in $(seq 0 $((N-1))); do timeout 200 python3 $(dirname "$0")/sweep.py --warm $i $N > $OUT/warm$i.log 2>&1 & done; wait
echo "warm done at $(( $(date +%s) - T0 )) s"; grep -h FAIL $OUT/warm*.log | head
timeout $(( $(left) - 240 )) python3 $(dirname "$0")/sweep.py --time $OUT/sweep.json > $OUT/sweep.log 2>&1
echo "sweep rc=$? at $(( $(date +%s) - T0 )) s"; tail -2 $OUT/sweep.log
timeout $(( $(left) - 5 )) python3 $(dirname "$0")/vad_ab.py $OUT/vad_ab.json > $OUT/vad_ab.log 2>&1
echo "vad_ab rc=$? at $(( $(date +%s) - T0 )) s"; cut -c1-220 $OUT/vad_ab.log | tail -9
