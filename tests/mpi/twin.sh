#!/usr/bin/env bash
# The parallel layout must not change the math: for each layout, dispatch algorithm and k, a
# P-rank run (mpirun) and its single-rank twin (the same global batch, one routing group per
# rank: `groups dp*mp`) must give the same losses for 3 steps and the same loss, output and
# whole gradients at step 1 (--dump), to 1e-5 relative. Prints `ok    ...` / `FAIL  ...` lines;
# exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
PY=/usr/bin/python3
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-twin.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1
MPIRUN="mpirun --oversubscribe --allow-run-as-root --mca btl self,vader --bind-to none"
TIMEOUT=${TWIN_TIMEOUT:-120}
failed=0

ok() { printf 'ok    %s\n' "$1"; }
bad() { failed=1; printf 'FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | head -n 30 | sed 's/^/      /'; }

model() {  # name batch groups k parallel-line cluster-line
  cat <<EOF
model $1 { batch $2; seqlen 8; embed 16; seed 9; optimizer adamw { lr 0.01; } }
$5
$6
layer blk x 2 {
  moe {
    experts 8 { ffn gpt { hidden 32; act gelu; bias true; } }
    gate gshard { k $4; capacity 0.8; noise 0.5; aux_loss 0.1; z_loss 0.01; groups $3; }
    order tutel;
    dispatch { algo ALGO; }
  }
}
EOF
}

compare() {  # twin-dir par-dir -> prints the worst relative error, exit 1 above 1e-5
  "$PY" - "$1" "$2" <<'PYEOF'
import glob, os, sys
import numpy as np
a, b = sys.argv[1], sys.argv[2]
worst, name_worst, bad = 0.0, "", []
names = sorted(os.path.relpath(p, a) for p in glob.glob(os.path.join(a, "**", "*.npy"), recursive=True))
if not names:
    print("no dump files"); sys.exit(1)
for n in names:
    x = np.load(os.path.join(a, n)).astype(np.float64)
    pb = os.path.join(b, n)
    if not os.path.exists(pb):
        bad.append(f"{n}: missing in the parallel dump"); continue
    y = np.load(pb).astype(np.float64)
    if x.shape != y.shape:
        bad.append(f"{n}: shape {y.shape} != {x.shape}"); continue
    err = float(np.max(np.abs(x - y)) / max(float(np.max(np.abs(x))), 1e-30)) if x.size else 0.0
    if err > worst: worst, name_worst = err, n
    if err > 1e-5: bad.append(f"{n}: relative error {err:.3e}")
print(f"{len(names)} tensors, worst {worst:.1e} ({name_worst})")
for line in bad: print(line)
sys.exit(1 if bad else 0)
PYEOF
}

losses() { grep '^step' "$1" | awk '{print $4}'; }

same_losses() {  # file file: every step's loss within 1e-5 relative (printed with 6 decimals)
  paste <(losses "$1") <(losses "$2") | awk 'NF != 2 {bad = 1} { d = $1 - $2; if (d < 0) d = -d; s = $1 < 0 ? -$1 : $1; if (d > 1e-5 * s + 2e-6) bad = 1; n++ } END { exit bad || n == 0 }'
}

# layout: name P dp mp ep esp gpus_per_node
layouts="P2-ep2:2:2:1:2:1:2
P4-ep2-esp2:4:4:1:2:2:4
P4-ep4:4:4:1:4:1:4
P4-dp2-mp2-ep2-esp2:4:2:2:2:2:4
P8-2x4-ep2-esp4:8:8:1:2:4:4
P8-ep4-esp2-mp2:8:4:2:4:2:4"
for k in 1 2; do
  while IFS=: read -r name P dp mp ep esp gpn; do
    nodes=$((P / gpn))
    printf 'cluster c { nodes %d; gpus_per_node %d;\n gemm { alpha 1e-2; beta 1e-11; } alltoall { alpha 1e-1; beta 1e-7; }\n allgather { alpha 1e-1; beta 1e-7; } reducescatter { alpha 1e-1; beta 1e-7; } allreduce { alpha 1e-1; beta 1e-7; } }\n' \
      "$nodes" "$gpn" >"$WORK/c.cluster"
    model twin $((2 * dp)) $((dp * mp)) "$k" "" "" | sed 's/ALGO/nccl/' >"$WORK/twin.moe"
    if ! "$MOEC" build "$WORK/twin.moe" -o "$WORK/twin" 2>"$WORK/err"; then bad "$name k=$k: twin build" "$(cat "$WORK/err")"; continue; fi
    rm -rf "$WORK/twin.dump"
    if ! (cd "$WORK" && timeout "$TIMEOUT" ./twin --steps 3 --dump twin.dump >twin.out 2>&1 </dev/null); then
      bad "$name k=$k: twin run" "$(tail -n 20 "$WORK/twin.out")"; continue
    fi
    for algo in nccl 1dh 2dh; do
      label="$name k=$k $algo"
      model par 2 1 "$k" "parallel { dp $dp; mp $mp; ep $ep; esp $esp; }" "cluster \"$WORK/c.cluster\";" |
        sed "s/ALGO/$algo/" >"$WORK/par.moe"
      if ! "$MOEC" build "$WORK/par.moe" -o "$WORK/par" 2>"$WORK/err"; then bad "$label: build" "$(cat "$WORK/err")"; continue; fi
      rm -rf "$WORK/par.dump"
      if ! (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$P" ./par --steps 3 --dump par.dump >par.out 2>&1 </dev/null); then
        bad "$label: mpirun -np $P" "$(tail -n 20 "$WORK/par.out")"; continue
      fi
      if ! same_losses "$WORK/twin.out" "$WORK/par.out"; then
        bad "$label: losses differ from the single-rank twin" "$(paste <(losses "$WORK/twin.out") <(losses "$WORK/par.out"))"; continue
      fi
      if result=$(compare "$WORK/twin.dump" "$WORK/par.dump"); then
        ok "$label: losses and dump equal the single-rank twin: $result"
      else
        bad "$label: dump differs from the single-rank twin" "$result"
      fi
    done
  done <<<"$layouts"
done
exit $failed
