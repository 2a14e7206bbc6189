#!/usr/bin/env bash
# make bench's LoRA part (issue 63): a LoRA step against a full fine-tuning step, and the memory
# plans of a Mixtral-8x7B-width model, side by side, in one run.
#   step    bench/models/lm_mid.moe (6 blocks, M 512, 8 GPT experts of H 1024, vocab 8192, B 4,
#           L 256, AdamW) as written (every weight trained) and with
#           `lora { r 16; alpha 32; targets q k v o experts; }`: each binary's median whole step
#           (--profile, steps 2..N) and its GEMM time, the two run in turn ROUNDS times and the
#           medians compared. The LoRA step skips the frozen weights' gradient GEMMs (the
#           backward computes only what flows to the activations), their reductions and updates,
#           and adds the adapters' small GEMMs.
#   memory  Mixtral-8x7B's widths (32 layers, M 4096, 32 heads with 8 KV heads, 8 SwiGLU experts of
#           H 14336, top-2, vocab 32000, rope, rmsnorm, untied head, AdamW), one window of 4096
#           tokens: `moec build -v`'s memory plan (parameters, gradients, optimizer state, the
#           activations' arena, the peak) with every weight trained and with LoRA on q k v o and
#           the experts (r 16).
# Options: --rounds N (3), --steps N (6).
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=$PWD/$BUILD/moec
ROUNDS=3 STEPS=6
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=$2; shift ;;
    --steps) STEPS=$2; shift ;;
    *) echo "bench/lora.sh: unknown option '$1'" >&2; exit 2 ;;
  esac
  shift
done
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-lora-bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
LORA="lora { r 16; alpha 32; targets q k v o experts; }"

cp bench/models/lm_mid.moe "$WORK/full.moe"
sed "s/^  optimizer adamw \(.*\)$/  optimizer adamw \1\n  $LORA/" bench/models/lm_mid.moe >"$WORK/lora.moe"
for c in full lora; do
  "$MOEC" build "$WORK/$c.moe" -v -o "$WORK/$c" >"$WORK/$c.build" 2>&1 || { echo "FAIL  lora bench: build $c"; tail -n 5 "$WORK/$c.build"; exit 1; }
done
median() { sort -g | awk '{a[n++] = $1} END {print n ? a[int((n - 1) / 2)] : ""}'; }
for r in $(seq "$ROUNDS"); do
  for c in full lora; do
    "$WORK/$c" --steps "$STEPS" --profile >"$WORK/$c.run$r" 2>&1 || { echo "FAIL  lora bench: run $c"; tail -n 5 "$WORK/$c.run$r"; exit 1; }
  done
done
step() { for r in $(seq "$ROUNDS"); do sed -n 's/.*median whole step \([0-9.]*\) ms.*/\1/p' "$WORK/$1.run$r"; done | median; }
gemm() { for r in $(seq "$ROUNDS"); do sed -n 's/.*GEMM [0-9.]* % of the steps. time (\([0-9.]*\) ms per step).*/\1/p' "$WORK/$1.run$r"; done | median; }
mem() { sed -n "s/^# memplan: \(parameters .*\)$/\1/p" "$1" | tail -n 1; }
peak() { sed -n 's/^# memplan: peak \([0-9.]* [KMG]iB\).*/\1/p' "$1" | tail -n 1; }
tf=$(step full) tl=$(step lora) gf=$(gemm full) gl=$(gemm lora)
echo "# LoRA against full fine-tuning: bench/models/lm_mid.moe (B 4, L 256, M 512, 6 blocks of 8 GPT experts, vocab 8192), $ROUNDS rounds of $STEPS steps, $OMP_NUM_THREADS threads"
echo "| step | median whole step (ms) | GEMMs (ms a step) | trained |"
echo "| --- | ---: | ---: | --- |"
echo "| full fine-tuning | $tf | $gf | every weight |"
echo "| LoRA r 16 (q k v o experts) | $tl | $gl | $(sed -n 's/^# trained: \([0-9]* floats ([0-9.]* %)\).*/\1/p' "$WORK/lora.run1") |"
awk -v f="$tf" -v l="$tl" 'BEGIN { if (f > 0 && l > 0) printf "the LoRA step takes %.2fx the time of the full step\n", l / f }'
echo "memory plan, full: $(mem "$WORK/full.build"); peak $(peak "$WORK/full.build")"
echo "memory plan, LoRA: $(mem "$WORK/lora.build"); peak $(peak "$WORK/lora.build")"

# ---- Mixtral-8x7B's widths: the memory plans ----
mixtral() {   # NAME EXTRA
  cat <<EOF
model $1 {
  batch 1; seqlen 4096; embed 4096; seed 1; vocab 32000;
  position rope { theta 1000000; }
  norm rmsnorm { eps 1e-5; }
  tie_embeddings false;
  optimizer adamw { lr 0.0001; }
  $2
}
layer block x 32 {
  attention { heads 32; kv_heads 8; bias false; }
  moe { experts 8 { ffn mixtral { hidden 14336; } } gate gshard { k 2; capacity *; } }
}
EOF
}
mixtral mix_full "" >"$WORK/mix_full.moe"
mixtral mix_lora "$LORA" >"$WORK/mix_lora.moe"
echo
echo "# Mixtral-8x7B's widths (32 layers, M 4096, 8 experts of H 14336, vocab 32000), one window of 4096 tokens: moec build -v's memory plan per rank"
for c in mix_full mix_lora; do
  if "$MOEC" build "$WORK/$c.moe" -v --emit c -o "$WORK/$c.c" >"$WORK/$c.build" 2>&1; then
    echo "$c: $(mem "$WORK/$c.build"); peak $(peak "$WORK/$c.build")"
  else
    echo "$c: moec build failed: $(grep -m1 error "$WORK/$c.build")"
  fi
done
