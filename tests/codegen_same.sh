#!/usr/bin/env bash
# Byte identity of the generated programs (issue 64: a refactor of codegen/ that must not change
# a byte). For every model of tests/golden, lang/models (and paper/), bench/models, tests/models,
# the gate x order x expert matrix (tests/cuda/matrix.sh), the pipeline models
# (tests/cuda/pipeline_models.sh, each stage), bf16 twins and a few parallel layouts, it writes
# what `moec build` generates:
#   NAME.c          --emit c                          (the CPU program)
#   NAME.cu         --target cuda --emit cuda         (the CUDA kernels, NVRTC's source)
#   NAME.host.c     --target cuda --emit c            (the CUDA host program, images embedded)
#   NAME.*.v        the -v report of each (stderr) and the exit status
# and the same with --no-fuse (NAME.nofuse.*).
#
#   tests/codegen_same.sh --record DIR   write the outputs into DIR (the reference)
#   tests/codegen_same.sh DIR            regenerate into a temporary folder and diff -r against DIR
#                                        (exit 1 and the diff's head when they differ)
#
# JOBS (default 2) builds side by side; MOEC_CACHE (default /tmp/moec-codegen-same-cache) keeps
# the NVRTC images between runs, so a second run takes seconds per model.
set -u
cd "$(dirname "$0")/.."
MOEC=${MOEC:-$PWD/build/moec}
JOBS=${JOBS:-2}
export MOEC_CACHE=${MOEC_CACHE:-/tmp/moec-codegen-same-cache}
mode=compare
if [ "${1:-}" = --record ]; then mode=record; shift; fi
ref=${1:?usage: tests/codegen_same.sh [--record] DIR}

if [ $mode = record ]; then out=$ref; rm -rf "$out"; mkdir -p "$out"
else out=$(mktemp -d "${TMPDIR:-/tmp}/moec-codegen-same.XXXXXX"); trap 'rm -rf "$out"' EXIT; fi
models=$out/.models
mkdir -p "$models"

# The model list, one "NAME FILE [ARGS...]" a line.
list=$out/.list
: >"$list"
for m in tests/golden/*.moe lang/models/*.moe lang/models/paper/*.moe bench/models/*.moe tests/models/*.moe; do
  echo "$(echo "${m%.moe}" | tr / _) $PWD/$m" >>"$list"
done
bash tests/cuda/matrix.sh "$models/matrix" >"$models/matrix.names"
for n in $(cat "$models/matrix.names"); do echo "$n $models/matrix/$n.moe" >>"$list"; done
. tests/cuda/pipeline_models.sh
pipeline_models "$models"
for n in $PIPELINE_MODELS $PIPELINE_GPU_MODELS; do
  if grep -q 'pp 2' "$models/$n.moe"; then
    for s in 0 1; do echo "pipe_${n}_stage$s $models/$n.moe --stage $s" >>"$list"; done
  else echo "pipe_$n $models/$n.moe" >>"$list"; fi
done
# bf16 twins (the CUDA target's mixed precision) of the models written with dtype fp32, and of the
# language models (dtype after the model's name).
for m in lang/models/*.moe tests/golden/*.moe; do
  grep -q 'dtype fp32;' "$m" || continue
  n=$(basename "${m%.moe}")_bf16
  sed 's/dtype fp32;/dtype bf16;/' "$m" >"$models/$n.moe"; echo "$n $models/$n.moe" >>"$list"
done
for m in tests/models/grad_lm_gpt.moe tests/models/grad_lm_llama.moe tests/models/grad_lm_shared.moe; do
  b=$(basename "${m%.moe}"); n=${b}_bf16
  sed "s/^model $b { /model $b { dtype bf16; /" "$m" >"$models/$n.moe"; echo "$n $models/$n.moe" >>"$list"
done
# Parallel layouts (EP AlltoAll of each algorithm, ESP, MP) and the fsmoe streams.
for l in 1,2,2,1 2,2,4,1 2,2,2,2 2,1,2,1,1dh 2,2,4,1,2dh; do
  for m in lang/models/tiny.moe lang/models/mixtral.moe tests/models/grad_lm_gpt.moe tests/models/grad_shared.moe; do
    echo "layout_$(basename "${m%.moe}")_$(echo $l | tr , _) $PWD/$m --layout $l" >>"$list"
  done
done
sed 's/^model grad_lm_gpt { /model grad_lm_gpt { dtype bf16; /; s/^layer block x 2/parallel { dp 2; mp 2; ep 4; }\nschedule { policy fsmoe; pipeline { forward 2; backward 2; } }\nlayer block x 2/' \
  tests/models/grad_lm_gpt.moe >"$models/lm_fs16.moe"
echo "lm_fs16 $models/lm_fs16.moe" >>"$list"

# one NAME FILE [ARGS...]: every output of one model, fused and not.
one() {
  local name=$1 file=$2 fuse
  shift 2
  for fuse in "" --no-fuse; do
    local n=$name${fuse:+.nofuse}
    "$MOEC" build "$file" -v --emit c -o "$out/$n.c" $fuse "$@" >"$out/$n.c.v" 2>&1; echo "rc $?" >>"$out/$n.c.v"
    "$MOEC" build "$file" -v --target cuda --emit cuda -o "$out/$n.cu" $fuse "$@" >"$out/$n.cu.v" 2>&1; echo "rc $?" >>"$out/$n.cu.v"
    "$MOEC" build "$file" -v --target cuda --emit c -o "$out/$n.host.c" $fuse "$@" >"$out/$n.host.c.v" 2>&1; echo "rc $?" >>"$out/$n.host.c.v"
  done
  # bf16 values kept in fp32 beside their copies (tests/cuda/host.sh's MOEC_BF16_SAVED=0)
  case $name in *_bf16)
    MOEC_BF16_SAVED=0 "$MOEC" build "$file" -v --target cuda --emit c -o "$out/$name.saved0.host.c" "$@" >"$out/$name.saved0.host.c.v" 2>&1
    echo "rc $?" >>"$out/$name.saved0.host.c.v" ;;
  esac
}
export -f one
export MOEC out
xargs -P "$JOBS" -L 1 bash -c 'one "$@"' _ <"$list"
# The paths of the temporary models appear in the outputs (the source's name): spell them alike;
# and the -v lines that vary from run to run (the planner's time, whether NVRTC's images came
# from the build cache) are left out.
find "$out" -maxdepth 1 -type f -print0 |
  xargs -0 sed -i "s|$models|MODELS|g; s|$PWD|ROOT|g; s/planned in [0-9.]* ms/planned in T ms/; s/ (from the build cache)//"
rm -rf "$models" "$list"
n=$(find "$out" -maxdepth 1 -type f | wc -l)
if [ $mode = record ]; then echo "ok    codegen same: $n files recorded in $ref"; exit 0; fi
if diff -r "$ref" "$out" >"$out.diff" 2>&1; then
  echo "ok    codegen same: $n files byte-identical to $ref"; rm -f "$out.diff"; exit 0
fi
echo "FAIL  codegen same: the generated programs differ from $ref ($(grep -c '^diff\|^Only' "$out.diff") files; $out.diff)"
head -n 60 "$out.diff"
cp "$out.diff" "${TMPDIR:-/tmp}/codegen_same.last.diff"
exit 1
