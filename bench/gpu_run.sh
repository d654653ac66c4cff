#!/usr/bin/env bash
# One GPU session in one command of at most 9 minutes, run from the repository
# root of a checkout on a CUDA machine with torch and Triton installed (nothing
# is downloaded). What matters is measured first:
#
#     bash bench/gpu_run.sh          # all: build, end-to-end training, GPU tests, kernels
#     bash bench/gpu_run.sh e2e      # part "e2e": stages 1-4 of "all" (build, environment, end-to-end, GPU tests),
#                                    # the end-to-end stage with up to 300 s (HFKERN_E2E_SECONDS)
#     bash bench/gpu_run.sh train    # part "train": the long end-to-end benchmark alone
#     bash bench/gpu_run.sh kernels  # part "kernels": tests, kernel and optimizer benchmarks alone
#     bash bench/gpu_run.sh plan     # part "plan": hfkern.plan's cost model and fronts (a second, short command)
#
# Default ("all"), each stage's exit status recorded, a failing stage never stopping the next:
#   1. build        hfkern._C for the device (as in part "kernels" below)
#   2. environment  versions, the device, which backend serves each op and why
#   3. train_e2e    bench/train_throughput.py: ResNet-18 and PointNet at B = 8 and 32, bf16
#                   and fp32, modes serial, hfta (the HFTA-style grouped array in plain torch
#                   ops), array, array+capture (hfkern.capture_step) and array+capture+cl (the
#                   same with the images in channels-last array memory) on the torch path, the
#                   ResNet-18 bf16 cells first (B ascending: a mode that fails at a B is not
#                   tried at larger ones), with three quarters of the budget; then, each in a
#                   run of its own with what is left: the CUDA backend's array, the torch
#                   path's array and array+capture with only the optimizer steps on the CUDA
#                   and the Triton kernels (--backends torch,sgd_step_=cuda,adam_step_=cuda:
#                   the per-op evidence auto asks for), ResNet-18's
#                   array with every op dispatched (array+ops: the torch path without its
#                   eager paths), ResNet-18's array under torch.compile, plain and mode="reduce-overhead"
#                   (array+compile, array+compile-ro), and Triton's array (its first steps
#                   compile and autotune); each run with a profile summary of
#                   its slowest hfkern mode at B = 32 (host time, GPU time and kernel launches
#                   per step, top kernels); one report of all; capped at HFKERN_E2E_SECONDS
#                   (default 250)
#   4. gpu_tests    python -m pytest -m gpu tests, capped at HFKERN_TEST_SECONDS (default 100 here)
#   5. ceilings     the device's copy bandwidth and matmul rates (bench/bandwidth.py)
#   6. bench_bytes  bench/bench_kernels.py --suite bytes: where the bytes go at the published
#                   workloads' shapes (ResNet-18 at batch 128, PointNet at 32 x 2,500 points,
#                   MobileNetV2, the transformers' layer norms): conv and batch norm in array
#                   NCHW and array channels-last memory with the cost of a layout conversion,
#                   batch norm / layer norm with ReLU or GELU fused against the unfused pair,
#                   ReLU, residual add and copy_ against the copy bandwidth; bf16, B = 8 then 32,
#                   the quick subset first; a time budget of at most HFKERN_BYTES_SECONDS (90)
#                   and at most two thirds of what the run has left
#   7. kernels      the optimizer, layer-norm and conv benchmarks with whatever time is left
#   Results in $OUT: train_e2e_<date>.json / .md (and plots), gpu_tests.log, the kernel CSV/JSON
#   files (below) and gpu_run.log.
#   How the 9 minutes add up: the stages after the end-to-end one share what is left of
#   HFKERN_RUN_SECONDS (510 s; the rest of 540 is the slack for a stage that overruns by its
#   last case): with train_e2e at its full 250 s (plus up to 90 s finishing its cell) and the
#   build and environment, about 200 s are left; the GPU tests take up to 100 s, the
#   ceilings ~15 s, bench_bytes two thirds of the rest. The bytes stage's time comes out of the
#   kernel stages after it (optimizer, layer norm, conv), which only run when more than
#   100 / 80 s are left, so a default run often skips them; part "kernels" runs them in full.
#
# Part "train" (after the build and environment stages below):
#   train        bench/train_throughput.py at the published sizes (bench/models, size
#                "full"): serial, concurrent, vmap and the array per backend, with and
#                without torch.compile, fp32 and bf16, B over TRAIN_B with --bisect for
#                the largest array that fits, the workloads with the published targets
#                first, within the part's budget less the convergence check's
#   convergence  bench/convergence.py: the ResNet-18 array with three learning rates
#                against three torch models, 50 steps (HFKERN_CONVERGENCE_SECONDS, 120)
#   Results in $OUT: train_<device>_<date>.json / .md (and the plots where matplotlib is
#   installed; else `python bench/train_throughput.py --report FILE.json` draws them),
#   convergence_resnet18_<device>_<date>.json, gpu_run_train.log.
#
# Part "plan" (a short second command, about 4 minutes; the environment stage, then):
#   plan         bench/bench_plan.py --size full on the GPU: the cost model fitted at
#                B = 1, 2, 4, 8 (fp32 and bf16, one and two arrays in flight on CUDA streams),
#                its predictions against measured steps at B = 12, the Pareto set found and
#                its plans measured; ResNet-18 first, then the transformer LM, PointNet,
#                MobileNetV2, BERT-small and DCGAN, none started after HFKERN_PLAN_SECONDS
#                (default 180; the workload running then finishes, killed at 150 s more).
#                hfkern._C is not built (no cuda backend). auto serves each op as
#                hfkern/_evidence.py's committed records say: Triton's adam_step_,
#                sgd_step_ and array_layer_norm (and its backward) are auto-eligible,
#                taken where a record names a result for this device, the torch path
#                otherwise; plan.json records what each op resolved to (backends).
#   Results in $OUT/plan: plan.json (written after every workload) and a plot per
#   workload; gpu_run_plan.log.
#
# Part "kernels" stages (each one's exit status is recorded; a failing stage never stops the next):
#   1. build        the CUDA extension hfkern._C in place (python setup.py build_ext
#                   --inplace: HFKERN_BUILD_CUDA=1, HFKERN_BUILD_EMU=0, for
#                   HFKERN_CUDA_ARCHS, default 90), with the machine's nvcc, cmake,
#                   ninja and pybind11 and nothing downloaded; when it fails, the
#                   stages after it run without the extension
#   2. environment  Python, torch, CUDA, cuDNN and Triton versions, the device,
#                   nvidia-smi, and which hfkern backend serves each op
#   3. gpu tests    python -m pytest -m gpu tests (Triton compiles for the device;
#                   TRITON_INTERPRET is unset; HFKERN_TRITON_AUTOTUNE=0, so each
#                   kernel compiles its first config only), capped in time
#   4. ceilings     the device's copy bandwidth and matmul rates (bench/bandwidth.py)
#   5. benchmark    bench/bench_kernels.py once per op family with a shape suite
#                   (bench/families), smallest suite first, each in its own process
#                   with a time budget, so that a kernel that breaks the CUDA
#                   context loses only its own family's rows; then the bytes suite
#                   (bench_bytes above; at most a quarter of what is left), then
#                   bench/bench_optim.py (optimizer steps of B ResNet-18 models)
#                   in its own process and budget.
#                   These time eager calls (do_bench): launch overhead included.
#                   Then bench/bench_topk.py (top-k selection of every backend
#                   against torch.topk, n = 1e5..1e8) in its own process and budget.
#                   The bytes stage's time comes out of the conv and graph stages
#                   after it, which take what is left.
#   6. graph        bench/bench_kernels.py --quick --timer cuda_graph: the quick
#                   subset of every op timed as CUDA-graph replays, the kernels'
#                   own time without launch overhead
#   7. report       the kernel parts merged into one CSV + JSON and summarized;
#                   the graph-timed and optimizer summaries printed last
#
# Results go to $OUT (default bench/results/gpu_run), flat, at most 12 files:
#   gpu_run.log  everything printed, ending with each stage's exit status and seconds;
#   gpu_tests.log  the pytest output; gpu_test_failures.log  each failure's traceback as it happened;
#   kernels_<device>_<date>.csv / .json        the eager kernel benchmark rows (bench/README.md);
#   kernels-bytes_<device>_<date>.csv / .json  the bytes suite's rows (layouts, fused norms, elementwise);
#   graph_kernels_<device>_<date>.csv / .json  the graph-timed rows;
#   optim_<device>_<date>.csv / .json          the optimizer-step rows;
#   topk_<device>_<date>.json                  the top-k selection rows.
#
# Settings (environment variables):
#   HFKERN_RUN_SECONDS   wall-clock target for the whole script (default 510)
#   HFKERN_TEST_SECONDS  cap on the GPU tests (default 180)
#   HFKERN_TEST_WORKERS  pytest-xdist processes for the GPU tests, where xdist is
#                        installed (default 12)
#   BENCH_ARGS           extra options for bench_kernels.py, e.g. "--quick" or "--dtypes bf16"
#   OPTIM_ARGS           extra options for bench_optim.py, e.g. "--ops adam --B 16"
#   HFKERN_OPTIM_SECONDS cap on the optimizer benchmark's time budget (default 75)
#   HFKERN_TOPK_SECONDS  cap on the top-k benchmark's time budget (default 60)
#   HFKERN_GRAPH_SECONDS cap on the graph-timed benchmark's time budget (default 90)
#   HFKERN_BYTES_SECONDS cap on the bytes suite's time budget (default 90)
#   BYTES_ARGS           options for the bytes suite (default: bf16, the implementations
#                        that answer it: "--dtypes bf16 --impls torch,triton,cuda,grouped_nchw,
#                        grouped_nhwc,grouped,convert,unfused_torch,unfused_triton")
#   HFKERN_CUDA_ARCHS    the architectures hfkern._C is built for (default 90: H100/H200)
#   TRAIN_B              the array sizes of part "train" (default "1 4 16 32 64")
#   TRAIN_ARGS           extra options for train_throughput.py, e.g. "--workloads resnet18"
#   HFKERN_CONVERGENCE_SECONDS  cap on the convergence check (default 120)
#   HFKERN_PLAN_SECONDS  part "plan": seconds after which no workload is started (default 180)
#   PYTHON               the interpreter (default python3)
#   HFKERN_WHEELS        a folder of wheels to install first, offline (a machine without network)
#
# hfkern is used in place through PYTHONPATH (no pip install, so no dependency
# is touched); the build stage puts hfkern/_C*.so beside the sources and its
# CMake files under build/.

