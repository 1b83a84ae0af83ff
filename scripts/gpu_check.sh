#!/usr/bin/env bash
# One command that proves bev.ops and training on a GPU machine (`make gpu-check`), in about 10 minutes:
#   1. builds the extension in place for this device and checks that a C++ error inside it raises
#      (where it crashes: rebuilds with the system's g++),
#   2. runs the CUDA tests (tests/test_ops_cuda.py, tests/test_train_cuda.py), the emulated ones
#      (tests/test_ops_cuda_emulated.py) and the native kernels' value tests under compute-sanitizer memcheck,
#   3. runs the GPU benchmarks: the op (scripts/bench_pool.py --device cuda), the paper-config training step
#      at batch 4 (profiled) and 16 (scripts/bench_train.py) and the temporal step (scripts/bench_temporal.py),
#   4. trains the embedded experiment for a few hundred steps (bf16-mixed) on a small synthetic set and
#      checks that the training loss went down,
# and after each stage writes benchmarks/results/gpu_<device>.json and .md (scripts/gpu_check_report.py),
# so that a check cut short keeps what it finished.
#
# Needs: python with torch (CUDA build), lightning, pytest, hypothesis, ninja, nvcc; for step 4 also
# hydra-core, omegaconf, antlr4-python3-runtime and nuscenes-devkit (+ pyquaternion, shapely, descartes).
# Without a package index, carry them as wheels in .whl/ (`make gpu-wheels`): they are installed with
# `pip install --no-index --no-deps --target` into a private directory.
#
# Usage: scripts/gpu_check.sh [--dry-run] [--steps N] [--skip-train] [--skip-bench] [--step-only] [--compile-step]
#   --dry-run      check the machine and print the commands, run nothing (works without a GPU)
#   --step-only    the build, tests/test_train_cuda.py, the batch-4 paper step, the temporal step, the training run
#   --compile-step the build, the no-sync / CUDA-graph tests (tests/test_compile.py, tests/test_train_cuda.py) on
#                  half the cores beside the paper step at batch 4 and 16, eager and with CUDA graphs, fp32 and
#                  bf16, with lift-splat-shoot's own step when $LSS is a checkout of it and FIERY's against ours
#                  when $FIERY is one (its deps in $FIERY_SITE or carried wheels); no training run
# Environment: PYTHON (default python3), GPU_CHECK_DIR (work dir, default outputs/gpu_check).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
WORK=${GPU_CHECK_DIR:-$REPO/outputs/gpu_check}
RESULTS=$REPO/benchmarks/results
STEPS=300
DRY_RUN=0 SKIP_TRAIN=0 SKIP_BENCH=0 STEP_ONLY=0 COMPILE_STEP=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --steps) STEPS=$2; shift ;;
    --skip-train) SKIP_TRAIN=1 ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --step-only) STEP_ONLY=1 ;;
    --compile-step) COMPILE_STEP=1 STEP_ONLY=1 SKIP_TRAIN=1 ;;
    -h|--help) awk 'NR > 1 && /^#/ {print; next} NR > 1 {exit}' "$0"; exit 0 ;;  # the header above
    *) echo "gpu_check: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

say() { printf '\n== %s\n' "$*"; }
die() { printf 'gpu_check: %s\n' "$*" >&2; exit 1; }
run() {  # run (or, with --dry-run, print) a command
  printf '+ %s\n' "$*"
  [ "$DRY_RUN" = 1 ] || "$@"
}
logged() {  # logged NAME command...: run it, keep its output in $LOGS/NAME.log; a failure is recorded, not fatal
  local name=$1 rc=0
  shift
  run "$@" 2>&1 | tee "$LOGS/$name.log" || rc=$?
  [ "$rc" = 0 ] || FAILED="$FAILED $name"
}
FAILED=""
stage_start() { STAGE_T0=$(date +%s); }
stage_end() {  # stage_end NAME: its time, then the report with the stages still to run
  TIMES="$TIMES\"$1\": $(( $(date +%s) - STAGE_T0 )), "
  PENDING=$(echo " $PENDING " | sed "s/ $1 / /; s/^ *//; s/ *$//")
  report "$PENDING"
}
TIMES=""
PENDING="build tests"
[ "$SKIP_BENCH" = 1 ] || PENDING="$PENDING bench"
[ "$SKIP_TRAIN" = 1 ] || PENDING="$PENDING train"
# The report (scripts/gpu_check_report.py) after every stage: a check cut short keeps what it finished.
report() {  # report STAGES_STILL_TO_RUN
  [ "$DRY_RUN" = 0 ] || return 0
  REPORT_RC=0
  "$PY" scripts/gpu_check_report.py --device "$DEVICE" --work "$WORK" --results "$RESULTS" --times "{${TIMES%, }}" \
    --failed "$FAILED" --pending "$1" > "$LOGS/report.log" 2>&1 || REPORT_RC=$?
}
REPORT_RC=0

