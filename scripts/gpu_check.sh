#!/usr/bin/env bash
# GPU check for issue 3 (placement), prepared for a lent device machine.
#
# Run from the repository root, e.g. through the device tool:
#     bash scripts/gpu_check.sh
# It needs no network: the venv reuses the machine's CUDA torch (--system-site-packages) and the
# project is installed without dependencies. Everything it writes lands under $OUT (at most
# 8 files, two folders deep), or runs/gpu_check when OUT is unset:
#     $OUT/env.txt                 GPU, driver, torch
#     $OUT/gpu_tests.log           pytest -m gpu (CUDA stores and the plane on cuda)
#     $OUT/plane_storage.log       tests/plane tests/storage with CUDA present
#     $OUT/bench.log               conduit bench placement (table + progress)
#     $OUT/bench/placement.json    the benchmark's JSON
#     $OUT/bench/placement.png     the Fig. 12-style plot
# Knobs (environment): BENCH_ARGS (extra flags for the bench, default "--max-buffer-gb 4
# --shards 2"), QUICK=1 (smoke run: --quick bench, only the GPU tests), PYTHON (interpreter),
# SKIP_VENV=1 (use PYTHON as is, with PYTHONPATH=src).
set -uo pipefail
OUT=${OUT:-runs/gpu_check}
mkdir -p "$OUT/bench"
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
VENV=${VENV:-/tmp/conduit-gpu-venv}
status=0

: >"$OUT/env.txt"
if [ "${SKIP_VENV:-0}" = "1" ]; then
    echo "== using $PY as is (SKIP_VENV=1)"
    VPY="$PY"
    export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
else
    echo "== venv"
    if [ ! -x "$VENV/bin/python" ]; then
        "$PY" -m venv --system-site-packages "$VENV" || exit 2
    fi
    VPY="$VENV/bin/python"
    if ! "$VPY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
            2>>"$OUT/env.txt"; then
        echo "pip install failed; falling back to PYTHONPATH=src" | tee -a "$OUT/env.txt"
        export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
{
    nvidia-smi -L 2>&1 || echo "nvidia-smi: not available"
    "$VPY" - <<'PY'
import torch, sys
print("python", sys.version.split()[0], "torch", torch.__version__,
      "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    free, total = torch.cuda.mem_get_info(i)
    print(f"cuda:{i}", torch.cuda.get_device_name(i), f"free {free/2**30:.1f} / {total/2**30:.1f} GiB")
PY
} >>"$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

echo "== pytest -m gpu"
"$VPY" -m pytest -m gpu -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

if [ "${QUICK:-0}" != "1" ]; then
    echo "== tests/plane tests/storage with CUDA present"
    "$VPY" -m pytest tests/plane tests/storage -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/plane_storage.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
fi

echo "== conduit bench placement"
if [ "${QUICK:-0}" = "1" ]; then
    bench_args="--quick"
else
    bench_args=${BENCH_ARGS:---max-buffer-gb 4 --shards 2}
fi
# shellcheck disable=SC2086
"$VPY" -m conduit.cli bench placement $bench_args --out "$OUT/bench" 2>&1 | tee "$OUT/bench.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

echo "== done (status $status); outputs under $OUT"
exit $status
