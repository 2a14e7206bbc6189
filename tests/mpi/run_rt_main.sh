#!/usr/bin/env bash
# The training driver rt_main on several MPI ranks: runs $BUILD/mpi/test_rt_main (a hand-written
# per-expert linear model, tests/mpi/test_rt_main.c; built by `make test`, or here with mpicc
# when missing) on the layouts below and checks that the layout does not change the math.
# One line per check (ok / FAIL); exit status 1 if anything failed.
#
# Layouts (dp,mp,ep,esp; a global batch of 8 samples): 1,1,1,1 (without mpirun); P=2: 2,1,2,1
# and 1,2,1,2; P=4: 2,2,2,2, 4,1,4,1 and 1,4,1,4; P=8: 2,4,4,2.
# - every layout prints the single-rank run's losses (6 AdamW steps), only from rank 0, and the
#   load figures of its own routing groups;
# - --dump writes the same whole tensors (input and target bit for bit, the rest to 1e-5);
# - --steps 0 --save: every layout initialises the same whole tensors, bit for bit;
# - a checkpoint saved by 4 ranks at step 3 resumes on 1, 2, 4 (another layout) and 8 ranks
#   with the single-rank run's losses for steps 4-6; --steps 0 --resume --save converts it to 1
#   and 8 shards holding the same tensors;
# - --input/--target hold the global batch; --check-grad passes on 4 ranks;
# - broken checkpoints (a shard missing, an index that leaves a region uncovered, a torn save,
#   a shard given as the checkpoint) and a layout that does not fit the world fail on every
#   rank with one "moert: error:" line, under `timeout`.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
work rtmain
mpi_program test_rt_main
MPIRUN=("${MPIRUN_PLAIN[@]}")
TIMEOUT=60
TOL=1e-5

# ranks LAYOUT: dp * mp
ranks() { local IFS=,; set -- $1; echo $(($1 * $2)); }
# name LAYOUT: "dp 2 mp 2 ep 2 esp 2"
name() { local IFS=,; set -- $1; echo "dp $1 mp $2 ep $3 esp $4"; }

# run TAG LAYOUT ARGS...: the model on LAYOUT's ranks (one: without mpirun), stdout and stderr
# to $WORK/TAG.out and .err; returns the exit status.
run() {
  local tag=$1 layout=$2; shift 2
  local np; np=$(ranks "$layout")
  local cmd=("$BIN" "$layout" "$@")
  [ "$np" -gt 1 ] && cmd=("${MPIRUN[@]}" -np "$np" "${cmd[@]}")
  timeout "$TIMEOUT" "${cmd[@]}" >"$WORK/$tag.out" 2>"$WORK/$tag.err"
}

# losses FILE [FROM]: "step loss mse aux z dropped" of every step line from step FROM on, by their
# names (aux and z are on the line only where the objective has them: 0 otherwise).
losses() {
  awk -v from="${2:-1}" '$1 == "step" && $2 >= from {
    delete v; for (i = 3; i < NF; i += 2) v[$i] = $(i + 1)
    print $2, v["loss"], v["mse"], v["aux"] + 0, v["z"] + 0, v["dropped"] }' "$1"
}
# loads FILE: the load and capacity figures of step 1 ("load min/mean/max A/B/C  capacity N").
loads() { awk '$1 == "step" && $2 == 1 { for (i = 1; i <= NF; i++) if ($i == "load") { s = $i " " $(i + 1) " " $(i + 2); if ($(i + 3) == "capacity") s = s "  capacity " $(i + 4); print s } }' "$1"; }

# same_losses A B: the same steps, every figure within TOL (relative, at least absolute).
same_losses() {
  [ -n "$1" ] && paste -d' ' <(echo "$1") <(echo "$2") | awk -v tol="$TOL" '
    function off(a, b) { d = a - b; if (d < 0) d = -d; m = a < 0 ? -a : a; if (m < 1) m = 1; return d > tol * m }
    NF != 12 || $1 != $7 { bad = 1 }
    { for (i = 2; i <= 6; i++) if (off($i, $(i + 6))) bad = 1 }
    END { exit bad }'
}

LAYOUTS="1,1,1,1 2,1,2,1 1,2,1,2 2,2,2,2 4,1,4,1 1,4,1,4 2,4,4,2"