set -u

cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1
ROOT=$PWD
OUT=${OUT:-$ROOT/bench/results/gpu_run}
RUN_SECONDS=${HFKERN_RUN_SECONDS:-510}
TEST_SECONDS=${HFKERN_TEST_SECONDS:-180}
E2E_SECONDS=${HFKERN_E2E_SECONDS:-250}
BENCH_ARGS=${BENCH_ARGS:-}
OPTIM_ARGS=${OPTIM_ARGS:-}
OPTIM_SECONDS=${HFKERN_OPTIM_SECONDS:-75}
GRAPH_SECONDS=${HFKERN_GRAPH_SECONDS:-90}
BYTES_SECONDS=${HFKERN_BYTES_SECONDS:-90}
# The bytes suite asks how the layouts, a conversion and fusion compare; B separate calls
# (loop) and vmap answer other questions and would take half its time.
BYTES_ARGS=${BYTES_ARGS:---dtypes bf16 --impls torch,triton,cuda,grouped_nchw,grouped_nhwc,grouped,convert,unfused_torch,unfused_triton}
XDIST_WORKERS=${HFKERN_TEST_WORKERS:-12}
TRAIN_B=${TRAIN_B:-1 4 16 32 64}
TRAIN_ARGS=${TRAIN_ARGS:-}
CONVERGENCE_SECONDS=${HFKERN_CONVERGENCE_SECONDS:-120}
PART=${1:-all}
case $PART in
all | e2e | kernels | train | plan) ;;
*)
    echo "usage: bash bench/gpu_run.sh [all|e2e|kernels|train|plan] (got '$PART')" >&2
    exit 2
    ;;
