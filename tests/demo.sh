#!/usr/bin/env bash
# `make demo`: compile the shipped byte-level GPT-MoE and train it on the GPL-3 text, on a GPU where
# one is visible, else on the CPU, printing the validation loss and a generated sample.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
# The byte-level GPT-MoE (lang/models/gpt_moe_bytes.moe) on the GPL-3 text every Debian machine has:
# the first 90 % to train on, the last 10 % to validate; then a sample from the trained weights.
TEXT=/usr/share/common-licenses/GPL-3
if [ ! -f "$TEXT" ]; then
  echo "demo: $TEXT is missing (Debian's base-files package installs it)" >&2
  exit 1
fi
mkdir -p "$BUILD/demo"
size=$(stat -c %s "$TEXT")
head -c $((size * 9 / 10)) "$TEXT" > "$BUILD/demo/train.txt"
tail -c +$((size * 9 / 10 + 1)) "$TEXT" > "$BUILD/demo/val.txt"
MODEL=lang/models/gpt_moe_bytes.moe
BIN="$BUILD/demo/gpt_moe_bytes"
RUN=(--steps 600 --data "$BUILD/demo/train.txt" --val "$BUILD/demo/val.txt" --eval-every 100
     --sample 300 --prompt "The GNU General Public License" --temperature 0.8)
# --target auto: the CUDA target where a GPU is visible (moec says which it picked and why),
# else the CPU. Should the GPU run fail, the demo says so and trains the CPU build instead.
echo "# moec build $MODEL --target auto -o $BIN -v"
"$BUILD/moec" build "$MODEL" --target auto -o "$BIN" -v 2>&1 | tee "$BUILD/demo-build.log"
echo "# $BIN ${RUN[*]}"
if ! "$BIN" "${RUN[@]}"; then
  if grep -q '^# target: auto -> cuda' "$BUILD/demo-build.log"; then
    echo "# the GPU run failed (above); building for the CPU and training there"
    "$BUILD/moec" build "$MODEL" --target cpu -o "$BIN"
    "$BIN" "${RUN[@]}"
  else
    exit 1
  fi
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
