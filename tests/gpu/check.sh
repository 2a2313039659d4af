#!/usr/bin/env bash
# GPU checks, one command for a bare GPU machine lent for minutes (no network): Python 3.12 with
# CUDA torch, Triton, numpy, grpcio and tokenizers preinstalled; the other wheels come from .whl/
# (run tests/gpu/fetch_wheels.sh on a machine with network first). The first run must be the
# informative one: the GPU-only probes run first, the broad pytest files last.
#
# Budget: each step has its own limit; they add up to 450 s, the deadline (DEADLINE_S, counted
# from the start), so every step gets its whole limit even when each before it runs to its own
# (less 5 s for each one killed at its limit: the kill's grace). A step never runs past the
# deadline; one that would start with under 10 s left is skipped and listed. The last steps (class "broad") may also use what earlier steps left
# unused, all but the limits of the steps after them. Worst case DEADLINE_S + 5 s: 7.6 minutes,
# the machine's start-up apart. Steps (limits in s):
#   setup   cuda 10       torch's CUDA device, nvidia-smi (no device: the GPU steps are skipped)
#           install 25    the wheels into OUT/site (pip --no-index --no-deps --target)
#           env 10        versions against pyproject's bounds: tests/gpu/env_check.py where the
#                         checkout has it (a mismatch fails the step, the run goes on; STOP_ON_ENV=1
#                         stops it), else the versions printed (metadata only: about a second)
#           build 50      ftnative and ftdense (tests/gpu/build_native.py: both at once, every
#                         core); the Python packages are linked into OUT/site, not copied
#           import 10     freetokend, ftctl, ftkernels, ftnative, ftdense, transformers, hypothesis
#                         from OUT/site (python -P: not the checkout's root)
#   gpu     kernels 60    (a) the Triton kernels at production shapes against torch references
#                         on the GPU, trimmed set, new checks stop at 45 s (kernels_at_scale.py)
#           slotstress 15  (a) the slot-cache kernel (its barrier on the step / visit counters)
#                         against its reference every step of up to 1000 decode steps at 2000
#                         and 6144 slots; none starts 8 s into the probe, the count that ran is said
#                         (probes.py slotstress; right after kernels: its compiles are cached)
#           sync 30       (b) fused and offload decode steps' forward passes under
#                         torch.cuda.set_sync_debug_mode("error"), tiny qwen3_moe and the
#                         built-in model (tests/gpu/probes.py sync)
#           prefill 35    (c) a prefill copy list held for the copy stream (fill_rows'
#                         record_stream: the list dropped and its memory rewritten while the
#                         copy stream is stalled; also captured in a CUDA graph), then offload
#                         with 2 x E slots, 5 prompts of 2048 tokens streaming each layer's
#                         experts with overlap: logits against fused (probes.py copylist prefill)
#           memcheck 25   (c) compute-sanitizer --tool memcheck on a tiny model's fused and
#                         offload runs (probes.py tiny-run); skipped where the tool is missing
#           memory 27     (d) the VRAM watcher: 4 GiB allocated and freed, torch_unallocated and
#                         NVML's free agree, no shrink with the low edge just above NVML's free;
#                         then peak max_memory_reserved through graph capture and a batch-8
#                         decode of offload (graphs on: fills and their record_stream captured)
#                         against what SlotBudget left beside the slots (probes.py vram memory)
#           zerocopy 18   (e) pinning.py's refused register (712) / unregister (713) leave no CUDA
#                         error set (torch op, Triton kernel, sync after); zero-copy fills after
#                         unload + reload at the same host address, the CUDA error state clean
#                         after (probes.py pinerrors zerocopy)
#           park 20       (f) park / unpark of fused mxfp4 and q8_0 experts with CUDA graphs on
#                         (probes.py park)
#           hybrid 25     (g) hybrid at B_P / B_H = 1/4 against fused, and a timeline of its
#                         CPU share overlapping its GPU share (probes.py hybrid; OUT/hybrid_trace.json)
#   after   graphs 35     decode with CUDA graphs on vs off, fused and offload (graphs_check.py);
#                         offload with half the experts in slots captures its fills (fill_rows,
#                         record_stream on the copy list) in the graphs: a failed capture fails it
#           bench 25      the fused / offload / hybrid / cpu table (bench_backends.py), on a
#                         1-layer model of Qwen3-30B-A3B geometry (written once, shared with
#                         graphs); rows print as they finish, so a cut table keeps its first rows
#   broad   backends 10   tests/test_moe_backends.py on CUDA (every family, token-equal to cpu),
#                         tests/test_disk_tier_device.py on CUDA (offload/hybrid with experts read
#                         from the file into RAM slots and filled from there: tokens equal to the
#                         pool resident, the fills' overwrite guard under a real copy stream)
#           kernel_tests 5  test_slot_cache.py, test_moe_decode_kernels.py (Hypothesis: 8
#                         examples a property that sets no count of its own, hypothesis_gpu.py)
#           placement 5   test_dense_placement.py, test_device_resize.py (not the fake card)
#           grammar 5     test_server_parsers.py: a grammar's mask on CUDA logits
#           triton 5      FREETOKEN_ATTENTION_KERNEL=triton: paged attention, DeltaNet, backends
# Every step writes OUT/<step>.log; OUT/summary.txt gets one line a step as it finishes: PASS,
# FAIL or SKIP, its time, and a verdict (the log's VERDICT: line, or its last line).
# Usage, from anywhere:  bash tests/gpu/check.sh [--dry-run] [OUT]   (default /tmp/ft-gpu-check)
#   --dry-run (or DRY_RUN=1): print the plan (steps, order, limits, their sum against the
#   deadline, what this machine would skip) and run nothing.
#   PYTHON=python3  WHEELS=.whl  DEADLINE_S=450  STOP_ON_ENV=0
#   (the wheels' Python version, .whl/python-version, must be the interpreter's)
set -uo pipefail
cd "$(dirname "$0")/../.." || exit 1
root=$(pwd)
dry=${DRY_RUN:-0}
if [ "${1:-}" = "--dry-run" ]; then
    dry=1
    shift