esac
PY=${PYTHON:-python3}
START=$(date +%s)

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
# HFKERN_WHEELS=DIR: wheels installed first (offline, into a temporary folder put on
# PYTHONPATH), for a machine without network that lacks a test or benchmark dependency:
# the sweep's tests need optuna and SQLAlchemy (bench/README.md says how to fetch them).
if [[ -n ${HFKERN_WHEELS:-} ]]; then
    WHEEL_SITE=$(mktemp -d) || exit 1
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$WHEEL_SITE" "$HFKERN_WHEELS"/*.whl; then
        export PYTHONPATH="$PYTHONPATH:$WHEEL_SITE"
    else
        echo "HFKERN_WHEELS: installing the wheels of $HFKERN_WHEELS failed; going on without them"
    fi
fi

mkdir -p "$OUT" || exit 1
WORK=$(mktemp -d) || exit 1
STAGES=$WORK/stages.txt
FAILED=0

left() { echo $((START + RUN_SECONDS - $(date +%s))); }

min() { if (($1 < $2)); then echo "$1"; else echo "$2"; fi; }

max() { if (($1 > $2)); then echo "$1"; else echo "$2"; fi; }

# run_stage NAME COMMAND...: run, print and record its exit status and duration.
run_stage() {
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    echo
    echo "=== $name ($(left) s of the run left) ==="
    "$@"
    rc=$?
    printf '%-20s rc=%-4s %5s s\n' "$name" "$rc" "$(($(date +%s) - t0))" >>"$STAGES"
    ((rc == 0)) || FAILED=1
    return 0
}

