#!/usr/bin/env bash
# All of Tessel's GPU work in one command, for a lent GPU machine (docs/benchmarks/gpu.md):
#
#   OUT=/some/folder bash tools/gpu_session.sh [STEP ...]      (from the repository root)
#
# STEP: info build test fp8 graphs overlap attention moe train kernels (default: all, in that order: the issues'
# GPU checks first, the long benchmarks last). Each step is time-boxed, a failing step does not stop the next ones,
# and the whole script keeps within $GPU_SESSION_BUDGET_S (default 500 s). A session has 15 minutes of
# device time in all, machine starts (a minute or more each) included, and no machine starts with under
# 4 minutes left: 500 s plus a start (about 40 s) leaves room for one shorter rerun of the steps that failed
# (`bash tools/gpu_session.sh build test`). A step gets min(its cap, time left) and is skipped when less
# than 20 s are left. The benchmark with no bound of its own (bench_kernels: torch.compile baselines of
# four ops at two sizes) runs last, with what is left, and without its torch.compile baselines when
# less than 240 s are left.
#
# Files written under $OUT (8, the device tool brings back at most 8):
#   session.log        this script's own output: machine, versions, each step's command, exit
#                      status, duration and the tail of its log, and a final summary
#   build.log          python3 setup.py build_ext --inplace (csrc/ extensions, CUDA parts with nvcc)
#   pytest_gpu.log     python3 -m pytest -v -m gpu -p no:cacheprovider --tb=short -rfs --durations=10 --continue-on-collection-errors tests/
#   train_step.log     tools/bench_train_step.py --device cuda --preset gpu-1b --compare-kernels --cuda-graph; its JSON
#                      results at the end of the same file
#   bench_fp8.log      tools/bench_fp8.py --device cuda: FP8 vs bf16 GEMMs (8B/70B layers), the host time to
#                      issue one linear per recipe (by function), and the gpu-1b train step per recipe with its
#                      kernels per step; its JSON results at the end of the same file; then one linear's
#                      kernel profile, and the gpu-1b step in 4 micro-batches with and without the weight cache,
#                      each side's kernels per step against its step time (--profile-step); then (step `graphs`)
#                      the gpu-1b step with each layer replayed from CUDA graphs (model.cuda_graph=layers, --cuda-graph)
#                      against the same sides eager, for none, tensorwise and delayed
#   bench_parallel.log four steps, one after another, each with its JSON at its end:
#                      overlap: tools/bench_overlap.py --gemm-overhead --device cuda: the ring's chunk GEMMs vs
#                      one GEMM at 8B shapes (one GPU: no multi-rank overlap; issue 17);
#                      attention: tools/bench_attention.py --device cuda: the ring's blocks (flash, explicit)
#                      vs SDPA over the whole sequence, 8B heads, bf16 (issue 18); attention_profile: the same
#                      blocks kernel by kernel (--profile-cp);
#                      moe: tools/bench_moe.py --ep '': grouped GEMM vs the expert loop vs dense, bf16, against
#                      the 8192^3 bf16 matmul (issue 19)
#   bench_kernels.log  tools/bench_kernels.py (GPU defaults)
#   bench_kernels.json its results
#
# Extra arguments: TRAIN_ARGS, FP8_ARGS and KERNELS_ARGS are appended to the benchmarks' command lines
# (e.g. KERNELS_ARGS=--no-compile when the torch.compile baselines do not fit in the time left).
set -u -o pipefail
export PYTHONUNBUFFERED=1

if [[ -z "${OUT:-}" ]]; then
    echo "gpu_session.sh: set OUT to the folder for the results (the device tool sets it)" >&2
    exit 2
