#!/bin/bash
# D: the m4a row on a machine warm from A (its .gpu-bundle, /tmp installs and /tmp/first-result
# still there): carry .gpu-av (the PyAV wheel, 35 MB) and this folder only, not the 56 MB bundle
source .gpu-bundle/setup.sh >/dev/null 2>&1 || { echo "no bundle on the machine"; exit 1; }
python3 -m pip install -q --no-index --no-deps --target /tmp/gpu-av .gpu-av/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/gpu-av
python3 -c "import av; print('av', av.__version__)"
mkdir -p $OUT/m4a
timeout ${BUDGET:-560} python3 tools/first_result.py --out $OUT/m4a --cases long_file_60min_m4a > $OUT/m4a/log.txt 2>&1
echo rc=$?; tail -4 $OUT/m4a/log.txt | cut -c1-600
