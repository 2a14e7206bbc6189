#!/usr/bin/env bash
# `make demo`: compile the shipped tiny model and train it for 20 steps on the CPU.
set -eu
cd "$(dirname "$0")/.."
BUILD=${BUILD:-build}
echo "# moec build lang/models/tiny.moe -o $BUILD/tiny -v"
"$BUILD/moec" build lang/models/tiny.moe -o "$BUILD/tiny" -v
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  echo "# a GPU is present: 'moec build --target cuda' (or auto) builds a binary that trains there; the demo trains on the CPU"
fi
echo "# $BUILD/tiny --steps 20"
"$BUILD/tiny" --steps 20
cat <<MSG

# next:
#   $BUILD/moec dump-ir lang/models/tiny.moe --after=lower    the forward IR of the model
#   $BUILD/moec dump-ir lang/models/tiny.moe --all            the IR after every pass
#   $BUILD/tiny --help                                         what the training binary can do
#   $BUILD/moec build tests/golden/parallel.moe -o p4 -v      a 4-rank layout (then: mpirun -np 4 ./p4)
#   $BUILD/moec plan tests/golden/parallel.moe --cluster lang/clusters/testbed-b.cluster --svg plan.svg
#   lang/manual.md                                             the .moe language
MSG
