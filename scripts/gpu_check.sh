#!/usr/bin/env bash
# One call on a lent GPU (the device tool): the CUDA tests, then live migration
# between two engines in one process on Llama-3-8B's shape with random weights
# (ferry bench migration-local: pinned staging on a side stream vs the plain
# path). Wheels the GPU image lacks travel in .whl/ (see docs/results/LOG.md,
# "On a lent GPU"). Results land in $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/gpu_out}
PY=${PY:-python3}
mkdir -p "$OUT"
if [ -d .whl ]; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())" | tee -a "$OUT/gpu.txt"
[ "${TESTS_S:-180}" = 0 ] || timeout "${TESTS_S:-180}" $PY -m pytest -q -p no:cacheprovider -m gpu \
  tests/instance/migration/test_cuda.py tests/instance/engine/test_model_loading.py 2>&1 | tee "$OUT/tests.log"
timeout "${BENCH_S:-330}" $PY -m ferry bench migration-local --model "${MODEL:-llama-3.1-8b}" --device "${DEVICE:-cuda}" \
  --dtype "${DTYPE:-bfloat16}" --lengths "${LENGTHS:-1024,8192,32768}" --runs "${RUNS:-2}" --out-tokens "${OUT_TOKENS:-256}" \
  --json "$OUT/migration_local.json" 2>&1 | tee "$OUT/bench.log"
