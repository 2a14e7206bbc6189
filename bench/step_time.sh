#!/usr/bin/env bash
# Training-step time of the zoo models on the CPU backend: compile each with moec, train a few
# steps, report the median step time and tokens per second. Rank 0 prints, '#' lines are
# metadata, the footer says OK or FAILED.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
STEPS=${STEPS:-30}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-bench.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
echo "# moec step time, CPU backend, $(nproc) cores, $STEPS steps each (median of steps 3..N)"
printf '%-28s %10s %12s %14s\n' model tokens "step ms" "tokens/s"
status=0
for model in lang/models/*.moe bench/models/*.moe; do
  [ -f "$model" ] || continue
  name=$(basename "$model" .moe)
  if ! "$BUILD/moec" build "$model" -o "$WORK/$name" 2>"$WORK/err"; then
    echo "# $name: build failed: $(head -n 3 "$WORK/err")"; status=1; continue
  fi
  if ! "$WORK/$name" --steps "$STEPS" >"$WORK/$name.out" 2>&1; then
    echo "# $name: run failed: $(tail -n 3 "$WORK/$name.out")"; status=1; continue
  fi
  tokens=$(awk '/^# .*batch/ { for (i = 1; i <= NF; i++) { if ($i == "batch") b = $(i+1); if ($i == "seqlen") l = $(i+1) } } END { gsub(",", "", b); gsub(",", "", l); print b * l }' "$WORK/$name.out")
  ms=$(grep '^step' "$WORK/$name.out" | awk 'NR > 2 {print $(NF-1)}' | sort -g | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')
  printf '%-28s %10s %12.3f %14.0f\n' "$name" "$tokens" "$ms" "$(awk -v t="$tokens" -v m="$ms" 'BEGIN{print t / (m / 1000)}')"
done
[ $status -eq 0 ] && echo OK || echo FAILED
exit $status