# ------------------------------------------------------------------------------ machine checks
say "machine"
command -v "$PY" >/dev/null || die "no $PY: set PYTHON=/path/to/python"
"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch: install a CUDA build of torch first"

# Wheels carried to a machine without an index: installed privately, never into the environment.
if compgen -G ".whl/*.whl" >/dev/null; then
  SITE=${GPU_CHECK_SITE:-/tmp/bev-gpu-check-site}
  say "installing $(ls .whl/*.whl | wc -l) carried wheels from .whl/ into $SITE"
  run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl
  export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
fi

# What is missing, named with the fix (the train stage needs the most).
MISSING=$("$PY" - <<'EOF'
import importlib.util
need = {"lightning": "lightning", "pytest": "pytest", "hypothesis": "hypothesis", "ninja": "ninja",
        "hydra": "hydra-core", "omegaconf": "omegaconf", "antlr4": "antlr4-python3-runtime",
        "nuscenes": "nuscenes-devkit", "pyquaternion": "pyquaternion", "shapely": "shapely",
        "descartes": "descartes", "PIL": "pillow", "matplotlib": "matplotlib", "tqdm": "tqdm"}
print(" ".join(pkg for mod, pkg in need.items() if importlib.util.find_spec(mod) is None))
EOF
)
TRAIN_NEEDS="hydra-core omegaconf antlr4-python3-runtime nuscenes-devkit pyquaternion shapely descartes pillow matplotlib tqdm"
if [ -n "$MISSING" ]; then
  echo "missing Python packages: $MISSING"
  echo "  fix: pip install them, or carry wheels in .whl/ (make gpu-wheels, on a machine with a package index)"
  for pkg in lightning pytest hypothesis ninja; do
    case " $MISSING " in *" $pkg "*) [ "$DRY_RUN" = 1 ] || die "$pkg is required for the tests and the build" ;; esac
  done
  for pkg in $TRAIN_NEEDS; do
    case " $MISSING " in *" $pkg "*)
      if [ "$SKIP_TRAIN" = 0 ] && [ "$DRY_RUN" = 0 ]; then die "$pkg is needed by the training stage (or pass --skip-train)"; fi ;;
    esac
  done
fi

INFO=$("$PY" - <<'EOF'
import re, torch
if not torch.cuda.is_available():
    print(f"none none {torch.version.cuda} {torch.__version__}")
else:
    major, minor = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    slug = re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")
    print(f"{major}.{minor} {slug} {torch.version.cuda} {torch.__version__}")
EOF
)
read -r ARCH DEVICE TORCH_CUDA TORCH_VERSION <<<"$INFO"
if [ "$ARCH" = none ]; then
  [ "$DRY_RUN" = 1 ] || die "no CUDA device visible to torch ($PY): run this on a GPU machine (--dry-run checks the rest)"
  ARCH=9.0 DEVICE=dry_run
  echo "no CUDA device: dry run with TORCH_CUDA_ARCH_LIST=$ARCH"
fi
NVCC=$(command -v nvcc || true)
if [ -z "$NVCC" ] && [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ]; then NVCC=${CUDA_HOME:-/usr/local/cuda}/bin/nvcc; fi
[ -n "$NVCC" ] || [ "$DRY_RUN" = 1 ] || die "nvcc not found: install the CUDA toolkit or set CUDA_HOME"
if [ -z "${CUDA_HOME:-}" ]; then
  if [ -d /usr/local/cuda ]; then CUDA_HOME=/usr/local/cuda; else CUDA_HOME=$(dirname "$(dirname "${NVCC:-/usr/local/cuda/bin/nvcc}")"); fi