# ---- training, dumps and initial values on every layout ----
for layout in $LAYOUTS; do
  tag=train_${layout//,/_}
  label="P=$(ranks "$layout") ($(name "$layout"))"
  if ! run "$tag" "$layout" adamw --steps 6 --dump "$WORK/$tag.dump" --save "$WORK/$tag.ckpt"; then
    bad "$label: trains 6 steps" "$(cat "$WORK/$tag.out" "$WORK/$tag.err")"
    continue
  fi
  out=$WORK/$tag.out
  if [ "$(grep -c '^step 1 ' "$out")" = 1 ] && [ "$(losses "$out" | wc -l)" = 6 ] && [ ! -s "$WORK/$tag.err" ]; then
    ok "$label: trains 6 steps, only rank 0 prints"
  else
    bad "$label: trains 6 steps, only rank 0 prints" "$(cat "$out" "$WORK/$tag.err")"
  fi
  if [ "$layout" != 1,1,1,1 ]; then
    want=$(losses "$WORK/train_1_1_1_1.out"); got=$(losses "$out")
    if same_losses "$want" "$got"; then ok "$label: losses equal the single-rank run"
    else bad "$label: losses equal the single-rank run" "$(diff <(echo "$want") <(echo "$got"))"; fi
    if err=$("$BIN" --same-dump "$WORK/train_1_1_1_1.dump" "$WORK/$tag.dump" "$TOL" 2>&1); then
      ok "$label: --dump holds the single-rank run's whole tensors"
    else
      bad "$label: --dump holds the single-rank run's whole tensors" "$err"
    fi
  fi
  want=$("$BIN" --expect-loads "$layout"); got=$(loads "$out")
  if [ -n "$got" ] && [ "$want" = "$got" ]; then ok "$label: load figures over its routing groups ($got)"
  else bad "$label: load figures over its routing groups" "want: $want"$'\n'"got:  $got"; fi

  itag=init_${layout//,/_}
  if run "$itag" "$layout" adamw --steps 0 --save "$WORK/$itag.ckpt" &&
     err=$("$BIN" --same-checkpoint "$WORK/init_1_1_1_1.ckpt" "$WORK/$itag.ckpt" adamw 0 2>&1); then
    ok "$label: initial parameters equal the single-rank ones bit for bit"
  else
    bad "$label: initial parameters equal the single-rank ones bit for bit" "$(cat "$WORK/$itag.err" 2>/dev/null; echo "${err:-}")"
  fi
done

# ---- a checkpoint of 4 ranks resumed on other layouts ----
if run save4 2,2,2,2 adamw --steps 3 --save "$WORK/c4" && [ "$(ls "$WORK"/c4.rank*-of-4.safetensors | wc -l)" = 4 ]; then
  ok "P=4 saves a checkpoint at step 3: an index and 4 shards"
  want=$(losses "$WORK/train_1_1_1_1.out" 4)
  for layout in 1,1,1,1 2,1,2,1 4,1,4,1 2,4,4,2; do
    label="checkpoint of P=4 resumed on P=$(ranks "$layout") ($(name "$layout"))"
    tag=resume_${layout//,/_}
    if run "$tag" "$layout" adamw --resume "$WORK/c4" --steps 6 --save "$WORK/$tag.ckpt" &&
       got=$(losses "$WORK/$tag.out") && same_losses "$want" "$got" && [ -z "$(losses "$WORK/$tag.out" 1 | awk '$1 < 4')" ]; then
      ok "$label: steps 4-6 repeat the uninterrupted single-rank run"
    else
      bad "$label: steps 4-6 repeat the uninterrupted single-rank run" "$(cat "$WORK/$tag.out" "$WORK/$tag.err")"
    fi
    if err=$("$BIN" --same-checkpoint "$WORK/train_1_1_1_1.ckpt" "$WORK/$tag.ckpt" adamw "$TOL" 2>&1); then
      ok "$label: the step-6 checkpoint equals the single-rank run's"
    else
      bad "$label: the step-6 checkpoint equals the single-rank run's" "$err"
    fi
  done
  for layout in 1,1,1,1 2,4,4,2; do
    np=$(ranks "$layout")
    label="--steps 0 --resume --save converts the P=4 checkpoint to $np shard$([ "$np" = 1 ] || echo s)"
    tag=convert_$np
    if run "$tag" "$layout" adamw --steps 0 --resume "$WORK/c4" --save "$WORK/$tag" &&
       [ "$(ls "$WORK/$tag".rank*-of-"$np".safetensors | wc -l)" = "$np" ] &&
       grep -q "\"world\": $np," "$WORK/$tag" && grep -q '"step": 3,' "$WORK/$tag" &&
       err=$("$BIN" --same-checkpoint "$WORK/c4" "$WORK/$tag" adamw 0 2>&1); then
      ok "$label, same tensors bit for bit"
    else
      bad "$label, same tensors bit for bit" "$(cat "$WORK/$tag.out" "$WORK/$tag.err"; echo "${err:-}")"
    fi
  done
else
  bad "P=4 saves a checkpoint at step 3: an index and 4 shards" "$(cat "$WORK/save4.out" "$WORK/save4.err")"
fi

# ---- data files hold the global batch ----
dump=$WORK/train_1_1_1_1.dump
if run input1 1,1,1,1 adamw --steps 2 --input "$dump/input.npy" --target "$dump/target.npy" &&
   run input4 2,2,2,2 adamw --steps 2 --input "$dump/input.npy" --target "$dump/target.npy" &&
   same_losses "$(losses "$WORK/input1.out")" "$(losses "$WORK/input4.out")" &&
   [ "$(losses "$WORK/input1.out" | head -n 1)" = "$(losses "$WORK/train_1_1_1_1.out" | head -n 1)" ]; then
  ok "--input/--target [8, 4, 8] (the global batch) on P=4 equal the single-rank run"
else
  bad "--input/--target [8, 4, 8] (the global batch) on P=4 equal the single-rank run" "$(cat "$WORK/input1.out" "$WORK/input4.out" "$WORK/input4.err")"
fi

# ---- gradient check ----
if run grad4 2,2,2,2 sgd --check-grad && [ "$(tail -n 1 "$WORK/grad4.out")" = OK ] &&
   [ "$(grep -c '^# gradient check' "$WORK/grad4.out")" = 1 ] &&
   [ "$(grep -c ' OK$' "$WORK/grad4.out")" = 4 ]; then
  ok "--check-grad on P=4 ($(name 2,2,2,2)): every parameter within tolerance"
else
  bad "--check-grad on P=4 ($(name 2,2,2,2)): every parameter within tolerance" "$(cat "$WORK/grad4.out" "$WORK/grad4.err")"
fi

# ---- failures: every rank exits non-zero, one message, no hang ----
# fails LABEL EXPECTED LAYOUT ARGS...: non-zero exit within the timeout and exactly one
# "moert: error:" line on stderr, containing EXPECTED.
fails() {
  local label=$1 expected=$2 layout=$3; shift 3
  run fail "$layout" "$@"
  local status=$?
  local lines; lines=$(grep -c 'moert: error:' "$WORK/fail.err")
  if [ $status -ne 0 ] && [ $status -ne 124 ] && [ "$lines" = 1 ] && grep -q -- "$expected" "$WORK/fail.err"; then
    ok "$label"
  else
    bad "$label (exit status $status, $lines error lines)" "$(cat "$WORK/fail.out" "$WORK/fail.err")"
  fi
}

if [ -f "$WORK/c4" ]; then
  mkdir -p "$WORK/broken"
  cp "$WORK"/c4* "$WORK/broken/"
  rm "$WORK/broken/c4.rank2-of-4.safetensors"
  fails "resume with a shard file missing fails on every rank" \
    "c4.rank2-of-4.safetensors': No such file or directory" 2,1,2,1 adamw --resume "$WORK/broken/c4"
  cp "$WORK"/c4* "$WORK/broken/"
  grep -v 'rank2-of-4' "$WORK/c4" | sed 's/"world": 4/"world": 3/' >"$WORK/broken/c4"
  fails "resume from an index that leaves a region uncovered names the element" \
    "does not cover tensor 'moe.experts.w'" 1,1,1,1 adamw --resume "$WORK/broken/c4"
  cp "$WORK"/c4* "$WORK/broken/"
  cp "$WORK/train_2_2_2_2.ckpt.rank1-of-4.safetensors" "$WORK/broken/c4.rank1-of-4.safetensors"
  fails "resume from a torn checkpoint (a shard of another step) fails" \
    "is at step 6 but the index says 3" 4,1,4,1 adamw --resume "$WORK/broken/c4"
  fails "resume from a shard file instead of the index says so" \
    "is one shard of a checkpoint" 2,2,2,2 adamw --resume "$WORK/c4.rank0-of-4.safetensors"
  fails "resume with the other optimizer fails" \
    "trained with optimizer adamw, but this binary uses sgd" 2,2,2,2 sgd --resume "$WORK/c4"
fi
# A layout for 4 ranks run on 2: rt_comm_create refuses it from rank 0 alone (one line per failed
# check, each once).
np2_as_4() {
  timeout "$TIMEOUT" "${MPIRUN[@]}" -np 2 "$BIN" 2,2,2,2 sgd --steps 1 >"$WORK/fail.out" 2>"$WORK/fail.err"
}
np2_as_4
status=$?
if [ $status -ne 0 ] && [ $status -ne 124 ] &&
   [ "$(grep -c 'moert: error: the layout needs 4 ranks (dp 2 x mp 2 = ep 2 x esp 2) but 2 are running' "$WORK/fail.err")" = 1 ] &&
   [ "$(grep 'moert: error:' "$WORK/fail.err" | sort | uniq -d)" = "" ]; then
  ok "a layout for 4 ranks started on 2 fails on every rank with one message"
else
  bad "a layout for 4 ranks started on 2 fails on every rank with one message (exit status $status)" "$(cat "$WORK/fail.out" "$WORK/fail.err")"
fi

printf '# %d passed, %d failed\n' "$passed" "$nfailed"
exit $failed