# build_extension: hfkern._C in place for this machine's GPUs (setup.py drives
# CMake; its build directory under build/ makes a second run incremental).
build_extension() {
    local archs=${HFKERN_CUDA_ARCHS:-90}
    echo "HFKERN_BUILD_CUDA=1 HFKERN_BUILD_EMU=0 HFKERN_CUDA_ARCHS=$archs $PY setup.py build_ext --inplace"
    HFKERN_BUILD_CUDA=1 HFKERN_BUILD_EMU=0 HFKERN_CUDA_ARCHS=$archs "$PY" setup.py build_ext --inplace || return
    "$PY" -c "import hfkern._C as c; print('hfkern._C:', c.__file__, '| built for', c.CUDA_ARCHITECTURES, '|', c.runtime_info())"
}

environment() {
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(uname -srm)"
    echo "git: $(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo 'not a git checkout')"
    "$PY" - <<'EOF'
import importlib.metadata, json, platform
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
try:
    print("triton", importlib.metadata.version("triton"))
except importlib.metadata.PackageNotFoundError:
    print("triton: not installed")
print("cuda available:", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, "
          f"L2 {getattr(p, 'L2_cache_size', 0) / 2**20:.0f} MiB, capability {p.major}.{p.minor}")
import hfkern
info = hfkern.backend_info()
for name, b in info["backends"].items():
    print(f"backend {name}: {'available' if b['available'] else 'unavailable'} ({b['reason']})")
for op, row in info["ops"].items():
    print(f"  {op}: registered {row['registered']}; cuda -> {row['cuda']}")
EOF
    local rc=$?
    nvidia-smi || echo "nvidia-smi failed"
    return $rc
}

# gpu_tests [KEEP]: the GPU tests, leaving KEEP seconds of the run to the stages after
# them (default 200: part "kernels" runs its benchmarks after the tests; in part "all"
# the kernel benchmarks take only what is left, so the tests keep RESERVE).
gpu_tests() {
    local budget keep=${1:-200}
    budget=$(max 30 "$(min "$TEST_SECONDS" $(($(left) - keep)))")
    echo "python -m pytest -m gpu tests (at most ${budget} s; full log in gpu_tests.log)"
    # importlib import mode: tests/ and tests/triton/ hold test files of the same
    # basename (test_conv.py), which the default mode cannot collect together.
    # Tests check numerics, not speed: one config per kernel (HFKERN_TRITON_AUTOTUNE=0)
    # instead of compiling and timing every config for every test shape;
    # tests/triton/test_common.py turns autotuning back on for its own check.
    # Compiling dominates and runs on one core per process: with pytest-xdist,
    # XDIST_WORKERS processes share the GPU and Triton's on-disk cache.
    local par=()
    if "$PY" -c "import xdist" 2>/dev/null; then
        par=(-n "$XDIST_WORKERS")
    fi
    echo "test processes: ${par[1]:-1}"
    # The library's own tests (fusion, capture, autocast, plans, sweeps) before the kernel
    # directories: pytest collects in the order given and xdist hands out in that order, so a
    # run stopped at its cap has run those. Each failure's traceback is written as it happens
    # (HFKERN_FAILURE_LOG, tests/conftest.py); pytest's summary comes only at the end.
    local order=(tests/test_*.py tests/cuda tests/triton)
    HFKERN_FAILURE_LOG=$OUT/gpu_test_failures.log HFKERN_TRITON_AUTOTUNE=0 timeout -k 10 "$budget" \
        "$PY" -m pytest -m gpu "${order[@]}" --import-mode=importlib -v -rfE \
        --tb=short --durations=15 -p no:cacheprovider ${par[@]+"${par[@]}"} >"$OUT/gpu_tests.log" 2>&1
    local rc=$?
    tail -n 60 "$OUT/gpu_tests.log"
    ((rc == 124 || rc == 137)) && echo "GPU tests stopped at their time cap (${budget} s)"
    return $rc
}

