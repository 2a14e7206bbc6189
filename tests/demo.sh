#!/usr/bin/env bash
# `make demo`: compile the shipped tiny model and train it for 20 steps, on a GPU where one is
# visible, else on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
# --target auto: the CUDA target where a GPU is visible (moec says which it picked and why),
# else the CPU. Should the GPU run fail, the demo says so and trains the CPU build instead.
echo "# moec build lang/models/tiny.moe --target auto -o $BUILD/tiny -v"
"$BUILD/moec" build lang/models/tiny.moe --target auto -o "$BUILD/tiny" -v 2>&1 | tee "$BUILD/demo-build.log"
echo "# $BUILD/tiny --steps 20"
if ! "$BUILD/tiny" --steps 20; then
  if grep -q '^# target: auto -> cuda' "$BUILD/demo-build.log"; then
    echo "# the GPU run failed (above); building for the CPU and training there"
    "$BUILD/moec" build lang/models/tiny.moe --target cpu -o "$BUILD/tiny"
    "$BUILD/tiny" --steps 20
  else
    exit 1
  fi
fi
cat <<MSG

# next:
#   $BUILD/moec dump-ir lang/models/tiny.moe --after=lower    the forward IR of the model
#   $BUILD/moec dump-ir lang/models/tiny.moe --all            the IR after every pass
#   $BUILD/tiny --help                                         what the training binary can do
#   $BUILD/moec build tests/golden/parallel.moe -o p4 -v      a 4-rank layout (then: mpirun -np 4 ./p4)
#   $BUILD/moec build tests/golden/plan.moe -o pl -v          degrees and gradient slots planned in the build
#   $BUILD/moec plan tests/golden/parallel.moe --cluster lang/clusters/testbed-b.cluster --svg plan.svg
#   lang/manual.md                                             the .moe language
MSG
