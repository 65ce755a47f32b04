#!/usr/bin/env bash
# The checks that need a GPU, as one script for a lent GPU machine (CI has none).
#
# Runs the CUDA staging test, the NCCL-only save/load test (against a moto server)
# and bench/bench_cuda.py, under the machine's own python3 and torch. Python
# packages that machine lacks travel as wheels in .whl/ (see docs/contributing.md);
# objckpt itself is used from the checkout. Logs and the bench's JSON go to $OUT
# (or ./gpu-check-out).
set -uo pipefail
out=${OUT:-gpu-check-out}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1
export GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false
nvidia-smi -L
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
# From a checkout objckpt's pytest plugin (the store fixtures) has no entry point.
plugin=()
python3 -m pip show -q objckpt >/dev/null 2>&1 || plugin=(-p objckpt.testing.plugin)
rc=0
timeout "${TESTS_TIMEOUT:-300}" python3 -m pytest ${plugin[@]+"${plugin[@]}"} -p no:cacheprovider \
    -q -rA tests/pipeline/test_stage.py tests/distributed/test_nccl.py 2>&1 | tee "$out/tests.log" || rc=1
timeout "${BENCH_TIMEOUT:-240}" python3 bench/bench_cuda.py --size-mib ${SIZES:-1024 2048} \
    --out "$out/bench_cuda.json" 2>&1 | tee "$out/bench_cuda.log" || rc=1
exit $rc