fi
out=$(realpath -m "${1:-/tmp/ft-gpu-check}")
py=${PYTHON:-python3}
wheels=${WHEELS:-.whl}
site="$out/site"
deadline_s=${DEADLINE_S:-450}
start=$(date +%s)
status=0

# ---- the plan: name, class, limit (s), what; run in this order ----------------------------
names=()
classes=()
limits=()
whats=()
plan() {
    names+=("$1")
    classes+=("$2")
    limits+=("$3")
    whats+=("$4")
}
plan cuda setup 10 "torch's CUDA device, nvidia-smi"
plan install setup 25 "wheels from $wheels into OUT/site"
plan env setup 10 "versions against pyproject's bounds (tests/gpu/env_check.py, else printed)"
plan build setup 50 "ftnative + ftdense, both at once on every core (build_native.py)"
plan import setup 10 "the project's packages and extensions import"
plan kernels gpu 60 "(a) kernels at production shapes vs torch references (kernels_at_scale.py)"
plan slotstress gpu 15 "(a) slot-cache kernel vs reference, <=1000 decode steps at 2000 and 6144 slots"
plan sync gpu 30 "(b) fused/offload decode forward passes under sync debug mode 'error'"
plan prefill gpu 35 "(c) copy list held for the copy stream; offload 2xE slots, 5 x 2048 tokens vs fused"
plan memcheck gpu 25 "(c) compute-sanitizer memcheck on a tiny model run"
plan memory gpu 27 "(d) VRAM watcher vs torch/NVML; peak reserved (graphs, batch-8 decode) vs SlotBudget"
plan zerocopy gpu 18 "(e) refused (un)register leaves no CUDA error; zero-copy fill after reload"
plan park gpu 20 "(f) park/unpark of fused quantized experts with CUDA graphs"
plan hybrid gpu 25 "(g) hybrid B_P/B_H = 1/4 vs fused, CPU/GPU overlap timeline"
plan graphs after 35 "CUDA graphs on vs off (graphs_check.py)"
plan bench after 25 "fused/offload/hybrid/cpu table (bench_backends.py)"
plan backends broad 10 "test_moe_backends.py, test_disk_tier_device.py on CUDA"
plan kernel_tests broad 5 "test_slot_cache.py, test_moe_decode_kernels.py"
plan placement broad 5 "test_dense_placement.py, test_device_resize.py"
plan grammar broad 5 "test_server_parsers.py: grammar mask on CUDA logits"
plan triton broad 5 "triton attention: paged attention, DeltaNet, backends"
total=0
for l in "${limits[@]}"; do total=$(( total + l )); done

