#!/usr/bin/env bash
# GPU checks for the expert hierarchy, as one command (< 10 minutes on one NVIDIA GPU):
#   1. the backend equality tests (fused / offload / hybrid vs cpu) on the real CUDA accelerator,
#   2. the SlotCache Triton kernel against its torch reference on CUDA tensors,
#   3. the sync-free decode kernels (zero-copy fills from pinned host memory, slot-id GEMVs)
#      against their references, and offload/hybrid decode through them on CUDA,
#   4. the prefill-overlap benchmark (double buffering on vs off).
# Usage, from the repository root, with the project installed in .venv (CUDA torch):
#   bash tests/gpu/check.sh [OUTDIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-/tmp/ft-gpu-check}
mkdir -p "$out"
py=${PYTHON:-.venv/bin/python}
"$py" -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.cuda.get_device_name())"
FT_TEST_ACCELERATOR=cuda "$py" -m pytest -q tests/test_moe_backends.py tests/test_slot_cache.py 2>&1 | tee "$out/tests.log"
# its own process: it must import triton without the interpreter
FT_TEST_ACCELERATOR=cuda "$py" -m pytest -q tests/test_moe_decode_kernels.py 2>&1 | tee "$out/decode_kernels.log"
"$py" tests/bench/bench_prefill_overlap.py --accelerator cuda 2>&1 | tee "$out/prefill_overlap.txt"
