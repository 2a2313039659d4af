#!/usr/bin/env bash
# GPU checks for the expert hierarchy, one command for a bare GPU machine (no network): Python
# 3.12 with CUDA torch, Triton, numpy, grpcio and tokenizers preinstalled; the other wheels come
# from .whl/ (run tests/gpu/fetch_wheels.sh on a machine with network first). Under 8 minutes:
# each step has its own limit and none may run past a global deadline (DEADLINE_S, default 420 s
# from the start; a step that would start with under 20 s left is skipped and listed), so the
# worst case is DEADLINE_S + 10 s (the last step's kill grace) + 30 s (the CUDA probe): 460 s.
#   0. install the wheels (--no-index) and the project with its native extensions into OUT/site
#   1. the backend equality tests (fused / offload / hybrid vs cpu, token-equal) on real CUDA,
#      with the dense part, KV pool and sampling on the GPU (engine/placement.py): every family,
#      logits within tolerance, resizes mid-decode; a grammar's mask on CUDA logits (grammar)
#   2. the Triton kernels against their references: pytest shapes on CUDA tensors, then
#      production shapes (tests/gpu/kernels_at_scale.py); the paged decode attention and the
#      Gated DeltaNet decode step also inside the models (backends_triton)
#   3. decode with CUDA graphs on vs off (engine/graphs.py): fused and offload, batches 1 and 3,
#      the same greedy tokens and both tok/s (tests/gpu/graphs_check.py)
#   4. a decode/prefill table: fused vs offload vs hybrid, cache capped at 8 and 24 GiB cards, on
#      a random model of Qwen3-30B-A3B layer geometry (tests/gpu/bench_backends.py)
# Every step runs whatever the previous one gave; each writes OUT/<step>.log, and OUT/summary.txt
# lists the steps with their status. Without a CUDA device it installs, then skips steps 1-4.
# Usage, from anywhere:  bash tests/gpu/check.sh [OUT]     (PYTHON=python3 by default; the
# wheels' Python version, .whl/python-version, must be the interpreter's: fetch them with PYVER)
set -uo pipefail
cd "$(dirname "$0")/../.."
out=$(realpath -m "${1:-/tmp/ft-gpu-check}")
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
site="$out/site"
deadline_s=${DEADLINE_S:-420}
mkdir -p "$out"
: > "$out/summary.txt"
status=0
start=$(date +%s)

note() { echo "$*" | tee -a "$out/summary.txt"; }

# step NAME TIMEOUT_S CMD...: runs with a time limit (at most what the deadline leaves), logs to
# OUT/NAME.log, never stops the script
step() {
    local name=$1 limit=$2 rc t0 left
    shift 2
    t0=$(date +%s)
    left=$(( start + deadline_s - t0 ))
    if [ "$left" -lt 20 ]; then
        note "SKIP  $name: under 20 s left before the ${deadline_s} s deadline"
        status=1
        return 1
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s)"
    timeout --kill-after=10 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 25 "$out/$name.log"
    if [ $rc -eq 0 ]; then
        note "PASS  $name ($(( $(date +%s) - t0 )) s)"
    else
        [ $rc -eq 124 ] && echo "(timed out after $limit s)" >> "$out/$name.log"
        note "FAIL  $name (exit $rc, $(( $(date +%s) - t0 )) s): see $out/$name.log"
        status=1
    fi
    return $rc
}

timeout --kill-after=5 60 "$py" - > "$out/env.txt" 2>&1 <<'EOF'
import platform, sys
print("python", sys.version.split()[0], platform.machine())
for m in ("torch", "triton", "numpy", "grpc", "tokenizers"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING:", e)
import torch
print("cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if torch.cuda.is_available():
    print(torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0))
EOF
cat "$out/env.txt"
command -v nvidia-smi > /dev/null && timeout 30 nvidia-smi >> "$out/env.txt" 2>&1

pyver=$(timeout 30 "$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# -- 0. install ------------------------------------------------------------------------------
if [ ! -f "$wheels/requirements.txt" ]; then
    note "FAIL  install: no $wheels/requirements.txt (run tests/gpu/fetch_wheels.sh where there is network)"
    exit 1
fi
if [ -f "$wheels/python-version" ] && [ "$(cat "$wheels/python-version")" != "$pyver" ]; then
    note "FAIL  install: $wheels holds wheels for Python $(cat "$wheels/python-version"), $py is $pyver (PYVER=$pyver bash tests/gpu/fetch_wheels.sh)"
    exit 1
fi
rm -rf "$site"
step install 90 "$py" -m pip install -q --no-compile --no-index --no-deps --find-links "$wheels" \
    --target "$site" -r "$wheels/requirements.txt"
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# the project itself (freetokend, ftctl, ftkernels) and the C++ extensions, built here
step build 240 "$py" -m pip install -q --no-compile --no-index --no-deps --no-build-isolation \
    --target "$site" .
step import 30 "$py" -c "import freetokend, ftctl, ftkernels, ftnative, ftdense, transformers, hypothesis; print('imports ok')"

if ! timeout 30 "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2> /dev/null; then
    note "SKIP  cuda steps: no CUDA device (torch.cuda.is_available() is False); install, build and import: see above"
    exit $status
fi

# -- 1..4 on the GPU ---------------------------------------------------------------------------
export FT_TEST_ACCELERATOR=cuda
unset TRITON_INTERPRET
pytest=("$py" -m pytest -q -p no:cacheprovider -o addopts="" --durations=10)
step backends 120 "${pytest[@]}" tests/test_moe_backends.py
step grammar 60 "${pytest[@]}" tests/test_server_parsers.py -k "surrogate and cuda"
step backends_triton 120 env FREETOKEN_ATTENTION_KERNEL=triton "${pytest[@]}" tests/test_moe_backends.py tests/test_paged_attention.py tests/test_deltanet_kernel.py
step placement 120 "${pytest[@]}" tests/test_dense_placement.py tests/test_device_resize.py -k "not fake_card"
step kernels 60 "${pytest[@]}" tests/test_slot_cache.py tests/test_moe_decode_kernels.py
step kernels_at_scale 60 "$py" tests/gpu/kernels_at_scale.py
# (writes the 4-layer checkpoint bench reuses)
step graphs 90 "$py" tests/gpu/graphs_check.py --layers 4 --out "$out/graphs.txt"
step bench 90 "$py" tests/gpu/bench_backends.py --layers 4 --out "$out/bench.txt"
note "output in $out ($(( $(date +%s) - start )) s)"
exit $status
