#!/usr/bin/env bash
# make gpu-pack: everything a GPU session runs, built here and packed into one file to carry,
# build/gpu-pack.tar.xz (docs/gpu.md, "On the GPU machines"). The GPU machines have the CUDA
# toolkit, PyTorch and NCCL's Python package but none of the Debian packages moec's programs
# link (OpenBLAS, cJSON, Open MPI, NLopt) and no apt, so nothing can be built there.
#
# The pack holds, with debug information stripped (solid xz: the model binaries share most of
# their bytes):
#   build/moec                      dump-ir for bench/gpu_predict.sh, tune --target cuda
#   build/cuda/moec-tune-cuda       moec tune --target cuda
#   build/cuda/gpu_check            tests/cuda/gpu.sh's kernel, cuBLAS and NCCL checks
#   build/cuda/models/*             the CUDA and CPU binaries gpu.sh compares (make gpu-models:
#                                   zoo and language models, the gate x order x expert matrix,
#                                   sm_80 PTX, bf16)
#   build/cuda/predict/*            bench/gpu_predict.sh's models and CUDA binaries
#   build/cuda/lm/*                 bench/gpu_lm.sh's language model (fp32 and bf16 CUDA binaries)
#   build/cuda/layers/*             bench/gpu_compiled.sh's layers: make bench-gpu's layer as moec
#                                   compiles it (fp32 and bf16 CUDA binaries)
#   build/bench/gpu_layer           make bench-gpu's moec side
#   build/lib/*                     the Debian libraries the binaries need (ldd)
#   build/ompi/...                  Open MPI's components, for a singleton MPI_Init (OPAL_PREFIX)
# tests/cuda/session.sh unpacks it on the GPU machine. The pack must stay under 60 MiB (the
# device tool carries at most 64 MiB with the working tree); this script fails above that.
set -eu
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
PACK=$BUILD/gpu-pack.tar.xz
LIMIT=$((60 * 1024 * 1024))
for f in "$BUILD/moec" "$BUILD/cuda/moec-tune-cuda" "$BUILD/cuda/gpu_check" "$BUILD/bench/gpu_layer"; do
  [ -x "$f" ] || { echo "FAILED: $f is missing (make gpu-pack builds it where the CUDA toolkit, cuBLAS and NCCL are)"; exit 1; }
done
STAGE=$(mktemp -d "${TMPDIR:-/tmp}/moec-pack.XXXXXX")
trap 'rm -rf "$STAGE"' EXIT
S=$STAGE/build
mkdir -p "$S/cuda" "$S/bench" "$S/lib" "$S/ompi/lib/x86_64-linux-gnu/openmpi/lib" "$S/ompi/share"
# The dates are kept (cp -p, strip -p): tests/cuda/gpu.sh rebuilds a model binary older than moec.
cp -p "$BUILD/moec" "$S/"
cp -p "$BUILD/cuda/moec-tune-cuda" "$BUILD/cuda/gpu_check" "$S/cuda/"
cp -rp "$BUILD/cuda/models" "$BUILD/cuda/predict" "$S/cuda/"
[ -d "$BUILD/cuda/lm" ] && cp -rp "$BUILD/cuda/lm" "$S/cuda/"
[ -d "$BUILD/cuda/layers" ] && cp -rp "$BUILD/cuda/layers" "$S/cuda/"
cp -p "$BUILD/bench/gpu_layer" "$S/bench/"
bins=$(find "$S" -type f -perm -u+x ! -name '*.moe')
# shellcheck disable=SC2086
strip -p --strip-debug $bins
# The Debian libraries (not the C runtime's, which every machine has; not the CUDA toolkit's).
# shellcheck disable=SC2086
ldd $bins 2>/dev/null | awk '$3 ~ /^\/(usr\/)?lib\/x86_64-linux-gnu\// {print $3}' | sort -u |
  grep -vE '/lib(c|m|stdc\+\+|gcc_s|pthread|dl|rt)\.so' | while read -r lib; do cp -L "$lib" "$S/lib/"; done
strip --strip-unneeded "$S"/lib/*.so* 2>/dev/null || true
cp -r /usr/lib/x86_64-linux-gnu/openmpi/lib/openmpi3 "$S/ompi/lib/x86_64-linux-gnu/openmpi/lib/"
cp -r /usr/share/openmpi "$S/ompi/share/"
tar -C "$STAGE" -cf - build | xz -6 -T2 >"$PACK.tmp"
mv "$PACK.tmp" "$PACK"
size=$(stat -c %s "$PACK")
echo "# $PACK: $(awk -v s="$size" 'BEGIN {printf "%.1f MiB", s / 1048576}') ($(du -sh "$S" | cut -f1) unpacked:" \
     "$(find "$S/cuda/models" -name '*.cuda' | wc -l) model pairs, $(ls "$S/lib" | wc -l) libraries)"
if [ "$size" -gt "$LIMIT" ]; then
  echo "FAILED: the pack is over 60 MiB; the device tool carries at most 64 MiB with the working tree"
  exit 1
fi
echo "# carry it: run with carry [\"$PACK\"] and the command 'bash tests/cuda/session.sh' (docs/gpu.md)"
