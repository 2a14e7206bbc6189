#!/usr/bin/env bash
# The emulated cluster in make test (docs/cluster.md): a small MoE model, expert parallel over 2
# nodes (network namespaces joined by links shaped to 200 Mbit/s, MPI over TCP only), trained with
# the fsmoe schedule (2 chunks per phase on the compute and inter streams), equals its single-rank
# twin (same global batch): the same losses for 3 steps, and the same output, loss and whole
# gradients at step 1 (--dump), to 1e-5. --profile reports the communication and its hidden share.
# Where namespaces cannot be made (not root, no iproute2, a kernel that refuses) it prints one
# skip line. Prints `ok    ...` / `FAIL  ...` / `skip  ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-cluster.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
CLUSTER=tests/cluster/cluster.sh
export OMP_NUM_THREADS=1

if ! why=$($CLUSTER check); then
  skip "emulated cluster" "network namespaces cannot be made here ($why)"
  exit 0
fi

model() {  # name batch groups parallel-line schedule-line
  cat <<EOF
model $1 { batch $2; seqlen 16; embed 32; seed 4; optimizer adamw { lr 0.01; } }
$4
layer blk x 2 {
  moe {
    experts 4 { ffn gpt { hidden 64; act gelu; bias true; } }
    gate gshard { k 2; capacity 1.0; noise 0.5; aux_loss 0.1; z_loss 0.01; groups $3; }
    order tutel;
  }
}
$5
EOF
}
model twin 4 2 "" "" >"$WORK/twin.moe"
model par 2 1 "parallel { dp 2; mp 1; ep 2; esp 1; }" "schedule { policy fsmoe; pipeline { forward 2; backward 2; } }" >"$WORK/par.moe"
for m in twin par; do
  if ! "$MOEC" build "$WORK/$m.moe" -o "$WORK/$m" 2>"$WORK/err"; then bad "build $m" "$(cat "$WORK/err")"; exit 1; fi
done
if ! (cd "$WORK" && timeout 120 ./twin --steps 3 --dump twin.dump >twin.out 2>&1 </dev/null); then
  bad "single-rank twin" "$(tail -n 20 "$WORK/twin.out")"; exit 1
fi
start=$(date +%s)
(cd "$WORK" && timeout 120 "$OLDPWD/$CLUSTER" run 2 1 200mbit -- ./par --steps 3 --dump par.dump --profile >par.out 2>&1 </dev/null)
status=$?
secs=$(( $(date +%s) - start ))
if [ $status -ne 0 ]; then
  bad "2 nodes at 200 Mbit/s: the run failed (exit $status)" "$(tail -n 20 "$WORK/par.out")"
elif ! same_losses "$WORK/twin.out" "$WORK/par.out"; then
  bad "2 nodes at 200 Mbit/s: losses differ from the single-rank twin" "$(paste <(losses "$WORK/twin.out") <(losses "$WORK/par.out"))"
elif ! cmp_out=$(compare_dumps "$WORK/twin.dump" "$WORK/par.dump"); then
  bad "2 nodes at 200 Mbit/s: step 1 differs from the single-rank twin" "$cmp_out"
else
  ok "2 nodes (namespaces, links shaped to 200 Mbit/s, MPI over TCP), fsmoe r = 2: equals the single-rank twin in ${secs}s: $cmp_out"
fi
# The communication per step is the mean beside the mean step: never more than the step.
line=$(grep '^# profile: communication' "$WORK/par.out")
if echo "$line" | grep -q '^# profile: communication [0-9.]* ms per step ([0-9.]* % of the mean step, [0-9.]* ms), [0-9.]* % of it hidden behind computation' &&
   echo "$line" | awk '{c = $4; m = $14 + 0; h = $16 + 0; exit !(c <= m && h >= 0 && h <= 100)}'; then
  ok "--profile on 2 nodes: $(grep '^# profile: communication' "$WORK/par.out" | sed 's/^# profile: //')"
else
  bad "--profile on 2 nodes reports the communication" "$(grep '^#' "$WORK/par.out" | tail -n 5)"
fi
# Nothing of the cluster is left behind.
if ip netns list | grep -q '^moec-node' || ip link show moecbr0 >/dev/null 2>&1; then
  bad "the cluster is removed after the run" "$(ip netns list; ip link show moecbr0 2>&1)"
else
  ok "the cluster is removed after the run (no namespace, no bridge)"
fi
# A second cluster while one holds the lock is refused.
LOCK=${MOEC_CLUSTER_LOCK:-/run/lock/moec-cluster.lock}
mkdir -p "$(dirname "$LOCK")"
exec 8>>"$LOCK"
flock -n 8 && {
  out=$(MOEC_CLUSTER_WAIT=0 $CLUSTER run 2 1 1gbit -- true 2>&1 </dev/null); status=$?
  if [ $status -ne 0 ] && echo "$out" | grep -q 'another emulated cluster is running'; then ok "a second cluster at once is refused: $out"
  else bad "a second cluster at once is refused" "exit $status: $out"; fi
}
exec 8>&-
exit $failed
