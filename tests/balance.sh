#!/usr/bin/env bash
# Aux-loss-free load balancing (`gate ... { balance bias RATE; }`, DeepSeek-V3's): after each step
# the correction bias moves by RATE against the sign of each expert's load above the mean, summed
# over the ranks. Checks:
#  - a router that starts skewed (its learned bias favours 3 of 8 experts) is balanced by the
#    update: the largest expert's load over the mean after 300 steps, rate 0 (the bias never
#    moves) beside rate 0.02, printed as a table;
#  - the update is the same on 1 and 4 ranks (dp4 ep4, and dp2 mp2 ep2 esp2): the same losses for
#    8 steps, the same step-1 dump (the bias's "gradient" is the summed load), and bit-equal
#    correction biases in the checkpoints after 8 steps;
#  - the bias is saved and resumed: 4 steps, then 4 more from the checkpoint, equal 8 in one run.
. "$(dirname "$0")/mpi/common.sh"
work balance
TIMEOUT=${BALANCE_TIMEOUT:-120}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1

# The bias tensors NAMES... of two checkpoints' first shards, bit for bit.
same_bias() {  # shard-a shard-b
  "$PY" - "$1" "$2" <<'PYEOF'
import json, struct, sys
import numpy as np
def load(path):
    data = open(path, "rb").read()
    (n,) = struct.unpack("<Q", data[:8])
    head = json.loads(data[8:8 + n])
    return {k: np.frombuffer(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]], "<f4")
            for k, v in head.items() if k.endswith("moe.gate.eb") and not k.startswith("opt.")}
a, b = load(sys.argv[1]), load(sys.argv[2])
if not a or sorted(a) != sorted(b):
    print("bias tensors: %s vs %s" % (sorted(a), sorted(b))); sys.exit(1)
moved = 0
for k in sorted(a):
    if not np.array_equal(a[k], b[k]):
        print("%s: %s vs %s" % (k, a[k], b[k])); sys.exit(1)
    moved += int(np.count_nonzero(a[k]))
print("%d tensors, %d entries moved" % (len(a), moved))
PYEOF
}

# ---- a skewed router, with and without the update ----
cat >"$WORK/skew.moe" <<'EOF'
model skew { batch 8; seqlen 16; embed 32; seed 3; optimizer adamw { lr 0.003; } }
layer blk {
  moe {
    experts 8 { ffn mixtral { hidden 32; } }
    gate sigmoid { k 2; capacity *; bias true; renormalize true; balance bias RATE; }
  }
}
EOF
skew_ok=1
for rate in 0 0.02; do
  sed "s/RATE/$rate/" "$WORK/skew.moe" >"$WORK/s$rate.moe"
  if ! "$MOEC" build "$WORK/s$rate.moe" -o "$WORK/s$rate" 2>"$WORK/err"; then bad "skewed router, rate $rate: build" "$(cat "$WORK/err")"; skew_ok=0; fi
done
# The starting point: the model's own initial weights, its router bias set to favour experts 0-2.
if [ $skew_ok = 1 ] && (cd "$WORK" && ./s0 --steps 0 --save init >/dev/null 2>&1) &&
   "$PY" - "$WORK/init.rank0-of-1.safetensors" "$WORK/W.safetensors" <<'PYEOF'
import json, struct, sys
data = open(sys.argv[1], "rb").read()
(n,) = struct.unpack("<Q", data[:8])
head = json.loads(data[8:8 + n])
tensors = {k: bytearray(data[8 + n + v["data_offsets"][0]:8 + n + v["data_offsets"][1]])
           for k, v in head.items() if k != "__metadata__" and not k.startswith("opt.")}
tensors["blk0.moe.gate.bg"][:] = struct.pack("<8f", 3.0, 2.5, 2.0, 0, 0, 0, 0, 0)
out, blobs, off = {}, [], 0
for k in sorted(tensors):
    out[k] = {"dtype": "F32", "shape": head[k]["shape"], "data_offsets": [off, off + len(tensors[k])]}
    off += len(tensors[k])
hj = json.dumps(out).encode()
hj += b" " * (-len(hj) % 8)
with open(sys.argv[2], "wb") as f:
    f.write(struct.pack("<Q", len(hj)) + hj + b"".join(tensors[k] for k in sorted(tensors)))
PYEOF
then
  for rate in 0 0.02; do
    (cd "$WORK" && timeout "$TIMEOUT" ./s$rate --steps 300 --weights W.safetensors --log l$rate.jsonl >s$rate.out 2>&1) ||
      { bad "skewed router, rate $rate: run" "$(tail -n 5 "$WORK/s$rate.out")"; skew_ok=0; }
  done
else
  bad "skewed router: the starting weights" "$(cat "$WORK/err" 2>/dev/null)"; skew_ok=0
