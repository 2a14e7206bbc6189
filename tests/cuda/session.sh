#!/usr/bin/env bash
# One GPU session of issue 15, in as few device calls as the 10-minute limit allows: unpacks
# build/gpu-pack.tar.xz (make gpu-pack, carried), then runs the stages asked for and keeps each
# stage's log under $OUT (the device tool's folder that comes back; default build/gpu-logs).
#
#   bash tests/cuda/session.sh [env] [test] [tune] [predict] [profile] [profile-lm] [profile-layer] [compiled] [lm]
#                              [bench] [bench-bf16] [bench-all]
#                                                                  (default: env test tune predict)
#
# A stage may carry a time limit in seconds, STAGE:SECONDS (e.g. test:240 bench:120): the stage is
# stopped there and counts as failed (exit 124), and the next one runs, so that one call of the
# device tool always comes back with every stage's log. TUNE_ARGS adds options to moec tune
# (e.g. --quick). ARCHIVE=F.tar.gz packs $OUT into F after every stage (the device tool brings back
# at most 8 files: one archive and summary.txt come back even when the call is stopped).
#
#   env        nvidia-smi, the driver, the libraries the binaries resolve (env.log)
#   test       make test-gpu's checks: tests/cuda/gpu.sh (gpu_check: kernels, cuBLAS, NCCL; the zoo
#              and language models, the gate x order x expert matrix, sm_80 PTX, bf16, microbatches
#              and pipeline stages (pp 2 as 2 ranks on the GPU, where mpirun is) against the CPU
#              binaries) (test-gpu.log)
#   tune       moec tune --target cuda, fp32 and bf16, full sweeps (tune.log, tune_bf16.log, and
#              the profiles gpu.cluster, gpu_bf16.cluster)
#   predict    bench/gpu_predict.sh with those profiles: predicted against measured steps (predict.log)
#   profile    the predict models' --profile (data, forward, backward, update) and ncu's kernel
#              durations of the bf16 one (profile.log, ncu.csv)
#   profile-lm ncu's kernel times of bench/gpu_lm.sh's bf16 model, 2 steps (profile-lm.log, ncu_lm.csv)
#   profile-layer  the same for make bench-gpu's compiled layer, gpt 4x2048x4096x4 in bf16
#              (profile-layer.log, ncu_layer.csv)
#   compiled   bench/gpu_compiled.sh, fp32 and bf16: the layer as moec compiles it, without PyTorch
#              (compiled.log, compiled-bf16.log; bench and bench-bf16 run it too, beside PyTorch)
#   lm         bench/gpu_lm.sh: a language model's whole step (fp32 and bf16) beside PyTorch's (lm.log)
#   bench      make bench-gpu's default shapes: bench/gpu.sh (bench-gpu.log); bench-bf16: the same with
#              --dtype bf16 (bench-gpu-bf16.log); BENCH_ARGS adds options (--shapes SPEC); bench-all: all 162
#              shapes (run it as a call of its own: it can take most of the 10 minutes)
#
# The summary (each stage's last lines and its exit status) goes to stdout and $OUT/summary.txt.
# Exit status 1 when a stage failed.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
OUT=${OUT:-$BUILD/gpu-logs}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
stages=${*:-env test tune predict}
PACK=$BUILD/gpu-pack.tar.xz
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

# ---- unpack (once per pack) ----
if [ -f "$PACK" ] && { [ ! -f "$BUILD/.gpu-pack-unpacked" ] || [ "$PACK" -nt "$BUILD/.gpu-pack-unpacked" ]; }; then
  if command -v xz >/dev/null; then
    tar -xJf "$PACK" || { say "FAILED: tar -xJf $PACK"; exit 1; }
  else
    python3 -c 'import sys, tarfile; tarfile.open(sys.argv[1], "r:xz").extractall(".")' "$PACK" ||
      { say "FAILED: python3 tarfile on $PACK"; exit 1; }
  fi
  touch "$BUILD/.gpu-pack-unpacked"
  say "# unpacked $PACK ($(du -sh "$BUILD/cuda" | cut -f1) in $BUILD/cuda)"
fi

