#!/usr/bin/env bash
# make interop (lang/manual.md §19): moec against transformers itself. Installs torch, transformers
# and peft into a virtual environment under build/ the first time (pip, PyPI; a few GB), then runs
# tests/interop/hf.py: tiny random checkpoints made by transformers, imported, built, run and
# exported, each compared with transformers in float64; tests/interop/lora.py: PEFT's LoRA
# adapters of the same checkpoints loaded, trained and exported, compared with PEFT; then
# tests/interop/readme.sh, the README's Hugging Face walk-through as written. Never part of make
# test.
# Prints ok/FAIL lines and "N passed, N failed"; exits 1 on a failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
VENV=${INTEROP_VENV:-$BUILD/interop-venv}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-interop.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
if ! "$VENV/bin/python" -c 'import torch, transformers, safetensors, peft' 2>/dev/null; then
  echo "# installing torch, transformers and peft into $VENV (pip, once)"
  if ! { { [ -x "$VENV/bin/pip" ] || python3 -m venv "$VENV"; } &&
         "$VENV/bin/pip" install -q torch transformers safetensors numpy peft; } >"$WORK/pip.log" 2>&1; then
    echo "FAIL  interop: torch, transformers and peft could not be installed: $(tail -n 3 "$WORK/pip.log")"
    echo "0 passed, 1 failed"
    exit 1
  fi
fi
echo "# $("$VENV/bin/python" -c 'import torch, transformers, peft; print("transformers", transformers.__version__, "peft", peft.__version__, "torch", torch.__version__)')"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
"$VENV/bin/python" tests/interop/hf.py "$BUILD/moec" "$WORK" 2>"$WORK/stderr" | tee "$WORK/out"
status=${PIPESTATUS[0]}
[ "$status" = 0 ] || grep -v 'Writing\|Loading' "$WORK/stderr" | tail -n 20
# LoRA adapters against PEFT (tests/interop/lora.py: the same tiny checkpoints, PEFT's adapters).
"$VENV/bin/python" tests/interop/lora.py "$BUILD/moec" "$WORK" 2>"$WORK/stderr" | tee -a "$WORK/out"
lora_status=${PIPESTATUS[0]}
[ "$lora_status" = 0 ] || grep -v 'Writing\|Loading' "$WORK/stderr" | tail -n 20
[ "$lora_status" = 0 ] || status=$lora_status
# The README's Hugging Face walk-through, as written (its CPU walk-throughs: tests/readme.sh).
bash tests/interop/readme.sh "$VENV/bin/python" "$BUILD" | tee -a "$WORK/out"
passed=$(grep -c '^ok ' "$WORK/out") failed=$(grep -c '^FAIL' "$WORK/out")
echo "$passed passed, $failed failed"
[ "$status" = 0 ] && [ "$failed" = 0 ]