fi
if [ $skew_ok = 1 ]; then
  table=$("$PY" - "$WORK/l0.jsonl" "$WORK/l0.02.jsonl" <<'PYEOF'
import json, sys
runs = [[json.loads(l) for l in open(p) if l.startswith('{"step"')] for p in sys.argv[1:]]
ratio = lambda r, s: r[s - 1]["layers"][0]["load_max"] / r[s - 1]["layers"][0]["load_mean"]
print("  step   rate 0 (no update)   rate 0.02   (the largest expert's load over the mean; 8 experts, k 2)")
for s in (1, 10, 50, 100, 200, 300):
    print("  %4d   %8.2f             %8.2f" % (s, ratio(runs[0], s), ratio(runs[1], s)))
last = [sum(ratio(r, s) for s in range(251, 301)) / 50 for r in runs]
print("  mean of steps 251-300: %.2f without, %.2f with the update" % tuple(last))
sys.exit(0 if last[0] >= 3.0 and last[1] <= 1.6 else 1)
PYEOF
  ) && ok "aux-loss-free balancing evens a skewed router out:
$table" || bad "aux-loss-free balancing on a skewed router (want >= 3.0 without, <= 1.6 with)" "$table"
fi

# ---- the same update on 1 and 4 ranks ----
model() {  # name batch groups parallel-line
  cat <<EOF
model $1 { batch $2; seqlen 8; embed 16; seed 9; optimizer adamw { lr 0.01; } }
$4
layer blk x 2 {
  moe {
    experts 8 { ffn mixtral { hidden 32; } }
    gate sigmoid { k 2; capacity 0.8; groups $3; renormalize true; expert_groups 4; topk_groups 2; scale 2.5;
                   balance bias 0.05; }
  }
}
EOF
}
model twin 8 4 "" >"$WORK/twin.moe"
if ! "$MOEC" build "$WORK/twin.moe" -o "$WORK/twin" 2>"$WORK/err"; then
  bad "balance on 1 rank: build" "$(cat "$WORK/err")"
elif ! (cd "$WORK" && timeout "$TIMEOUT" ./twin --steps 8 --dump twin.dump --save tck >twin.out 2>&1); then
  bad "balance on 1 rank: run" "$(tail -n 5 "$WORK/twin.out")"
else
  # name P dp mp ep esp (groups dp*mp in the twin: one routing group per rank's tokens)
  while IFS=: read -r name P dp mp ep esp; do
    model par $((8 / dp)) 1 "parallel { dp $dp; mp $mp; ep $ep; esp $esp; }" >"$WORK/par.moe"
    [ $((dp * mp)) = 4 ] || { bad "$name: the twin has 4 routing groups, the layout $((dp * mp))"; continue; }
    rm -rf "$WORK/par.dump" "$WORK"/pck*
    if ! "$MOEC" build "$WORK/par.moe" -o "$WORK/par" 2>"$WORK/err"; then bad "$name: build" "$(cat "$WORK/err")"; continue; fi
    if ! (cd "$WORK" && timeout "$TIMEOUT" $MPIRUN -np "$P" ./par --steps 8 --dump par.dump --save pck >par.out 2>&1 </dev/null); then
      bad "$name: mpirun -np $P" "$(tail -n 20 "$WORK/par.out")"; continue
    fi
    if ! same_losses "$WORK/twin.out" "$WORK/par.out"; then
      bad "$name: losses differ from one rank" "$(paste <(losses "$WORK/twin.out") <(losses "$WORK/par.out"))"; continue
    fi
    if ! dump=$(compare_dumps "$WORK/twin.dump" "$WORK/par.dump"); then bad "$name: step-1 dump differs" "$dump"; continue; fi
    if bias=$(same_bias "$WORK/tck.rank0-of-1.safetensors" "$WORK/pck.rank0-of-$P.safetensors"); then
      ok "balance on $name equals one rank: 8 losses, the step-1 dump ($dump), the correction biases after 8 steps bit for bit ($bias)"
    else
      bad "$name: the correction biases differ from one rank" "$bias"
    fi
  done <<'EOF'
P4-dp4-ep4:4:4:1:4:1
P4-dp2-mp2-ep2-esp2:4:2:2:2:2
EOF
  # saved and resumed
  if (cd "$WORK" && ./twin --steps 4 --save half >a.out 2>&1 && ./twin --steps 8 --resume half --save rck >b.out 2>&1) &&
     same_losses <(grep '^step' "$WORK/twin.out") <(cat "$WORK/a.out" "$WORK/b.out" | grep '^step' | grep -v '^step 0') 0 &&
     bias=$(same_bias "$WORK/tck.rank0-of-1.safetensors" "$WORK/rck.rank0-of-1.safetensors"); then
    ok "the correction biases are saved and resumed: 4 + 4 steps equal 8 ($bias)"
  else
    bad "the correction biases across a resume" "$(cat "$WORK/b.out" 2>/dev/null | tail -n 3; echo "${bias:-}")"
  fi
fi
exit $failed
