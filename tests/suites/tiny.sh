#!/usr/bin/env bash
# End to end on lang/models/tiny.moe: build, 20 steps with the loss going down, the same seed
# twice gives the same bits, save at step 10 + resume repeats steps 11-20, --profile.
. "$(dirname "$0")/../lib.sh"
work tiny
losses() { grep '^step' "$1" | awk '{print $2, $4}'; }   # step number, loss
if ! "$MOEC" build lang/models/tiny.moe -o "$WORK/tiny" 2>"$WORK/err"; then
  bad "build tiny.moe" "$(cat "$WORK/err")"; exit 1
fi
ok "build tiny.moe"
if ! "$WORK/tiny" --steps 20 >"$WORK/run1" 2>&1; then
  bad "tiny: run" "$(tail -n 20 "$WORK/run1")"; exit 1
fi
first=$(losses "$WORK/run1" | head -n 1 | awk '{print $2}'); last=$(losses "$WORK/run1" | tail -n 1 | awk '{print $2}')
n=$(losses "$WORK/run1" | wc -l)
if [ "$n" = 20 ] && awk -v a="$first" -v b="$last" 'BEGIN{exit !(b < 0.9 * a)}'; then
  ok "tiny: 20 steps, loss $first -> $last"
else
  bad "tiny: 20 steps with the loss going down" "$(cat "$WORK/run1")"
fi
"$WORK/tiny" --steps 20 >"$WORK/run2" 2>&1
if [ -n "$(losses "$WORK/run1")" ] && [ "$(losses "$WORK/run1")" = "$(losses "$WORK/run2")" ]; then
  ok "tiny: same seed twice gives bit-identical losses"
else
  bad "tiny: same seed twice gives bit-identical losses" "$(diff <(losses "$WORK/run1") <(losses "$WORK/run2"))"
fi
if "$WORK/tiny" --steps 10 --save "$WORK/ckpt.safetensors" >"$WORK/half" 2>&1 &&
   "$WORK/tiny" --steps 20 --resume "$WORK/ckpt.safetensors" >"$WORK/resumed" 2>&1; then
  want=$(losses "$WORK/run1" | awk '$1 > 10'); got=$(losses "$WORK/resumed")
  if [ -n "$want" ] && [ "$want" = "$got" ] && [ ! -e "$WORK/ckpt.safetensors.tmp" ]; then
    ok "tiny: save at step 10 + resume gives the same losses for steps 11-20"
  else
    bad "tiny: save at step 10 + resume gives the same losses for steps 11-20" "$(diff <(echo "$want") <(echo "$got"))"
  fi
else
  bad "tiny: save + resume" "$(cat "$WORK/half" "$WORK/resumed" 2>/dev/null | tail -n 20)"
fi
# --profile: the median whole step of steps 2..5 and a GEMM share in (0, 100]; the step per class
# (GEMMs and the update timed, no attention or collective in tiny); --quiet keeps it.
"$WORK/tiny" --steps 5 --quiet --profile >"$WORK/prof" 2>&1
if grep -q '^# profile: steps 2\.\.5, median whole step [0-9.]* ms .*GEMM [0-9.]* % ' "$WORK/prof" &&
   awk '/^# profile:/ { for (i = 1; i < NF; i++) if ($i == "GEMM") p = $(i + 1) } END { exit !(p > 0 && p <= 100) }' "$WORK/prof" &&
   grep -q '^# profile: per class, ms a step: GEMM [0-9.]*, attention 0\.000, update [0-9.]*, AlltoAll 0\.000, .*the rest [0-9.]*' "$WORK/prof" &&
   awk '/^# profile: per class/ { for (i = 1; i < NF && $i !~ /^\(/; i++) if ($i == "GEMM" || $i == "update") { v = $(i + 1); sub(/,/, "", v); if (v + 0 <= 0) bad = 1 } }
        END { exit bad }' "$WORK/prof" &&
   ! grep -q '^step' "$WORK/prof"; then
  ok "tiny: --profile prints $(grep -o 'median whole step.*' "$WORK/prof" | head -c 90) and the step per class"
else
  bad "tiny: --profile" "$(cat "$WORK/prof")"
fi
# OpenBLAS's kernels: on a CPU with AVX2 the binary never runs the Prescott (SSE3) ones, which a
# DYNAMIC_ARCH OpenBLAS falls back to for a CPU model it does not know (runtime/threads.c).
if ! grep -q '\bavx2\b' /proc/cpuinfo; then
  skip "tiny: OpenBLAS kernels" "the CPU has no AVX2"
else
  core=$(env -u OPENBLAS_CORETYPE OPENBLAS_VERBOSE=2 "$WORK/tiny" --steps 1 --quiet 2>&1 | sed -n 's/^Core: //p' | tail -n 1)
  if [ -n "$core" ] && [ "$core" != Prescott ]; then
    ok "tiny: OpenBLAS runs its $core kernels on this AVX2 CPU"
  else
    bad "tiny: OpenBLAS runs kernels for this CPU (AVX2), not Prescott's" "OPENBLAS_VERBOSE=2 said: Core: ${core:-nothing}"
  fi
fi
# The run's summary: tokens per second, the FLOP rate of the compiled step's GEMMs and attention,
# the peak resident memory and the memory plan's, in one unit each; the process (libraries, OpenBLAS) holds at least what the plan lays out.
line=$("$WORK/tiny" --steps 4 | grep '^# trained')
if echo "$line" | grep -qE '^# trained 4 steps; final loss [0-9.]+; [0-9]+ tokens/s over [0-9.e-]+ s; [0-9.e+-]+ GFLOP/s per rank \([0-9.e+-]+ GFLOP a step: its GEMMs and attention, forward and backward, the experts. over every slot\); peak memory [0-9.]+ (B|KiB|MiB|GiB) \(the memory plan: [0-9.]+ (B|KiB|MiB|GiB) per rank\)$' &&
   echo "$line" | awk '{for (i = 1; i <= NF; i++) if ($i == "tokens/s") t = $(i - 1); exit !(t > 0)}'; then
  ok "tiny: the run's summary ($(echo "$line" | cut -c3-))"
else
  bad "tiny: the run's summary line" "$line"
fi
exit $failed
