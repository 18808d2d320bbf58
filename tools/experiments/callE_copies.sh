#!/bin/bash
# E: decode attention's three copies at batch 1 (gpt2 tok/s; GLM-ASR's step where A left /tmp/first-result/asr)
source .gpu-bundle/setup.sh >/dev/null 2>&1
T0=$(date +%s)
timeout ${BUDGET:-570} python3 $(dirname "$0")/copies.py $OUT/copies.json > $OUT/copies.log 2>&1
echo "copies rc=$? at $(( $(date +%s) - T0 )) s"; cut -c1-200 $OUT/copies.log | tail -12
