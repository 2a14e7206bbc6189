#!/usr/bin/env bash
# make bench, memory (issue 41): how fast the OS serves a run its memory, this build beside its
# own baseline in one run (MOERT_PLAIN_MEMORY=1: blocks from calloc, checkpoint files read into
# fresh memory, nothing touched ahead — what the runtime did before), alternating, 3 runs each:
#   - `--weights` of a 2.5 GB checkpoint (bench/models/olmoe_layer.moe, one layer of OLMoE-1B-7B
#     at its published widths, saved by `--steps 0 --save`): wall and system time, page faults,
#     peak resident memory (GNU time), medians;
#   - the first training step beside the median of the next four (--log's time_ms) of that model
#     and of bench/models/lm_mid.moe (AdamW: its moments are written every step).
#   - the sharded optimizer: the mid-size model's peak resident memory on dp2·ep2 beside the memory
#     plan's, with and without `shard true`.
# On a virtual machine the first touch of memory the host has not backed yet costs far more than
# the guest's page fault; the numbers say what this machine does. MEMORY_ROUNDS="1" for one round.
set -u
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
MOEC=$PWD/$BUILD/moec
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-memory.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
median() { sort -g | awk '{v[NR] = $1} END {print NR % 2 ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
echo "# memory: this build (blocks of their own mappings, the checkpoint mapped, first touches by every thread) beside MOERT_PLAIN_MEMORY=1"
"$MOEC" build bench/models/olmoe_layer.moe -o "$WORK/olmoe" >/dev/null || exit 1
"$MOEC" build bench/models/lm_mid.moe -o "$WORK/mid" >/dev/null || exit 1
(cd "$WORK" && ./olmoe --steps 0 --save ck --quiet >/dev/null) || exit 1
echo "# checkpoint: $(du -h "$WORK/ck.rank0-of-1.safetensors" | cut -f1) ($(grep -c . /proc/cpuinfo >/dev/null; nproc) cores, THP $(cat /sys/kernel/mm/transparent_hugepage/enabled 2>/dev/null))"
for round in ${MEMORY_ROUNDS:-1 2 3}; do
  for mode in plain now; do
    env=""; [ $mode = plain ] && env="MOERT_PLAIN_MEMORY=1"
    (cd "$WORK" && env $env /usr/bin/time -f "%e %S %R %M" ./olmoe --steps 0 --weights ck --quiet >/dev/null 2>"load.$mode.$round") ||
      { echo "FAIL  memory: --weights ($mode)"; cat "$WORK/load.$mode.$round"; exit 1; }
    for m in olmoe mid; do
      (cd "$WORK" && env $env ./$m --steps 5 --log "$m.$mode.$round.jsonl" --quiet >/dev/null 2>&1) ||
        { echo "FAIL  memory: $m --steps 5 ($mode)"; exit 1; }
    done
  done
done
col() { for r in ${MEMORY_ROUNDS:-1 2 3}; do tail -n 1 "$WORK/load.$1.$r" | awk -v c="$2" '{print $c}'; done | median; }
first_next() {   # model mode: median over the rounds of step 1's time / the median of steps 2..5
  for r in ${MEMORY_ROUNDS:-1 2 3}; do
    awk -F'"time_ms": ' '/"step"/ {split($2, a, ","); print a[1]}' "$WORK/$1.$2.$r.jsonl" |
      awk 'NR == 1 {first = $1; next} {print $1 > "/dev/stderr"} END {print first}' 2>"$WORK/next" |
      { read -r first; m=$(median <"$WORK/next"); awk -v f="$first" -v m="$m" 'BEGIN {printf "%.3f %.0f %.0f\n", f / m, f, m}'; }
  done | sort -g | awk '{l[NR] = $0} END {print l[int((NR + 1) / 2)]}'
}
printf "%-44s %14s %14s %8s\n" "" "plain" "now" "now/plain"
for c in "1|--weights 2.5 GB: wall s" "2|--weights 2.5 GB: system s" "3|--weights 2.5 GB: minor page faults" "4|--weights 2.5 GB: peak resident MB"; do
  i=${c%%|*} what=${c#*|}
  p=$(col plain "$i") n=$(col now "$i")
  [ "$i" = 4 ] && p=$(awk -v v="$p" 'BEGIN {printf "%.0f", v / 1024}') && n=$(awk -v v="$n" 'BEGIN {printf "%.0f", v / 1024}')
  printf "%-44s %14s %14s %8s\n" "$what" "$p" "$n" "$(awk -v a="$n" -v b="$p" 'BEGIN {printf "%.3f", (b > 0 ? a / b : 0)}')"
done
for m in olmoe mid; do
  read -r rp fp np <<<"$(first_next $m plain)"; read -r rn fn nn <<<"$(first_next $m now)"
  printf "%-44s %14s %14s\n" "$m: first step / next (ms)" "$rp ($fp/$np)" "$rn ($fn/$nn)"
done

# The sharded optimizer (`optimizer adamw { shard true; }`): the mid-size model on dp2·ep2 (2 ranks,
# one thread each), each rank's peak resident memory beside the memory plan's peak, with and
# without it (the plan counts parameters, gradients, moments and the arena; the process also
# holds its libraries, MPI's and OpenBLAS's buffers).
echo "# the mid-size model on dp2·ep2: rank 0's peak resident memory (MiB) beside the memory plan's"
sed 's/^layer block x 6/parallel { dp 2; ep 2; }\nlayer block x 6/' bench/models/lm_mid.moe >"$WORK/mid_dp2.moe"
sed 's/adamw {/adamw { shard true;/' "$WORK/mid_dp2.moe" >"$WORK/mid_dp2_shard.moe"
printf "%-44s %14s %14s %8s\n" "" "measured" "plan" "meas/plan"
for v in mid_dp2 mid_dp2_shard; do
  "$MOEC" build "$WORK/$v.moe" -o "$WORK/$v" >/dev/null || exit 1
  line=$(cd "$WORK" && OMP_NUM_THREADS=1 mpirun --allow-run-as-root --oversubscribe -np 2 ./$v --steps 3 2>&1 | grep -o 'peak memory .*')
  read -r meas plan <<<"$(echo "$line" | sed -n 's/peak memory \([0-9.]*\) MiB (the memory plan: \([0-9.]*\) MiB.*/\1 \2/p')"
  [ -n "$meas" ] || { echo "FAIL  memory: $v: no peak line"; exit 1; }
  printf "%-44s %14s %14s %8s\n" "$v: peak per rank" "$meas" "$plan" "$(awk -v a="$meas" -v b="$plan" 'BEGIN {printf "%.3f", a / b}')"
done