ceilings() {
    "$PY" bench/bandwidth.py --out "$WORK/ceilings.json"
}

# bench OP CAP: bench_kernels.py for one op, with a time budget of at most CAP
# seconds out of what the run has left (keeping RESERVE for what follows).
RESERVE=40
bench() {
    local op=$1 cap=$2 budget ceil=()
    budget=$(max 20 "$(min "$cap" $(($(left) - RESERVE)))")
    [[ -f $WORK/ceilings.json ]] && ceil=(--ceilings "$WORK/ceilings.json")
    echo "bench_kernels.py --ops $op: time budget ${budget} s"
    # The budget stops new cases from starting; SIGINT after a grace period makes
    # the script write what it has; SIGKILL 15 s later if it cannot.
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout -s INT -k 15 $((budget + 45)) "$PY" bench/bench_kernels.py --ops "$op" \
        --time-budget "$budget" --out "$WORK" --name "part_$op" --no-table ${ceil[@]+"${ceil[@]}"} $BENCH_ARGS
}

# bench_optim CAP: bench_optim.py with a time budget of at most CAP seconds out of
# what the run has left (keeping RESERVE); its CSV + JSON are copied to $OUT.
bench_optim() {
    local cap=$1 budget ceil=() rc
    budget=$(max 20 "$(min "$cap" $(($(left) - RESERVE)))")
    [[ -f $WORK/ceilings.json ]] && ceil=(--ceilings "$WORK/ceilings.json")
    echo "bench_optim.py: time budget ${budget} s"
    # shellcheck disable=SC2086  # OPTIM_ARGS is a list of options
    timeout -s INT -k 15 $((budget + 45)) "$PY" bench/bench_optim.py --time-budget "$budget" \
        --out "$WORK/optim" ${ceil[@]+"${ceil[@]}"} $OPTIM_ARGS
    rc=$?
    # The CSV and JSON only (a killed run can leave a .json.tmp beside them).
    local files=()
    shopt -s nullglob
    files=("$WORK"/optim/*.csv "$WORK"/optim/*.json)
    shopt -u nullglob
    if ((${#files[@]})); then
        cp "${files[@]}" "$OUT"/ || rc=1
    else
        echo "no optimizer results"
        rc=1
    fi
    return $rc
}

# bench_topk CAP: bench/bench_topk.py, starting no new size after at most CAP seconds
# out of what the run has left (keeping RESERVE); its JSON goes to $OUT.
bench_topk() {
    local cap=$1 budget
    budget=$(max 20 "$(min "$cap" $(($(left) - RESERVE)))")
    echo "bench_topk.py: time budget ${budget} s"
    # A size that starts within the budget runs to its end: 1e8 takes tens of seconds.
    timeout -s INT -k 15 $((budget + 120)) "$PY" bench/bench_topk.py --time-budget "$budget" --out "$OUT"
}

# bench_graph CAP: the quick subset of every op under the cuda_graph timer, with a
# time budget of at most CAP seconds; its CSV + JSON are copied to $OUT as graph_*.
bench_graph() {
    local cap=$1 budget ceil=() rc f
    budget=$(max 20 "$(min "$cap" $(($(left) - RESERVE)))")
    [[ -f $WORK/ceilings.json ]] && ceil=(--ceilings "$WORK/ceilings.json")
    echo "bench_kernels.py --quick --timer cuda_graph: time budget ${budget} s"
    # shellcheck disable=SC2086  # BENCH_ARGS is a list of options
    timeout -s INT -k 15 $((budget + 45)) "$PY" bench/bench_kernels.py --quick --timer cuda_graph \
        --time-budget "$budget" --out "$WORK/graph" --no-table ${ceil[@]+"${ceil[@]}"} $BENCH_ARGS
    rc=$?
    shopt -s nullglob
    local files=("$WORK"/graph/*.csv "$WORK"/graph/*.json)
    shopt -u nullglob
    ((${#files[@]})) || { echo "no graph-timed results"; return 1; }
    for f in "${files[@]}"; do
        cp "$f" "$OUT/graph_$(basename "$f")" || rc=1
    done
    return $rc
}

# bench_bytes CAP: bench_kernels.py --suite bytes with a time budget of at most CAP seconds
# out of what the run has left (keeping RESERVE); its CSV + JSON are copied to $OUT.
bench_bytes() {
    local cap=$1 budget ceil=() rc
    budget=$(max 20 "$(min "$cap" $(($(left) - RESERVE)))")
    [[ -f $WORK/ceilings.json ]] && ceil=(--ceilings "$WORK/ceilings.json")
    echo "bench_kernels.py --suite bytes: time budget ${budget} s"
    # shellcheck disable=SC2086  # BYTES_ARGS is a list of options
    timeout -s INT -k 15 $((budget + 45)) "$PY" bench/bench_kernels.py --suite bytes \
        --time-budget "$budget" --out "$WORK/bytes" --no-table ${ceil[@]+"${ceil[@]}"} $BYTES_ARGS
    rc=$?
    shopt -s nullglob
    local files=("$WORK"/bytes/*.csv "$WORK"/bytes/*.json)
    shopt -u nullglob
    ((${#files[@]})) || { echo "no bytes-suite results"; return 1; }
    cp "${files[@]}" "$OUT"/ || rc=1
    return $rc
}

# report_bytes: the bytes suite's table and summaries again, at the end of the log.
report_bytes() {
    local files=("$WORK"/bytes/*.json)
    if [[ ! -e ${files[0]} ]]; then
        echo "no bytes-suite results to report"
        return 1
    fi
    "$PY" bench/bench_kernels.py --show "${files[@]}"
}

report_graph() {
    local files=("$OUT"/graph_*.json)
    if [[ ! -e ${files[0]} ]]; then
        echo "no graph-timed results to report"
        return 1
    fi
    "$PY" bench/report.py show "${files[@]}"
}

report_optim() {
    local files=("$WORK"/optim/*.json)
    if [[ ! -e ${files[0]} ]]; then
        echo "no optimizer results to report"
        return 1
    fi
    "$PY" bench/bench_optim.py --show "${files[@]}" --no-table
}

report() {
    local parts=("$WORK"/part_*.csv)
    if [[ ! -e ${parts[0]} ]]; then
        echo "no benchmark results to report"
        return 1
    fi
    if ! "$PY" bench/report.py merge "${parts[@]}" --out "$OUT" --table; then
        echo "merge failed; copying the parts as they are"
        cp "${parts[@]}" "$OUT"/
        return 1
    fi
}

# train: the end-to-end benchmark, the workloads with published targets first; the
# time budget stops new cells, SIGINT after a grace period makes it write what it has.
train() {
    local budget
    budget=$(max 60 $(($(left) - RESERVE - CONVERGENCE_SECONDS)))
    echo "train_throughput.py: time budget ${budget} s, B = $TRAIN_B"
    # shellcheck disable=SC2086  # TRAIN_B and TRAIN_ARGS are lists
    timeout -s INT -k 30 $((budget + 90)) "$PY" bench/train_throughput.py --size full \
        --workloads resnet18 pointnet mobilenet_v2 dcgan transformer_lm bert_small \
        --B $TRAIN_B --bisect --rounds 3 --steps 3 --time-budget "$budget" --out "$OUT" $TRAIN_ARGS
}

convergence() {
    timeout -k 10 "$(max 30 "$(min "$CONVERGENCE_SECONDS" $(($(left) - 10)))")" \
        "$PY" bench/convergence.py --steps 50 --out "$OUT"
}

plan() {
    local budget=${HFKERN_PLAN_SECONDS:-180}
    timeout -k 10 $((budget + 150)) "$PY" bench/bench_plan.py --size full --device cuda --profile-steps 3 \
        --workloads resnet18 transformer_lm pointnet mobilenet_v2 bert_small dcgan \
        --time-budget "$budget" --out "$OUT/plan"
}

# finish: the stages' summary and the files; the run's exit status.
finish() {
    echo
    echo "=== stages (exit status, seconds) ==="
    cat "$STAGES"
    echo "total: $(($(date +%s) - START)) s; files in $OUT:"
    ls -l "$OUT"
    rm -rf "$WORK"
    return $FAILED
}

# train_e2e: the cells the targets are about, most important first, then the profile of
# the slowest hfkern mode; the budget stops new cells, SIGINT makes it write what it has
# (a cell cut short keeps its modes' complete rounds). The torch path (what auto takes on
# CUDA) with capture and channels-last against serial and the HFTA-style baseline first, with
# three quarters of the budget; then the array of each other backend in a run of its own, with
# what is left: on a fresh H200 the first cell of all modes together waited 220 s for the
# Triton processes' compiling and autotuning. One report of all, speedups taken across them.
train_e2e() {
    local budget first rest t0 others b rc=0 runs=()
    budget=$(max 60 "$(min "$E2E_SECONDS" $(($(left) - ${E2E_KEEP:-200})))")
    first=$((budget * 3 / 4))
    t0=$(date +%s)
    local common=(--size full --workloads resnet18 pointnet --precisions bf16 fp32 --B 8 32 --rounds 3 --steps 3
        --profile-B 32 --profile-precisions bf16 --profile-modes slowest-array --out "$WORK/e2e")
    echo "train_throughput.py (end to end): time budget ${budget} s, ${first} s of it for the torch path"
    # shellcheck disable=SC2086  # TRAIN_ARGS is a list
    timeout -s INT -k 30 $((first + 60)) "$PY" bench/train_throughput.py "${common[@]}" --backends torch \
        --modes serial hfta array array+capture array+capture+cl --time-budget "$first" --name torch $TRAIN_ARGS || rc=$?
    [[ -f $WORK/e2e/torch.json ]] && runs+=("$WORK/e2e/torch.json")
    # Then, each in a run of its own so that one's warm-up never holds up another's cells: the
    # CUDA backend's array (its kernels are built: it warms up at once); ResNet-18's array with
    # every op dispatched (what the torch path's eager paths save on this device); torch.compile of the
    # array, plain and mode="reduce-overhead" (torch's CUDA graphs, what array+capture is
    # weighed against; inductor compiles for a minute or more), ResNet-18 only; Triton's array
    # (its first steps compile and autotune every conv shape: minutes for ResNet-18 on a fresh
    # machine).
    local name extra order
    order=$("$PY" -c "import hfkern
info = hfkern.backend_info()['backends']
ok = lambda n: n in info and info[n]['available']
print(' '.join(n for n in ('cuda', 'optim', 'ops', 'compile', 'triton')
               if n in ('ops', 'compile') or ok(n) or (n == 'optim' and (ok('cuda') or ok('triton')))))")
    for name in $order; do
        rest=$((budget - ($(date +%s) - t0)))
        if ((rest < 30)); then
            echo "$name not run: ${rest} s of the end-to-end budget left"
            continue
        fi
        if [[ $name == compile ]]; then
            extra=(--backends torch --modes array+compile array+compile-ro --workloads resnet18)
        elif [[ $name == optim ]]; then
            # The torch path with only the optimizer steps on hfkern's kernels: the per-op
            # evidence auto asks for (hfkern._evidence), with capture, where launches cost.
            extra=(--backends $("$PY" -c "import hfkern
info = hfkern.backend_info()['backends']
print(' '.join(f'torch,sgd_step_={n},adam_step_={n}' for n in ('cuda', 'triton') if info[n]['available']))")
                --modes array array+capture)
        elif [[ $name == ops ]]; then
            extra=(--backends torch --modes array+ops --workloads resnet18)
        else
            extra=(--backends "$name" --modes array)
        fi
        echo "$name: time budget ${rest} s"
        # shellcheck disable=SC2086  # TRAIN_ARGS is a list
        timeout -s INT -k 30 $((rest + 60)) "$PY" bench/train_throughput.py "${common[@]}" "${extra[@]}" \
            --time-budget "$rest" --name "$name" $TRAIN_ARGS || rc=$?
        [[ -f $WORK/e2e/$name.json ]] && runs+=("$WORK/e2e/$name.json")
    done
    ((${#runs[@]})) || { echo "no end-to-end results"; return 1; }
    "$PY" bench/train_throughput.py --report "${runs[@]}" --out "$OUT" --name "train_e2e_$(date -u +%Y-%m-%d)" || rc=1
    cat "$OUT/train_e2e_$(date -u +%Y-%m-%d).md"
    return $rc
}

main_all() {
    : >"$STAGES"
    echo "hfkern GPU run (all): results in $OUT, target ${RUN_SECONDS} s"
    run_stage build build_extension
    run_stage environment environment
    run_stage train_e2e train_e2e
    TEST_SECONDS=$(min "$TEST_SECONDS" 100)
    run_stage gpu_tests gpu_tests "$RESERVE"
    run_stage ceilings ceilings
    if (($(left) > RESERVE + 40)); then
        run_stage bench_bytes bench_bytes "$(min "$BYTES_SECONDS" $(max 30 $((($(left) - RESERVE) * 2 / 3))))"
    fi
    if (($(left) > RESERVE + 60)); then
        run_stage bench_optim bench_optim "$(min "$OPTIM_SECONDS" $(max 20 $((($(left) - RESERVE) / 2))))"
    fi
    if (($(left) > RESERVE + 40)); then
        run_stage bench_layer_norm bench layer_norm $(max 20 $((($(left) - RESERVE) / 2)))
    fi
    if (($(left) > RESERVE + 40)); then
        run_stage bench_conv bench conv $(max 20 $(($(left) - RESERVE)))
    fi
    run_stage report report
    run_stage report_optim report_optim
    run_stage report_bytes report_bytes
    finish
}

# main_e2e: the first four stages of "all" and nothing after them, for a device session
# that spends what is left on part "plan" instead of the kernel benchmarks.
main_e2e() {
    # No kernel benchmarks after the tests: the end-to-end stage may take more of the run.
    E2E_SECONDS=${HFKERN_E2E_SECONDS:-300}
    E2E_KEEP=160
    : >"$STAGES"
    echo "hfkern GPU run, part e2e: results in $OUT, target ${RUN_SECONDS} s"
    run_stage build build_extension
    run_stage environment environment
    run_stage train_e2e train_e2e
    TEST_SECONDS=$(min "$TEST_SECONDS" 100)
    run_stage gpu_tests gpu_tests 0
    finish
}

main_train() {
    : >"$STAGES"
    echo "hfkern GPU run, part train: results in $OUT, target ${RUN_SECONDS} s"
    run_stage build build_extension
    run_stage environment environment
    run_stage train train
    run_stage convergence convergence
    finish
}

main() {
    : >"$STAGES"
    echo "hfkern GPU run: results in $OUT, target ${RUN_SECONDS} s"
    run_stage build build_extension
    run_stage environment environment
    run_stage gpu_tests gpu_tests
    run_stage ceilings ceilings
    # The families with a benchmark suite, smallest first: the small suites get a
    # share each, the largest (conv) takes whatever is left.
    local families n i=0 last
    mapfile -t families < <("$PY" -c "import sys; sys.path.insert(0, 'bench'); import families as f
for n, fam in sorted(f.discover().items(), key=lambda kv: (len(kv[1].shapes), kv[0])):
    print(n) if fam.shapes else None")
    n=${#families[@]}
    last=${families[n - 1]:-conv}
    for ((i = 0; i < n - 1; i++)); do
        run_stage "bench_${families[i]}" bench "${families[i]}" $(max 20 $((($(left) - RESERVE) / (n - i + 4))))
    done
    run_stage bench_bytes bench_bytes "$(min "$BYTES_SECONDS" $(max 30 $((($(left) - RESERVE) / 4))))"
    run_stage bench_optim bench_optim "$(min "$OPTIM_SECONDS" $(max 30 $((($(left) - RESERVE) / 3))))"
    run_stage bench_topk bench_topk "$(min "${HFKERN_TOPK_SECONDS:-60}" $(max 20 $((($(left) - RESERVE) / 4))))"
    local graph_cap
    graph_cap=$(min "$GRAPH_SECONDS" $(max 30 $((($(left) - RESERVE) / 3))))
    # A conv case can run past its budget by its own length; 45 s is kept for that.
    run_stage "bench_$last" bench "$last" $(max 20 $(($(left) - RESERVE - graph_cap - 45)))
    run_stage bench_graph bench_graph "$graph_cap"
    run_stage report report
    run_stage report_graph report_graph
    run_stage report_optim report_optim
    run_stage report_bytes report_bytes
    finish
}

main_plan() {
    : >"$STAGES"
    echo "hfkern GPU run, part plan: results in $OUT/plan"
    run_stage environment environment
    run_stage plan plan
    finish
}

if [[ $PART == train ]]; then
    main_train 2>&1 | tee "$OUT/gpu_run_train.log"
elif [[ $PART == e2e ]]; then
    main_e2e 2>&1 | tee "$OUT/gpu_run_e2e.log"
elif [[ $PART == plan ]]; then
    main_plan 2>&1 | tee "$OUT/gpu_run_plan.log"
elif [[ $PART == kernels ]]; then
    main 2>&1 | tee "$OUT/gpu_run.log"
else
    main_all 2>&1 | tee "$OUT/gpu_run.log"
fi
exit "${PIPESTATUS[0]}"