sanitizer() {
    local s
    s=$(command -v compute-sanitizer 2> /dev/null)
    if [ -z "$s" ]; then
        for s in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer; do
            [ -x "$s" ] && break
        done
    fi
    [ -x "${s:-}" ] && echo "$s"
}

# ---- dry run -------------------------------------------------------------------------------
if [ "$dry" = 1 ]; then
    echo "PLAN tests/gpu/check.sh: ${#names[@]} steps in this order, limits in seconds"
    for i in "${!names[@]}"; do
        printf '  %2d  %-13s %-6s %4d  %s\n' "$(( i + 1 ))" "${names[$i]}" "${classes[$i]}" \
            "${limits[$i]}" "${whats[$i]}"
    done
    if [ "$total" -le "$deadline_s" ]; then
        echo "TOTAL $total s of limits within the $deadline_s s deadline (DEADLINE_S)"
    else
        echo "TOTAL $total s of limits OVER the $deadline_s s deadline (DEADLINE_S): the last steps would be cut"
    fi
    skips=()
    timeout 30 "$py" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)" 2> /dev/null
    case $? in
        0) ;;
        3) skips+=("no CUDA device: every gpu, after and broad step (install, env, build, import run)") ;;
        *) skips+=("no torch in $py: cuda fails, so every step after import is skipped") ;;
    esac
    [ -n "$(sanitizer)" ] || skips+=("no compute-sanitizer (PATH, /usr/local/cuda*/bin): memcheck")
    [ -f tests/gpu/env_check.py ] || skips+=("no tests/gpu/env_check.py: env prints the versions instead")
    [ -f "$wheels/requirements.txt" ] || skips+=("no $wheels/requirements.txt: install fails (run tests/gpu/fetch_wheels.sh)")
    command -v nvidia-smi > /dev/null || skips+=("no nvidia-smi: cuda prints torch's view only")
    if [ ${#skips[@]} -eq 0 ]; then
        echo "WOULD SKIP nothing on this machine"
    else
        for s in "${skips[@]}"; do echo "WOULD SKIP $s"; done
    fi
    echo "OUT would be $out"
    exit 0
fi

mkdir -p "$out"
: > "$out/summary.txt"

note() { echo "$*" | tee -a "$out/summary.txt"; }

# the limits of the steps after step $1 (by name), for the broad steps' share of unused time
limits_after() {
    local i sum=0 seen=0
    for i in "${!names[@]}"; do
        [ $seen = 1 ] && sum=$(( sum + limits[i] ))
        [ "${names[$i]}" = "$1" ] && seen=1
    done
    echo $sum
}

# step NAME LIMIT CLASS CMD...: runs CMD with its limit (at most what the deadline leaves; a
# broad step may take what earlier steps left unused), logs to OUT/NAME.log, appends the
# verdict to OUT/summary.txt, never stops the script
step() {
    local name=$1 limit=$2 class=$3 rc t0 left spare verdict
    shift 3
    t0=$(date +%s)
    left=$(( start + deadline_s - t0 ))
    if [ "$left" -lt 10 ]; then
        note "SKIP  $name: under 10 s left before the ${deadline_s} s deadline"
        status=1
        return 1
    fi
    if [ "$class" = broad ]; then
        spare=$(( left - $(limits_after "$name") - 5 ))
        [ "$spare" -gt "$limit" ] && limit=$spare
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    echo "== $name (limit $limit s)"
    timeout --kill-after=5 "$limit" "$@" > "$out/$name.log" 2>&1
    rc=$?
    tail -n 15 "$out/$name.log"
    verdict=$(grep -a '^VERDICT: ' "$out/$name.log" | tail -n 1 | cut -c10-)
    [ -n "$verdict" ] || verdict=$(grep -av '^\s*$' "$out/$name.log" | tail -n 1)
    verdict=${verdict:0:240}
    [ -n "$verdict" ] && verdict=": $verdict"
    if [ $rc -eq 0 ]; then
        note "PASS  $name ($(( $(date +%s) - t0 )) of $limit s)$verdict"
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "(timed out after $limit s)" >> "$out/$name.log"
        note "FAIL  $name (timed out at $limit s)$verdict"
        status=1
    else
        note "FAIL  $name (exit $rc, $(( $(date +%s) - t0 )) s)$verdict; see $out/$name.log"
        status=1
    fi
    return $rc
}

# the limit of a planned step
limit_of() {
    local i
    for i in "${!names[@]}"; do
        if [ "${names[$i]}" = "$1" ]; then
            echo "${limits[$i]}"
            return
        fi
    done
    echo 0
}

# -v: a killed step's log still says which tests passed
pytest=("$py" -m pytest -v -p no:cacheprovider -o addopts="" -rfE --durations=5)
probes=("$py" tests/gpu/probes.py --work "$out/models" --out "$out")
bench_model="$out/models/qwen3-30b-geometry"
cuda=0

run() {  # run NAME: the planned step NAME
    local name=$1 lim class s
    lim=$(limit_of "$name")
    class=setup
    for s in "${!names[@]}"; do [ "${names[$s]}" = "$name" ] && class=${classes[$s]}; done
    case $name in
        cuda)
            if step cuda "$lim" setup "$py" - <<'EOF'
import platform, subprocess, sys
print("python", sys.version.split()[0], platform.machine())
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "devices", torch.cuda.device_count())
if not torch.cuda.is_available():
    print("VERDICT: no CUDA device: the GPU steps are skipped")
    sys.exit(3)
name, cap = torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0)
free, total = torch.cuda.mem_get_info()
try:
    print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=5).stdout)
