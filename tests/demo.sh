#!/usr/bin/env bash
# `make demo`: compile the shipped byte-level GPT-MoE and train it on Debian's license texts, on a
# GPU where one is visible, else on the CPU, printing the validation loss and a generated sample.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
# The byte-level GPT-MoE (lang/models/gpt_moe_bytes.moe) on the license texts every Debian machine
# has (base-files: /usr/share/common-licenses): the first 90 % of GPL-3 and seven other licenses
# (126 KB) to train on, the last 10 % of GPL-3 to validate; then a sample from the trained weights.
LICENSES=/usr/share/common-licenses
TEXT=$LICENSES/GPL-3
if [ ! -f "$TEXT" ]; then
  echo "demo: $TEXT is missing (Debian's base-files package installs it)" >&2
  exit 1
fi
mkdir -p "$BUILD/demo"
size=$(stat -c %s "$TEXT")
head -c $((size * 9 / 10)) "$TEXT" > "$BUILD/demo/train.txt"
tail -c +$((size * 9 / 10 + 1)) "$TEXT" > "$BUILD/demo/val.txt"
for more in GPL-2 LGPL-2.1 LGPL-3 Apache-2.0 GFDL-1.3 Artistic BSD; do
  [ -f "$LICENSES/$more" ] && cat "$LICENSES/$more" >> "$BUILD/demo/train.txt"
done
MODEL=lang/models/gpt_moe_bytes.moe
BIN="$BUILD/demo/gpt_moe_bytes"
# 3000 steps (1.5 M tokens, about 12 passes over the text), then a checkpoint; the sample comes
# from the checkpoint (the run's step lines stay one progress line on a terminal).
RUN=(--steps 3000 --data "$BUILD/demo/train.txt" --val "$BUILD/demo/val.txt" --eval-every 500
     --save "$BUILD/demo/trained")
SAMPLE=(--resume "$BUILD/demo/trained" --sample 300 --prompt "The GNU General Public License" --temperature 0.6)
# --target auto: the CUDA target where a GPU is visible (moec says which it picked and why),
# else the CPU. Should the GPU run fail, the demo says so and trains the CPU build instead.
echo "# moec build $MODEL --target auto -o $BIN -v"
"$BUILD/moec" build "$MODEL" --target auto -o "$BIN" -v 2>&1 | tee "$BUILD/demo-build.log"
echo "# $BIN ${RUN[*]}"
target=cpu
grep -q '^# target: auto -> cuda' "$BUILD/demo-build.log" && target=cuda
if ! "$BIN" "${RUN[@]}"; then
  if [ $target = cuda ]; then
    echo "# the GPU run failed (above); building for the CPU and training there"
    target=cpu
    "$BUILD/moec" build "$MODEL" --target cpu -o "$BIN"
    "$BIN" "${RUN[@]}"
  else
    exit 1
  fi
fi
echo "# $BIN ${SAMPLE[*]}"
"$BIN" "${SAMPLE[@]}" | tee "$BUILD/demo/sample.out"
# How much of the sample is the text's words: its space-separated words (the prompt's left out)
# that are space-separated words of the training text. The CPU run gives the same bits on every
# machine and number of threads, so there it must be at least half; a GPU's run is only reported.
words=$(awk 'FNR == NR { for (i = 1; i <= NF; i++) known[$i] = 1; next }
             /^# sample:/ { on = 1; next }
             on { if (!seen++) sub(/^The GNU General Public License/, "")
                  for (i = 1; i <= NF; i++) { n++; if ($i in known) k++ } }
             END { printf "%d %d", k, n }' "$BUILD/demo/train.txt" "$BUILD/demo/sample.out")
read -r known total <<<"$words"
echo "# the sample: $known of its $total words are words of the training text"
if [ $target = cpu ] && [ $((2 * known)) -lt "$total" ]; then
  echo "demo: fewer than half of the sample's words are words of the training text" >&2
  exit 1
fi
/usr/bin/python3 - "$BUILD/demo/train.txt" 2>/dev/null <<'PY' || true
import math, sys
from collections import Counter
data = open(sys.argv[1], "rb").read()
c = Counter(data)
h = -sum(n / len(data) * math.log(n / len(data)) for n in c.values())
print("# the training text's unigram entropy: %.4f nats per byte (the val ce above is below it once the model" % h)
print("# uses context)")
PY
cat <<MSG

# next:
#   $BUILD/moec dump-ir $MODEL --after=lower    the forward IR of the model
#   $BUILD/moec build lang/models/tiny.moe -o tiny && ./tiny  an MoE stack on float data
#   $BUILD/moec dump-ir lang/models/tiny.moe --all            the IR after every pass
#   $BIN --help    what the training binary can do (--data, --val, --sample, --save, --dump, ...)
#   $BUILD/moec build tests/golden/parallel.moe -o p4 -v      a 4-rank layout (then: mpirun -np 4 ./p4)
#   $BUILD/moec build tests/golden/plan.moe -o pl -v          degrees and gradient slots planned in the build
#   $BUILD/moec plan tests/golden/parallel.moe --cluster lang/clusters/testbed-b.cluster --svg plan.svg
#   lang/manual.md                                             the .moe language
MSG
