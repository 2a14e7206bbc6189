#!/usr/bin/env bash
# The README's walk-throughs, run as written: the shell blocks of "A short tour", "What works
# and what is refused" (several ranks) and "Language models" are taken from README.md itself and
# run line by line in a scratch folder where build/ and lang/ are this checkout's. What a block
# leaves to the reader is filled in, and only that: the files it names (x.npy, t.npy,
# w.safetensors, saved.ir, model.moe, train.txt, val.txt) are made first; `...` becomes a step
# count; the language model's 3000 steps become 40 (make demo runs them). mpirun runs as written
# (tests/mpi/common.sh allows root and oversubscription through Open MPI's environment). The Hugging Face walk-through needs transformers: tests/interop/readme.sh (make
# interop). Prints ok/FAIL lines; exits 1 on a failure.
. "$(dirname "$0")/mpi/common.sh"   # tests/lib.sh, and mpirun as root without flags (OMPI_ALLOW_RUN_AS_ROOT)
work readme
ROOT=$(pwd)
ln -s "$ROOT/$BUILD" "$WORK/build"
ln -s "$ROOT/lang" "$WORK/lang"
export OMP_NUM_THREADS=1

# block HEADING N: the N-th ```sh block under "## HEADING" of README.md, one command a line
# (comments dropped, continuation lines of a heredoc kept as they are).
block() {
  awk -v want="## $1" -v n="$2" '
    /^## / { inside = ($0 == want); k = 0; next }
    inside && /^```sh$/ { k++; if (k == n) grab = 1; next }
    grab && /^```$/ { exit }
    grab { sub(/[[:space:]]+# .*$/, ""); if ($0 != "") print }' README.md
}

# run_block NAME FILE: runs each line of FILE in $WORK (bash -e per line); one ok line for the
# block or a FAIL naming the line that failed and its output.
run_block() {
  local name=$1 file=$2 n=0 line
  while IFS= read -r line; do
    n=$((n + 1))
    if ! (cd "$WORK" && timeout 300 bash -c "$line") >"$WORK/line.out" 2>&1 </dev/null; then
      bad "README $name: line $n fails as written: $line" "$(tail -n 8 "$WORK/line.out")"
      return
    fi
    cat "$WORK/line.out" >>"$WORK/$name.out"
  done <"$file"
  ok "README $name: $n commands run as written"
}

[ "$(block "A short tour" 1 | wc -l)" -ge 8 ] || bad "README: no 'A short tour' block with its commands"

# A short tour. Its inputs: x.npy and t.npy ([B, L, M] float32 of tiny.moe), w.safetensors (every
# parameter of tiny, in moec's names: from a --dump of the gradients).
"$MOEC" build lang/models/tiny.moe -o "$WORK/prep" 2>"$WORK/err" && (cd "$WORK" && ./prep --steps 1 --dump prep.d >/dev/null 2>&1) &&
  $PY - "$WORK" <<'EOF' || bad "README: the short tour's input files" "$(cat "$WORK/err")"
import glob, json, os, struct, sys
import numpy as np
w = sys.argv[1]
rng = np.random.default_rng(1)
np.save(os.path.join(w, "x.npy"), rng.standard_normal((2, 16, 32)).astype(np.float32))
np.save(os.path.join(w, "t.npy"), rng.standard_normal((2, 16, 32)).astype(np.float32))
tensors, header, off = [], {}, 0
for path in sorted(glob.glob(os.path.join(w, "prep.d", "grad", "*.npy"))):
    a = np.load(path).astype(np.float32) * 0.1
    name = os.path.basename(path)[:-4]
    header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
    tensors.append(a.tobytes()); off += a.nbytes
h = json.dumps(header).encode(); h += b" " * (-len(h) % 8)
with open(os.path.join(w, "w.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h))); f.write(h); f.write(b"".join(tensors))
EOF
block "A short tour" 1 >"$WORK/tour.sh"
run_block "short tour" "$WORK/tour.sh"
if grep -q '^step 20 .*loss' "$WORK/short tour.out" 2>/dev/null && grep -q '^OK$' "$WORK/short tour.out" &&
   [ -f "$WORK/out/grad/block0.moe.experts.w1.npy" ]; then
  ok "README short tour: it trained, resumed, passed --check-grad and dumped the gradients"
else
  bad "README short tour: the output the README describes" "$(tail -n 5 "$WORK/short tour.out" 2>/dev/null)"
fi

# Look inside: saved.ir is an IR dump of the tour's model.
"$MOEC" dump-ir lang/models/tiny.moe --after=lower >"$WORK/saved.ir" 2>"$WORK/err" || bad "README: saved.ir" "$(cat "$WORK/err")"
block "A short tour" 2 >"$WORK/inside.sh"
run_block "look inside" "$WORK/inside.sh"

# Several ranks: model.moe is the tour's model on 4 ranks (dp 4, ep 4), model-on-2-ranks the same
# model compiled for 2; "..." is the rest of a command line.
sed '0,/^layer /s//parallel { dp 4; ep 4; }\nlayer /' lang/models/tiny.moe >"$WORK/model.moe"
sed '0,/^layer /s//parallel { dp 2; ep 2; }\nlayer /' lang/models/tiny.moe >"$WORK/model2.moe"
"$MOEC" build "$WORK/model2.moe" -o "$WORK/model-on-2-ranks" 2>"$WORK/err" || bad "README: model-on-2-ranks" "$(cat "$WORK/err")"
block "What works and what is refused" 1 |
  sed "s|^\./model-on-2-ranks \.\.\. |mpirun -np 2 ./model-on-2-ranks --steps 30 |" >"$WORK/ranks.sh"
run_block "several ranks" "$WORK/ranks.sh"

# Language models: train.txt and val.txt from Debian's license texts (as make demo uses);
# gpt-dp2-mp2-ep4 the same model on dp2·mp2·ep4.
cat /usr/share/common-licenses/GPL-3 >"$WORK/train.txt" 2>/dev/null || head -c 40000 README.md >"$WORK/train.txt"
cat /usr/share/common-licenses/Apache-2.0 >"$WORK/val.txt" 2>/dev/null || tail -c 8000 README.md >"$WORK/val.txt"
sed '0,/^layer /s//parallel { dp 2; mp 2; ep 4; esp 1; }\nlayer /' lang/models/gpt_moe_bytes.moe >"$WORK/gpt4.moe"
"$MOEC" build "$WORK/gpt4.moe" -o "$WORK/gpt-dp2-mp2-ep4" 2>"$WORK/err" || bad "README: gpt-dp2-mp2-ep4" "$(cat "$WORK/err")"
block "Language models" 1 |
  sed "s|--eval-every 500 --steps 3000|--eval-every 20 --steps 40|; s|\.\.\.\$|--steps 5|" >"$WORK/lm.sh"
run_block "language models" "$WORK/lm.sh"
if grep -q '^# sample' "$WORK/language models.out" 2>/dev/null && grep -q '^val' "$WORK/language models.out"; then
  ok "README language models: trained with validation, sampled after the prompt"
else
  bad "README language models: the validation lines and the sample" "$(tail -n 5 "$WORK/language models.out" 2>/dev/null)"
fi
exit $failed