except (OSError, subprocess.TimeoutExpired) as e:
    print("nvidia-smi:", e)
print(f"VERDICT: {name}, sm_{cap[0]}{cap[1]}, {free >> 20} of {total >> 20} MiB free")
EOF
            then
                cuda=1
            fi
            ;;
        install)
            local pyver
            pyver=$(timeout 10 "$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
            if [ ! -f "$wheels/requirements.txt" ]; then
                note "FAIL  install: no $wheels/requirements.txt (run tests/gpu/fetch_wheels.sh where there is network)"
                status=1
                return
            fi
            if [ -f "$wheels/python-version" ] && [ "$(cat "$wheels/python-version")" != "$pyver" ]; then
                note "FAIL  install: $wheels holds wheels for Python $(cat "$wheels/python-version"), $py is $pyver (PYVER=$pyver bash tests/gpu/fetch_wheels.sh)"
                status=1
                return
            fi
            rm -rf "$site"
            step install "$lim" setup "$py" -m pip install -q --no-compile --no-index --no-deps \
                --find-links "$wheels" --target "$site" -r "$wheels/requirements.txt"
            ;;
        env)
            local rc=0
            if [ -f tests/gpu/env_check.py ]; then
                step env "$lim" setup "$py" tests/gpu/env_check.py || rc=$?
            else
                step env "$lim" setup "$py" - <<'EOF' || rc=$?
import platform, sys
print("python", sys.version.split()[0], platform.machine())
for m in ("torch", "triton", "numpy", "grpc", "tokenizers", "transformers", "safetensors",
          "xgrammar", "hypothesis", "pytest", "setuptools", "pybind11"):
    try:
        mod = __import__(m)
        print(m, getattr(mod, "__version__", "?"))
    except Exception as e:  # noqa: BLE001
        print(m, "MISSING:", e)
