#!/usr/bin/env bash
# One short device run for a session that is lent a GPU (see the `device` tool's README):
# the CUDA-marked tests, the CPU suite's core files on the GPU machine, and a real recorded run
# of each demo scenario on the GPU (NVML/GPM sampling included), and the overhead on the GPU.
# Not yet run on a GPU.
#
# From the repo root on this machine, once (the device image lacks plotly):
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 --platform any -d .whl plotly==6.3.0 narwhals
# then call the device tool with: command "bash scripts/gpu_check.sh", carry [".whl"].
# Results land in $OUT (at most 8 files come back): the logs and a tarball of the runs.
set -uo pipefail
OUT=${OUT:-/tmp/amprobe-gpu-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
} > "$OUT/env.txt" 2>&1
# 1. CUDA-marked tests, then the collector tests (no dash/selenium needed for these files)
python3 -m pytest -q -m cuda -p no:cacheprovider tests 2>&1 | tail -40 > "$OUT/cuda_tests.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_attach.py tests/test_numerics_collector.py \
    tests/test_compute_collector.py tests/test_runtime.py tests/test_nvml.py tests/test_reliability.py \
    2>&1 | tail -40 > "$OUT/core_tests.txt"
# 2. real recordings on the GPU, named by origin
python3 sample_runs/generate.py --device cuda --prefix h200- --out /tmp/gpu_runs > "$OUT/record.txt" 2>&1
for run in /tmp/gpu_runs/*; do
    python3 -m amprobe diagnose "$run" --verbose >> "$OUT/record.txt" 2>&1
done
tar -czf "$OUT/gpu_runs.tgz" -C /tmp/gpu_runs . 2>> "$OUT/record.txt"
# 3. overhead on the GPU, wall-clock per block between device synchronizes
timeout 300 python3 benchmarks/bench_overhead_device.py --device cuda > "$OUT/overhead.txt" 2>&1
timeout 300 python3 benchmarks/bench_overhead_device.py --device cuda --fp16 >> "$OUT/overhead.txt" 2>&1
echo "done: $(ls "$OUT")"
