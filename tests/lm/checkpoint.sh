#!/usr/bin/env bash
# Checkpoints of a language model: tests/models/grad_lm_gpt.moe with adamw, a warmup, a cosine
# decay and clipping (so the step counter and the optimizer state both matter).
#   - one rank: 3 steps, save, resume to 6 repeats the uninterrupted run's steps 4-6 bit for bit;
#   - the 4-rank build dp2·mp2·ep4 (attention split by heads over MP) saves at step 3; builds for
#     one rank, 2 ranks (dp2·ep2) and 8 ranks (dp4·mp2·ep4·esp2) resume from it and repeat the
#     4-rank run's losses for steps 4-6 (1e-5 relative), the global batch and its 8 routing groups
#     the same in every build;
#   - the one-rank checkpoint resumes on the 4-rank build the same way.
# Prints ok/FAIL lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
work lm-ckpt
M=tests/models/grad_lm_gpt.moe

model() {  # batch groups parallel-line
  sed "s/batch 2;/batch $1;/; s/capacity 0.5;/capacity 0.5; groups $2;/;
       s/optimizer sgd { lr 0.01; }/optimizer adamw { lr 0.01; warmup 2; decay_steps 6; min_lr 0.001; clip 0.5; }/;
       s/^layer block x 2/$3\nlayer block x 2/" "$M"
}
model 8 8 "" >"$WORK/p1.moe"
model 4 4 "parallel { dp 2; ep 2; }" >"$WORK/p2.moe"
model 4 2 "parallel { dp 2; mp 2; ep 4; }" >"$WORK/p4.moe"
model 2 1 "parallel { dp 4; mp 2; ep 4; esp 2; }" >"$WORK/p8.moe"
build_layouts "lm checkpoint: " 1 2 4 8

if run_layout 1 --steps 6 >"$WORK/full1" 2>&1 && run_layout 1 --steps 3 --save one.ckpt >"$WORK/first1" 2>&1 &&
   run_layout 1 --steps 6 --resume one.ckpt >"$WORK/again1" 2>&1; then
  if [ -n "$(late_losses "$WORK/full1")" ] && [ "$(late_losses "$WORK/full1")" = "$(late_losses "$WORK/again1")" ]; then
    ok "lm checkpoint: one rank saved at step 3 and resumed repeats steps 4-6 bit for bit ($(late_losses "$WORK/again1" | tr '\n' ' '))"
  else
    bad "lm checkpoint: one-rank resume differs" "$(paste <(late_losses "$WORK/full1") <(late_losses "$WORK/again1"))"
  fi
else
  bad "lm checkpoint: one-rank runs" "$(tail -n 5 "$WORK/full1" "$WORK/first1" "$WORK/again1" 2>/dev/null)"
fi

if run_layout 4 --steps 6 >"$WORK/full4" 2>&1 && run_layout 4 --steps 3 --save four.ckpt >"$WORK/first4" 2>&1; then
  for n in 1 2 8; do
    if run_layout "$n" --steps 6 --resume four.ckpt >"$WORK/r$n" 2>&1 && close_after_3 "$WORK/full4" "$WORK/r$n"; then
      ok "lm checkpoint of dp2·mp2·ep4 resumed on $n rank(s): steps 4-6 equal the 4-rank run ($(late_losses "$WORK/r$n" | tr '\n' ' '))"
    else
      bad "lm checkpoint of dp2·mp2·ep4 resumed on $n rank(s)" "$(paste <(late_losses "$WORK/full4") <(late_losses "$WORK/r$n"); tail -n 5 "$WORK/r$n")"
    fi
  done
  if run_layout 4 --steps 6 --resume one.ckpt >"$WORK/r41" 2>&1 && close_after_3 "$WORK/full4" "$WORK/r41"; then
    ok "lm checkpoint of one rank resumed on dp2·mp2·ep4: steps 4-6 equal the 4-rank run"
  else
    bad "lm checkpoint of one rank resumed on dp2·mp2·ep4" "$(paste <(late_losses "$WORK/full4") <(late_losses "$WORK/r41"); tail -n 5 "$WORK/r41")"
  fi
else
  bad "lm checkpoint: 4-rank run and checkpoint" "$(tail -n 20 "$WORK/full4" "$WORK/first4")"
fi
exit $failed