fi
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 2
mkdir -p "$OUT" || exit 2
PY=${PYTHON:-python3}
BUDGET=${GPU_SESSION_BUDGET_S:-500}
TAIL_LINES=${TAIL_LINES:-40}
ALL_STEPS=(info build test fp8 graphs overlap attention moe train kernels)
STEPS=("$@")
[[ ${#STEPS[@]} -eq 0 ]] && STEPS=("${ALL_STEPS[@]}")
for s in "${STEPS[@]}"; do
    if [[ ! " ${ALL_STEPS[*]} " == *" $s "* ]]; then
        echo "gpu_session.sh: unknown step '$s'; steps are: ${ALL_STEPS[*]}" >&2
        exit 2
    fi
done
SUMMARY=()

wanted() { [[ " ${STEPS[*]} " == *" $1 "* ]]; }

# run_step NAME CAP_S LOG CMD...: CMD under `timeout`, its output in LOG, the tail echoed here.
run_step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local left=$((BUDGET - SECONDS))
    local limit=$((cap < left ? cap : left))
    if ((limit < 20)); then
        echo "== $name: skipped (${left} s left of the ${BUDGET} s budget)"
        SUMMARY+=("$name: skipped, no time left")
        return
    fi
    echo "== $name (time box ${limit} s): $*"
    local t0=$SECONDS rc=0
    echo "== $name: $*" >>"$log"
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1 || rc=$?  # appended: several steps may share a log
    local what="rc=$rc"
    ((rc == 124 || rc == 137)) && what="TIMED OUT after ${limit} s (rc=$rc)"
    echo "-- $name: $what, $((SECONDS - t0)) s; last lines of $(basename "$log"):"
    tail -n "$TAIL_LINES" "$log" | sed 's/^/   | /'
    SUMMARY+=("$name: $what, $((SECONDS - t0)) s")
}

# run_json_step NAME CAP_S LOG CMD...: run_step with `--json <temp file>` added, the JSON then appended to
# LOG. (A tool writing `--json /dev/stdout` opens the log afresh, truncating it: that erased the lines
# before each JSON in the first GPU session's logs.)
run_json_step() {
    local name=$1 cap=$2 log=$3
    shift 3
    local tmp="$OUT/.$name.json"
    rm -f "$tmp"
    run_step "$name" "$cap" "$log" "$@" --json "$tmp"
    if [[ -s $tmp ]]; then
        { echo "-- $name: JSON results"; cat "$tmp"; echo; } >>"$log"
    fi
    rm -f "$tmp"
}

session() {
    echo "tessel gpu_session $(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')" \
        "$(git status --porcelain 2>/dev/null | grep -q . && echo '(with uncommitted changes)')"
    echo "steps: ${STEPS[*]}; budget ${BUDGET} s; OUT=$OUT"
    if wanted info; then
        echo "== info"
        timeout 30 nvidia-smi || echo "(nvidia-smi failed: rc=$?)"
        timeout 60 "$PY" - <<'EOF' || echo "(python version check failed: rc=$?)"
import platform, sys
import torch
print(f"python {sys.version.split()[0]} ({platform.platform()})")
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}, "
      f"devices {torch.cuda.device_count()}")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device 0: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs, "
          f"capability {p.major}.{p.minor}")
for mod in ("triton", "transformers", "numpy", "safetensors", "tokenizers", "pybind11", "ninja"):
    try:
        print(f"{mod} {__import__(mod).__version__}")
    except Exception as e:  # report, do not stop the session
        print(f"{mod}: not importable ({type(e).__name__}: {e})")
