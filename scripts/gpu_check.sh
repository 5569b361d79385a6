#!/usr/bin/env bash
# GPU checks for a CUDA machine: `pytest -m gpu` and the TTFT-overlap benchmark with --device cuda.
# Logs go to $OUT (default ./gpu_out). Optional wheels/site archive in $WHEELS (default .whl, in the checkout, git-ignored via .git/info/exclude):
#   *.whl are installed with pip --no-deps into /tmp/site, fi_site.tar.gz (a pre-installed
#   flashinfer + tvm_ffi tree) is unpacked there; both are then put on PYTHONPATH.
#   On the lent H200/H100 image (torch 2.11+cu130, no registry) the wheels carried on 2026-11-26 were:
#   grpcio, grpcio-health-checking, protobuf, fastapi, starlette, uvicorn, pydantic, pydantic-core,
#   annotated-types, annotated-doc, typing-inspection, typing-extensions, opentelemetry-api,
#   configargparse, dnspython, xgrammar, pytest-asyncio, flashinfer-python 0.6.0, apache-tvm-ffi,
#   nvidia-cudnn-frontend (cp312 manylinux; 35 MiB together).
#   STAGES="decode tests bench fp8probe cli flashinfer" bash scripts/gpu_check.sh [benchmark flags, e.g. --quick]
# (decode: benchmarks/gpu_decode.py, CUDA graphs on and off on a Llama-3-8B-shaped model; each stage
# is bounded by its *_BUDGET_S so that one slow stage cannot eat the lease; GPU_TESTS narrows the tests)
set -o pipefail
OUT=${OUT:-gpu_out}
WHEELS=${WHEELS:-.whl}
mkdir -p "$OUT" /tmp/site
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
if [ -d "$WHEELS" ]; then
  ls "$WHEELS"/*.whl >/dev/null 2>&1 && $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target /tmp/site "$WHEELS"/*.whl
  [ -f "$WHEELS/fi_site.tar.gz" ] && tar -xzf "$WHEELS/fi_site.tar.gz" -C /tmp/site
  export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
else
  export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
fi
# flashinfer compiles its kernels on first use: only for this GPU's architecture, with every core
export FLASHINFER_WORKSPACE_BASE=/tmp/fi_ws MAX_JOBS=$(nproc)
export FLASHINFER_CUDA_ARCH_LIST=${FLASHINFER_CUDA_ARCH_LIST:-$($PY -c 'import torch; m,n=torch.cuda.get_device_capability(); print(f"{m}.{n}" + ("a" if m >= 9 else ""))')}
{
  date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  $PY -c 'import torch, grpc, google.protobuf as pb; print("torch", torch.__version__, "cuda", torch.version.cuda, "grpc", grpc.__version__, "protobuf", pb.__version__)'
  $PY -c 'import flashinfer; print("flashinfer", flashinfer.__version__)' 2>&1 | tail -1
  $PY -c 'import triton; print("triton", triton.__version__)' 2>&1 | tail -1
} 2>&1 | tee "$OUT/env.txt"
# the built-in tiny model is generated on first use; do it once before the tests start processes
$PY -c 'from pdserve.engine.builtin import default_model_dir as d; d("tiny"); d("bench")' 2>&1 | tail -2
# 1. everything but flashinfer (which JIT-compiles for minutes on first use), 2. the benchmark,
# 3. the CLI on cuda, 4. flashinfer last, bounded, so a slow compile cannot hide the rest
STAGES=${STAGES:-decode tests bench cli flashinfer}
stage() { [[ " $STAGES " == *" $1 "* ]]; }
if stage decode; then  # the decode/prefill figures against the device's limits (BENCHMARKS.md)
  timeout "${DECODE_BUDGET_S:-300}" $PY -m benchmarks.gpu_decode 2>&1 | tee "$OUT/gpu_decode.log"
  echo "gpu_decode rc=$?" | tee -a "$OUT/gpu_decode.log"
fi
if stage tests; then
  timeout "${TESTS_BUDGET_S:-900}" $PY -m pytest ${GPU_TESTS:-tests/gpu} -p no:cacheprovider -o addopts="" -m gpu -k "not flashinfer" -v -rs --timeout 300 2>&1 | tee "$OUT/pytest_gpu.log"
  echo "pytest rc=$?" | tee -a "$OUT/pytest_gpu.log"
fi
if stage bench; then
  timeout "${BENCH_BUDGET_S:-240}" $PY -m benchmarks.ttft_overlap --device cuda "$@" 2>&1 | tee "$OUT/ttft_overlap_cuda.log"
  echo "benchmark rc=$?" | tee -a "$OUT/ttft_overlap_cuda.log"
fi
if stage fp8probe; then  # the FP8 GEMM against its emulation, per shape (scripts/fp8_gemm_probe.py)
  timeout "${FP8_BUDGET_S:-120}" $PY -m scripts.fp8_gemm_probe 2>&1 | tee "$OUT/fp8_probe.log"
fi
if stage cli; then  # the CLI path on cuda, from flags and from the PDSERVE_* environment
  { $PY -m pdserve.cli generate --device cuda --attention-backend torch --max-tokens 8
    PDSERVE_DEVICE=cuda PDSERVE_ATTENTION_BACKEND=torch $PY -m pdserve.cli generate --max-tokens 8; } 2>&1 | tee "$OUT/generate_cuda.log"
fi
if stage flashinfer; then  # last and bounded: the first use JIT-compiles flashinfer's kernels
  timeout "${FLASHINFER_BUDGET_S:-330}" $PY -m pytest tests/gpu -p no:cacheprovider -o addopts="" -m gpu -k flashinfer -v -rs 2>&1 | tee "$OUT/pytest_flashinfer.log"
  echo "flashinfer pytest rc=$?" | tee -a "$OUT/pytest_flashinfer.log"
  # default backend on cuda (auto -> flashinfer), kernels already compiled by the tests above
  PDSERVE_DEVICE=cuda timeout 120 $PY -m pdserve.cli generate --max-tokens 8 \
    --model "$($PY -c 'from pdserve.engine.builtin import default_model_dir as d; print(d("bench"))')" 2>&1 | tee -a "$OUT/pytest_flashinfer.log"
fi