# ---- the libraries: the carried Debian ones (the same builds the binaries linked), NCCL from
# the venv; Open MPI's singleton ----
extra=$(cd "$BUILD" && pwd)/lib
nccl=$(python3 -c 'import nvidia.nccl; print(nvidia.nccl.__path__[0])' 2>/dev/null) && extra=$extra:$nccl/lib
# cuBLAS from the venv too (its libcublasLt may have the grouped GEMM, cuBLAS 13.4 and newer:
# gpu_check's '# expert GEMMs over their filled rows' line says which ran)
cublas=$(python3 -c '
import importlib, os
for name in ("nvidia.cublas", "nvidia.cu13"):
    try:
        paths = importlib.import_module(name).__path__
    except Exception:
        continue
    for p in paths:
        if os.path.exists(os.path.join(p, "lib", "libcublasLt.so.13")):
            print(os.path.join(p, "lib"))
            raise SystemExit' 2>/dev/null) && [ -n "$cublas" ] && extra=$extra:$cublas
[ -d "$BUILD/lib" ] && export LD_LIBRARY_PATH=$extra${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
if [ -d "$BUILD/ompi" ]; then
  export OPAL_PREFIX=$(cd "$BUILD/ompi" && pwd) OMPI_MCA_ess_singleton_isolated=1 OMPI_MCA_mca_base_component_show_load_errors=0
fi

status=0
stage() {   # NAME LOG COMMAND...: runs it, its output to LOG, the last lines to the summary
  local name=$1 log=$OUT/$2 start rc
  shift 2
  start=$(date +%s)
  if [ "${limit:-0}" -gt 0 ]; then
    # the stages are functions of this script: export them for timeout's bash
    export -f env_info tune profile_models profile_lm profile_layer profile_binary ncu_summary
    export BUILD OUT
    timeout -k 5 "$limit" bash -c '"$@"' stage "$@" >"$log" 2>&1 </dev/null
  else
    "$@" >"$log" 2>&1 </dev/null
  fi
  rc=$?
  say "== $name: exit $rc$([ $rc -eq 124 ] && echo " (stopped at its limit, $limit s)"), $(($(date +%s) - start)) s, $log"
  tail -n "${TAIL:-12}" "$log" | sed 's/^/   /' | tee -a "$SUMMARY"
  [ $rc -eq 0 ] || status=1
  [ -z "${ARCHIVE:-}" ] || tar -czf "$ARCHIVE" -C "$OUT" . 2>/dev/null
}

env_info() {
  nvidia-smi || echo "nvidia-smi failed"
  echo "# LD_LIBRARY_PATH=${LD_LIBRARY_PATH:-}"
  echo "# OPAL_PREFIX=${OPAL_PREFIX:-}"
  for bin in "$BUILD/moec" "$BUILD/cuda/moec-tune-cuda" "$BUILD/cuda/gpu_check" "$BUILD/bench/gpu_layer" \
             "$BUILD/cuda/models/tiny.cuda" "$BUILD/cuda/models/tiny.cpu"; do
    echo "## ldd $bin"
    ldd "$bin" 2>&1 | grep -E 'not found|nccl|cublas|openblas|mpi|nvrtc'
  done
  "$BUILD/moec" --version -v
  python3 -c 'import torch; print("torch", torch.__version__, torch.cuda.get_device_name(0))' 2>&1 | tail -n 1
}

profile_models() {   # where a step's time goes: --profile of the predict models, ncu's kernel times
  local m
  for m in "$(cd "$BUILD" && pwd)"/cuda/predict/*.cuda; do
    echo "## $m --steps 8 --profile"
    (cd "$OUT" && "$m" --steps 8 --profile --quiet) 2>&1 | tail -n 25
  done
  if command -v ncu >/dev/null; then
    m=$(cd "$BUILD" && pwd)/cuda/predict/predict_bf16_gpt_4x2048x2048x4.cuda
    echo "## ncu $m --steps 2 (kernel durations)"
    (cd "$OUT" && timeout -k 5 90 ncu --clock-control none --metrics gpu__time_duration.sum --csv "$m" --steps 2 --quiet) >"$OUT/ncu.csv" 2>&1
    echo "ncu exit $?"
    echo "## the compiler's counts for it (moec build -v): what a step launches and the bytes it moves"
    grep -h '^# launches' "${m%.cuda}.build" 2>/dev/null
    ncu_summary "$OUT/ncu.csv"
  fi
}

ncu_summary() {   # CSV of ncu --metrics gpu__time_duration.sum over 2 steps: time and launches per step by kernel
  echo "## ncu: kernel time per step (the two steps' sum / 2) and launches per step, by kernel"
  python3 - "$1" <<'PY'
import collections, csv, sys
rows = [r for r in csv.reader(open(sys.argv[1], errors="replace")) if len(r) >= 15 and r[12] == "gpu__time_duration.sum"]
scale = {"ns": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0, "nsecond": 1e-6}
t, n = collections.defaultdict(float), collections.Counter()
for r in rows:
    t[r[4]] += float(r[14].replace(",", "")) * scale.get(r[13], 1e-6) / 2
    n[r[4]] += 0.5
total = sum(t.values())
for k in sorted(t, key=t.get, reverse=True)[:25]:
    print("%-58s %9.3f ms %6.1f launches %5.1f %%" % (k[:58], t[k], n[k], 100 * t[k] / max(total, 1e-9)))
print("%-58s %9.3f ms %6.1f launches" % ("all kernels (cuBLAS's included)", total, sum(n.values())))
PY
}

profile_binary() {   # BINARY CSV SECONDS: ncu's kernel times of a CUDA binary's 2 steps, beside its counts
  local m=$1
  echo "## the compiler's counts (moec build -v)"
  grep -h '^# launches' "${m%.cuda}.build" 2>/dev/null
  grep -h '^# kernel traffic' "${m%.cuda}.build" 2>/dev/null
  echo "## ncu $m --steps 2"
  (cd "$OUT" && timeout -k 5 "$3" ncu --clock-control none --metrics gpu__time_duration.sum --csv "$m" --steps 2 --quiet) >"$OUT/$2" 2>&1
  echo "ncu exit $?"
  ncu_summary "$OUT/$2"
}

profile_lm() {   # ncu's kernel times of the language model of bench/gpu_lm.sh (bf16), beside its counts
  profile_binary "$(cd "$BUILD" && pwd)/cuda/lm/lm_gpu_bf16.cuda" ncu_lm.csv 150
}

profile_layer() {   # the same for make bench-gpu's compiled layer, gpt 4x2048x4096x4 in bf16
  profile_binary "$(cd "$BUILD" && pwd)/cuda/layers/layer_gpt_4x2048x4096x4_bf16.cuda" ncu_layer.csv 150
}

tune() {   # DTYPE PROFILE
  # shellcheck disable=SC2086
  "$BUILD/moec" tune --target cuda --dtype "$1" -v ${TUNE_ARGS:-} -o "$OUT/$2"
}

for s in $stages; do
  limit=0
  case $s in *:*) limit=${s#*:}; s=${s%%:*} ;; esac
  case $s in
    env) stage env env.log env_info ;;
    test)
      TAIL=60 stage "make test-gpu (tests/cuda/gpu.sh)" test-gpu.log env BUILD="$BUILD" bash tests/cuda/gpu.sh
      # the expert GEMMs' lines of gpu_check, wherever they fell in the log (which GEMM, its times)
      grep -h 'expert GEMMs over their filled rows:\|# grouped expert gemm' "$OUT/test-gpu.log" | sed 's/^ */   /' | tee -a "$SUMMARY" ;;
    tune)
      stage "moec tune --target cuda (fp32)" tune.log tune fp32 gpu.cluster
      stage "moec tune --target cuda --dtype bf16" tune_bf16.log tune bf16 gpu_bf16.cluster ;;
    predict)
      given=()   # the tune stage's profiles, else gpu_predict.sh tunes (--quick sweeps would do too)
      [ -f "$OUT/gpu.cluster" ] && given+=(--profile "$OUT/gpu.cluster")
      [ -f "$OUT/gpu_bf16.cluster" ] && given+=(--profile-bf16 "$OUT/gpu_bf16.cluster")
      TAIL=16 stage "predicted against measured (bench/gpu_predict.sh)" predict.log env BUILD="$BUILD" bash bench/gpu_predict.sh "${given[@]}" ;;
    lm) TAIL=20 stage "a language model's step beside PyTorch's (bench/gpu_lm.sh)" lm.log env BUILD="$BUILD" bash bench/gpu_lm.sh ${LM_ARGS:-} ;;
    profile-lm) TAIL=40 stage "where the language model's bf16 step goes (ncu)" profile-lm.log profile_lm ;;
    profile-layer) TAIL=40 stage "where the compiled layer's bf16 step goes (ncu)" profile-layer.log profile_layer ;;
    compiled)
      TAIL=18 stage "the compiled layer, fp32 (bench/gpu_compiled.sh)" compiled.log env BUILD="$BUILD" bash bench/gpu_compiled.sh
      TAIL=18 stage "the compiled layer, bf16 (bench/gpu_compiled.sh --dtype bf16)" compiled-bf16.log env BUILD="$BUILD" bash bench/gpu_compiled.sh --dtype bf16 ;;
    profile) TAIL=80 stage "where the predict models' steps go (--profile, ncu)" profile.log profile_models ;;
    # shellcheck disable=SC2086
    bench) TAIL=40 stage "make bench-gpu (bench/gpu.sh)" bench-gpu.log env BUILD="$BUILD" bash bench/gpu.sh ${BENCH_ARGS:-} ;;
    # shellcheck disable=SC2086
    bench-bf16) TAIL=40 stage "make bench-gpu, dtype bf16 (bench/gpu.sh --dtype bf16)" bench-gpu-bf16.log env BUILD="$BUILD" bash bench/gpu.sh --dtype bf16 ${BENCH_ARGS:-} ;;
    bench-all) TAIL=60 stage "make bench-gpu --all (bench/gpu.sh --all)" bench-gpu-all.log env BUILD="$BUILD" bash bench/gpu.sh --all ;;
    *) say "unknown stage '$s' (env test tune predict profile profile-lm profile-layer compiled lm bench bench-bf16 bench-all)"; status=1 ;;
  esac
done
exit $status