fi
export CUDA_HOME
echo "device $DEVICE (sm_${ARCH/./}), torch $TORCH_VERSION (CUDA $TORCH_CUDA), nvcc ${NVCC:-none}, CUDA_HOME $CUDA_HOME"
LOGS=$WORK/logs
mkdir -p "$LOGS" "$RESULTS"
# This script's own outputs of an earlier run, so that a failed stage cannot report stale results.
[ "$DRY_RUN" = 1 ] || rm -rf "$LOGS"/* "$WORK/bench_pool_cuda.json" "$WORK"/bench_train_cuda*.json "$WORK/bench_temporal_cuda.json" "$WORK/train"

# ------------------------------------------------------------------------------ 1. build
say "1. build for sm_${ARCH/./}"
stage_start
# CUDA 13 wheels of torch ship some headers (cccl) in the nvidia package only.
NV_INCLUDE=$("$PY" -c 'import os, nvidia; p = os.path.join(list(nvidia.__path__)[0], "cu13", "include"); print(p if os.path.isdir(p) else "")' 2>/dev/null || true)
export CPATH="${NV_INCLUDE:+$NV_INCLUDE:}${CPATH:-}"
export TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS=${MAX_JOBS:-$(nproc)}
run "$PY" setup.py -q build_ext --inplace
# A C++ error raised inside _C must reach Python as RuntimeError. Built by the H200 image's default
# compiler (CXX=/opt/gcc/bin/g++, a wrapper with its own runtime directory, which linked libstdc++
# statically into _C) it was a segfault instead; built there by /usr/bin/g++-12 it raised. So where
# the probe crashes, rebuild with the system's g++ (CC and CXX: nvcc's host compiler follows CC).
native_error_raises() {  # the CPU test of that (a native check called in a subprocess), quietly
  "$PY" -m pytest -q -p no:cacheprovider tests/test_ops.py -k native_check_raises_instead_of_crashing >/dev/null 2>&1
}
if [ "$DRY_RUN" = 0 ] && ! native_error_raises; then
  echo "bev.ops._C built by ${CXX:-c++} crashes on a C++ exception instead of raising: rebuilding with the system g++"
  for gxx in /usr/bin/g++ /usr/bin/g++-[0-9]*; do
    [ -x "$gxx" ] && [ "$gxx" != "${CXX:-}" ] || continue
    CC=${gxx/g++/gcc} CXX=$gxx run "$PY" setup.py -q build_ext --inplace || continue
    if native_error_raises; then echo "built by $gxx: a native error raises"; break; fi
  done
  native_error_raises || FAILED="$FAILED native_errors_crash"
fi
if [ "$DRY_RUN" = 0 ]; then
  "$PY" -c 'import bev.ops as ops, sys; sys.exit(0 if ops.native_available("cuda") else "native CUDA kernels did not load: " + str(ops._native.LOAD_ERROR))'
fi
stage_end build

# ------------------------------------------------------------------------------ 2. tests
say "2. CUDA tests + emulated CUDA kernels"
stage_start
# Two processes, so that a crash in one (a C++ exception thrown through a broken unwinder is a
# segfault: seen with the H200 image's compiler, see benchmarks/results/gpu_nvidia_h200.md) keeps the other's report.
if [ "$COMPILE_STEP" = 1 ]; then
  # Beside the benchmark (stage 3), on the other half of the cores: one lease holds both.
  half=$(( $(nproc) / 2 ))
  PIN_TESTS=() PIN_BENCH=()
  if command -v taskset >/dev/null && [ "$half" -ge 2 ]; then
    PIN_TESTS=(taskset -c "$half-$(( 2 * half - 1 ))") PIN_BENCH=(taskset -c "0-$(( half - 1 ))")
  fi
  TESTS_PID=""
  if [ "$DRY_RUN" = 0 ]; then
    "${PIN_TESTS[@]}" "$PY" -X faulthandler -m pytest -q -p no:cacheprovider -m cuda tests/test_compile.py \
      tests/test_train_cuda.py --junitxml="$LOGS/tests.xml" > "$LOGS/tests.log" 2>&1 &
    TESTS_PID=$!
  fi
elif [ "$STEP_ONLY" = 1 ]; then
  logged tests "$PY" -X faulthandler -m pytest -q -p no:cacheprovider -m cuda tests/test_train_cuda.py --junitxml="$LOGS/tests.xml"
else
  logged tests "$PY" -X faulthandler -m pytest -q -p no:cacheprovider -m cuda tests/test_ops_cuda.py tests/test_train_cuda.py \
    --junitxml="$LOGS/tests.xml"
  logged tests_emulated "$PY" -X faulthandler -m pytest -q -p no:cacheprovider -m cuda_emulated tests/test_ops_cuda_emulated.py \
    --junitxml="$LOGS/tests_emulated.xml"
  # Out-of-bounds and misaligned accesses that a value check can miss: the native kernels' value tests
  # (fp32 and bf16) under compute-sanitizer's memcheck, where the toolkit has it (~40 s on an H200).
  SANITIZER=$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")
  if [ -x "$SANITIZER" ] || [ "$DRY_RUN" = 1 ]; then
    logged memcheck "$SANITIZER" --tool memcheck --error-exitcode 9 "$PY" -m pytest -q -p no:cacheprovider -m cuda \
      tests/test_ops_cuda.py -k "(native and (float32 or bfloat16)) or (adversarial and native)"
  else
    echo "no compute-sanitizer in $CUDA_HOME/bin: memcheck skipped"
  fi
fi
[ "$COMPILE_STEP" = 1 ] || stage_end tests

# ------------------------------------------------------------------------------ 3. benchmark
BENCH_JSON=$WORK/bench_pool_cuda.json
TRAIN_BENCH_JSON=$WORK/bench_train_cuda.json
if [ "$SKIP_BENCH" = 0 ] && [ "$COMPILE_STEP" = 1 ]; then
  say "3. benchmark: the compiled step"
  stage_start
  # One process per batch size: eager and compiled variants alternated round-robin on the same batch.
  LSS_ARGS=(${LSS:+--lss "$LSS"})
  logged bench_train "${PIN_BENCH[@]}" "$PY" scripts/bench_train.py --device cuda --configs paper --steps 8 --warmup 2 \
    --profile 2 --variants fp32 channels_last+bf16 cudagraphs+channels_last cudagraphs+channels_last+bf16 \
    "${LSS_ARGS[@]}" --out "$TRAIN_BENCH_JSON"
  logged bench_train_b16 "${PIN_BENCH[@]}" "$PY" scripts/bench_train.py --device cuda --configs paper --batch-size 16 \
    --steps 6 --warmup 2 --variants fp32 channels_last+bf16 cudagraphs+channels_last+bf16 "${LSS_ARGS[@]}" \
    --out "${TRAIN_BENCH_JSON%.json}_b16.json"
  if [ -n "${FIERY:-}" ]; then
    logged bench_vs_fiery "${PIN_BENCH[@]}" "$PY" scripts/bench_temporal.py --device cuda --fiery "$FIERY" \
      ${FIERY_SITE:+--site "$FIERY_SITE"} --variants fiery fiery_fp32 fiery_stride8 --steps 8 --warmup 2 \
      --out "$RESULTS/bench_vs_fiery_${DEVICE}.json"
  fi
  stage_end bench
  if [ -n "$TESTS_PID" ]; then
    wait "$TESTS_PID" || FAILED="$FAILED tests"
    cat "$LOGS/tests.log"
  fi
  stage_end tests
elif [ "$SKIP_BENCH" = 0 ]; then
  say "3. benchmark"
  stage_start
  [ "$STEP_ONLY" = 1 ] || logged bench "$PY" scripts/bench_pool.py --device cuda --out "$BENCH_JSON"
  logged bench_train "$PY" scripts/bench_train.py --device cuda --configs paper --no-compile --steps 10 --warmup 3 --profile 3 \
    --variants fp32 channels_last channels_last+bf16 --out "$TRAIN_BENCH_JSON"
  logged bench_temporal "$PY" scripts/bench_temporal.py --device cuda --steps 20 --warmup 5 \
    --variants static temporal temporal+past_no_grad temporal+past_no_grad+past_cache fiery_static fiery \
    --out "$WORK/bench_temporal_cuda.json"
  [ "$STEP_ONLY" = 1 ] || logged bench_train_b16 "$PY" scripts/bench_train.py --device cuda --configs paper --batch-size 16 --steps 10 --warmup 3 \
    --variants fp32 channels_last channels_last+bf16 --out "${TRAIN_BENCH_JSON%.json}_b16.json"
  stage_end bench
fi

# ------------------------------------------------------------------------------ 4. training
DATA=$WORK/synthetic
# Pinned batches, as a GPU run would use: the capture must live beside the loader's pin-memory thread.
# An hour's time budget never binds here; it measures s/step without validations and the first epoch.
TRAIN_OVERRIDES=(experiment=synthetic_cpu trainer=gpu trainer.precision=bf16-mixed
  ++trainer.max_steps="$STEPS" trainer.max_epochs=-1 callbacks.time_budget.budget=3600 trainer.log_every_n_steps=5
  data.num_workers=4 data.pin_memory=true data.dataroot="$DATA" callbacks.bev_png.every_n_steps=1000000)
if [ "$DRY_RUN" = 1 ] && [ "$SKIP_TRAIN" = 0 ]; then
  # A dry run composes the training config, so that a stale override fails here, not on the GPU.
  "$PY" -m bev.train "${TRAIN_OVERRIDES[@]}" hydra.run.dir="$WORK/train" --cfg job >/dev/null \
    || die "the training stage's overrides do not compose (above)"
fi
if [ "$SKIP_TRAIN" = 0 ]; then
  say "4. training: experiment=synthetic_cpu on the GPU, bf16-mixed, $STEPS steps"
  stage_start
  if [ ! -f "$DATA/v1.0-mini/scene.json" ]; then
    logged synthetic "$PY" -m bev.synthetic.writer --out "$DATA" --scenes 10 --samples-per-scene 12 --workers "$(nproc)"
  fi
  logged train "$PY" -m bev.train "${TRAIN_OVERRIDES[@]}" hydra.run.dir="$WORK/train"
  stage_end train
fi

# ------------------------------------------------------------------------------ report
[ "$DRY_RUN" = 0 ] || { say "dry run done: nothing was built, tested or measured"; exit 0; }
say "report"
cat "$LOGS/report.log"
exit "$REPORT_RC"