EOF
        echo "nvcc: $(command -v nvcc || echo 'not on PATH') $(nvcc --version 2>/dev/null | tail -n 2 | head -n 1)"
        echo "cpus $(nproc), $(free -g 2>/dev/null | awk '/Mem:/ {print $2 " GiB memory"}'), disk $(df -h . | awk 'NR==2 {print $4 " free"}')"
        SUMMARY+=("info: done")
    fi
    if wanted build; then
        # build_ext does not check setup.py's install_requires pins (torch==2.13.0): the image's
        # torch builds the extensions; CUDA parts only where nvcc and CUDA torch are found.
        MAX_JOBS=${MAX_JOBS:-$(nproc)} run_step build 150 "$OUT/build.log" "$PY" setup.py build_ext --inplace
        ls -l engine/_*.so 2>/dev/null | sed 's/^/   built: /'
    fi
    if wanted test; then
        # -v: each test's name as it finishes (a time-out still shows where it stopped); short tracebacks
        run_step test 150 "$OUT/pytest_gpu.log" "$PY" -m pytest -v -m gpu -p no:cacheprovider --tb=short -rfs \
            --durations=10 --continue-on-collection-errors tests/
    fi
    if wanted fp8; then
        # shellcheck disable=SC2086
        # with each side's host time by function (--host-profile) and the step's kernels against its time
        # (--profile-step): the H200 session found the FP8 step host-bound (docs/fp8.md)
        run_json_step fp8 100 "$OUT/bench_fp8.log" "$PY" tools/bench_fp8.py --device cuda --host-profile 10 \
            --profile-step --profile-top 8 ${FP8_ARGS:-}
        # where one linear's time goes, kernel by kernel (docs/fp8.md, "Where the time goes")
        run_json_step fp8_profile 30 "$OUT/bench_fp8.log" "$PY" tools/bench_fp8.py --device cuda --profile 8b:qkv \
            --repeats 5
        # each weight cast once per step vs once per micro-batch (model.fp8_weight_cache), gpu-1b in 4 micro-batches,
        # each side's kernels per step against its step time (--profile-step: how long the GPU waited for the host)
        run_json_step fp8_cache 90 "$OUT/bench_fp8.log" "$PY" tools/bench_fp8.py --device cuda --skip gemms \
            --skip host --recipes tensorwise --micro-batch 1 --weight-cache-ab --steps 5 --profile-step --profile-top 8
    fi
    if wanted graphs; then
        # the host taken off the step: each layer's forward and backward replayed as CUDA graphs
        # (model.cuda_graph = "layers", docs/cuda_graphs.md), against the same sides eager, same run; 16 kernels
        # per side: the graphed steps' kernels summed 4-6% more than the eager ones' on the H200 (unexplained); each
        # graphed side then prints its per-kernel difference from the eager side (kernel_diff_vs_eager in the JSON)
        run_json_step graphs 110 "$OUT/bench_fp8.log" "$PY" tools/bench_fp8.py --device cuda --skip gemms --skip host \
            --recipes tensorwise delayed --cuda-graph --profile-step --profile-top 16
    fi
    if wanted overlap; then
        run_json_step overlap 40 "$OUT/bench_parallel.log" "$PY" tools/bench_overlap.py --gemm-overhead --device cuda
    fi
    if wanted attention; then
        run_json_step attention 75 "$OUT/bench_parallel.log" "$PY" tools/bench_attention.py --device cuda
        # where the ring's blocks spend their time beyond SDPA's, kernel by kernel (docs/context_parallel.md)
        run_json_step attention_profile 30 "$OUT/bench_parallel.log" "$PY" tools/bench_attention.py --device cuda \
            --profile-cp 8 --seqs 8192 --repeats 5
    fi
    if wanted moe; then
        run_json_step moe 40 "$OUT/bench_parallel.log" "$PY" tools/bench_moe.py --ep "" --tokens 8192 --hidden 4096 \
            --ffn 14336 --experts 8 --top-k 2
    fi
    if wanted train; then
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list of words
        run_json_step train 150 "$OUT/train_step.log" "$PY" tools/bench_train_step.py --device cuda --preset gpu-1b \
            --compare-kernels --cuda-graph ${TRAIN_ARGS:-}
    fi
    if wanted kernels; then
        local kargs=${KERNELS_ARGS:-}
        if ((BUDGET - SECONDS < 240)) && [[ " $kargs " != *" --no-compile "* ]]; then
            kargs="$kargs --no-compile"  # the torch.compile baselines would not finish in what is left
        fi
        # shellcheck disable=SC2086
        run_step kernels 600 "$OUT/bench_kernels.log" "$PY" tools/bench_kernels.py --json "$OUT/bench_kernels.json" \
            $kargs
    fi
    echo "== summary ($SECONDS s in all)"
    printf '   %s\n' "${SUMMARY[@]}"
    echo "files in \$OUT:"
    ls -l "$OUT" | sed 's/^/   /'
}

session 2>&1 | tee "$OUT/session.log"
