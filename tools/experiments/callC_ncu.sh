#!/bin/bash
# C: ncu of batch-1 decode steps (gpt2; GLM-ASR where A left /tmp/first-result/asr), per kernel
source .gpu-bundle/setup.sh >/dev/null 2>&1
T0=$(date +%s); left() { echo $(( ${BUDGET:-570} - ($(date +%s) - T0) )); }
mkdir -p $OUT/ncu
SEC="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
for mode in gpt asr; do
  L=$(left); [ $L -lt 40 ] && break
  [ $mode = asr ] && [ ! -f /tmp/first-result/asr/config.json ] && break
  timeout $(( L - 15 )) ncu --profile-from-start off --clock-control none --graph-profiling node $SEC -f -o $OUT/ncu/$mode python3 $(dirname "$0")/prof.py $mode > $OUT/ncu/$mode.log 2>&1
  echo "ncu $mode rc=$? at $(( $(date +%s) - T0 )) s"; tail -3 $OUT/ncu/$mode.log
  [ -f $OUT/ncu/$mode.ncu-rep ] && ncu --import $OUT/ncu/$mode.ncu-rep --csv --page details > $OUT/ncu/$mode-details.csv 2>&1
  [ $(stat -c %s $OUT/ncu/$mode.ncu-rep 2>/dev/null || echo 0) -gt 20000000 ] && rm -f $OUT/ncu/$mode.ncu-rep
done
echo "done at $(( $(date +%s) - T0 )) s"
