#!/usr/bin/env bash
# Checkpoints move between layouts: the same model compiled for 4 ranks (dp 2, mp 2 / ep 2,
# esp 2) saves at step 3; the builds for 2 ranks (ep 2), 8 ranks (dp 4, mp 2 / ep 4, esp 2) and
# one rank resume from it and must repeat the 4-rank run's losses for steps 4-6 (1e-5). Prints
# `ok    ...` / `FAIL  ...` lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
work reshard
model() {  # batch groups parallel-line
  cat <<MOE
model shard { batch $1; seqlen 8; embed 16; seed 4; optimizer adamw { lr 0.01; } }
$3
layer blk x 2 { moe { experts 8 { ffn gpt { hidden 32; act gelu; bias true; } }
  gate gshard { k 2; capacity 0.8; noise 0.5; aux_loss 0.1; z_loss 0.01; groups $2; } order tutel; } }
MOE
}
# The global batch is 8 samples in 8 routing groups in every build.
model 4 2 "parallel { dp 2; mp 2; ep 2; esp 2; }" >"$WORK/p4.moe"
model 4 4 "parallel { dp 2; ep 2; }" >"$WORK/p2.moe"
model 2 1 "parallel { dp 4; mp 2; ep 4; esp 2; }" >"$WORK/p8.moe"
model 8 8 "" >"$WORK/p1.moe"
build_layouts "" 1 2 4 8
if run_layout 4 --steps 6 >"$WORK/full" 2>&1 && run_layout 4 --steps 3 --save ckpt >"$WORK/first" 2>&1; then
  for n in 2 8 1; do
    if run_layout "$n" --steps 6 --resume ckpt >"$WORK/r$n" 2>&1 && close_after_3 "$WORK/full" "$WORK/r$n"; then
      ok "checkpoint of 4 ranks resumed on $n: steps 4-6 equal the 4-rank run ($(late_losses "$WORK/r$n" | tr '\n' ' '))"
    else
      bad "checkpoint of 4 ranks resumed on $n" "$(paste <(late_losses "$WORK/full") <(late_losses "$WORK/r$n"); tail -n 5 "$WORK/r$n")"
    fi
  done
else
  bad "4-rank run and checkpoint" "$(tail -n 20 "$WORK/full" "$WORK/first")"
fi
exit $failed