print("VERDICT: versions printed (tests/gpu/env_check.py not in this checkout: no bounds checked)")
EOF
            fi
            if [ $rc -ne 0 ] && [ "${STOP_ON_ENV:-0}" = 1 ]; then
                note "STOP  env: version mismatch and STOP_ON_ENV=1"
                exit 1
            fi
            ;;
        build)
            # the packages: links into the checkout (setup.py's layout), nothing copied
            mkdir -p "$site"
            ln -sfn "$root/daemon" "$site/freetokend"
            ln -sfn "$root/ctl" "$site/ftctl"
            ln -sfn "$root/kernels" "$site/ftkernels"
            step build "$lim" setup "$py" tests/gpu/build_native.py "$site" "$out/build"
            ;;
        import)
            step import "$lim" setup "$py" -P -c "import freetokend, ftctl, ftkernels, ftnative, ftdense, transformers, hypothesis; print('VERDICT: imports ok:', ', '.join(m.__name__ + ' ' + m.__file__ for m in (freetokend, ftnative, ftdense)))"
            ;;
        kernels)
            step kernels "$lim" gpu "$py" tests/gpu/kernels_at_scale.py --budget $(( lim - 15 ))
            ;;
        slotstress)  # no decode step starts after lim - 7 s (start-up and exit: the rest)
            step slotstress "$lim" gpu "${probes[@]}" slotstress --budget $(( lim - 7 ))
            ;;
        prefill)  # the copy-list hold first: small, and its verdict stands if prefill is cut
            step prefill "$lim" gpu "${probes[@]}" copylist prefill
            ;;
        memory)  # the watcher's 4 GiB is given back (empty_cache) before memory sizes the card
            step memory "$lim" gpu "${probes[@]}" vram memory
            ;;
        zerocopy)
            step zerocopy "$lim" gpu "${probes[@]}" pinerrors zerocopy
            ;;
        sync | park | hybrid)
            step "$name" "$lim" gpu "${probes[@]}" "$name"
            ;;
        memcheck)
            local san
            san=$(sanitizer)
            if [ -z "$san" ]; then
                note "SKIP  memcheck: no compute-sanitizer (not in PATH nor /usr/local/cuda*/bin)"
                return
            fi
            step memcheck "$lim" gpu env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$san" --tool memcheck \
                --error-exitcode 3 --print-limit 20 "${probes[@]}" tiny-run
            ;;
        graphs)  # (writes the checkpoint bench reuses)
            step graphs "$lim" after "$py" tests/gpu/graphs_check.py --layers 1 \
                --model "$bench_model" --out "$out/graphs.txt"
            ;;
        bench)
            step bench "$lim" after "$py" tests/gpu/bench_backends.py --layers 1 \
                --model "$bench_model" --out "$out/bench.txt"
            ;;
        backends)
            step backends "$lim" "$class" "${pytest[@]}" tests/test_moe_backends.py \
                tests/test_disk_tier_device.py
            ;;
        kernel_tests)
            step kernel_tests "$lim" "$class" env PYTHONPATH="$root/tests/gpu:$PYTHONPATH" \
                "${pytest[@]}" -p hypothesis_gpu --hypothesis-profile=gpu \
                tests/test_slot_cache.py tests/test_moe_decode_kernels.py
            ;;
        placement)
            step placement "$lim" "$class" "${pytest[@]}" tests/test_dense_placement.py \
                tests/test_device_resize.py -k "not fake_card"
            ;;
        grammar)
            step grammar "$lim" "$class" "${pytest[@]}" tests/test_server_parsers.py -k "surrogate and cuda"
            ;;
        triton)
            step triton "$lim" "$class" env FREETOKEN_ATTENTION_KERNEL=triton "${pytest[@]}" \
                tests/test_paged_attention.py tests/test_deltanet_kernel.py tests/test_moe_backends.py
            ;;
        *)
            note "FAIL  $name: no such step in check.sh"
            status=1
            ;;
    esac
}

echo "plan: ${#names[@]} steps, $total s of limits, deadline $deadline_s s; output in $out"
for i in "${!names[@]}"; do
    name=${names[$i]}
    if [ "$name" = install ] || [ "$name" = cuda ]; then
        run "$name"
        [ "$name" = install ] && export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
        continue
    fi
    if [ "${classes[$i]}" != setup ] && [ $cuda = 0 ]; then
        note "SKIP  $name: no CUDA device (see $out/cuda.log)"
        continue
    fi
    [ "${classes[$i]}" = gpu ] && export FT_TEST_ACCELERATOR=cuda && unset TRITON_INTERPRET
    run "$name"
done
note "output in $out ($(( $(date +%s) - start )) s of the $deadline_s s deadline)"
exit $status
