#!/usr/bin/env bash
# A language model's inputs in other people's formats: tests/models/grad_lm_gpt.moe.
#   - --weights from a Hugging Face style index over two BF16 shards (moec's names), as a folder
#     and as the index file, trains with the same losses as the F32 file of the same values (every
#     weight rounded to bf16 first, so both files hold the same floats), on one rank and on the
#     4-rank layout dp2·mp2·ep4 (each rank takes its slice of the converted tensors);
#   - --data from an llm.c token file (a 1024-byte header, then uint16 tokens) trains with the
#     same losses as the same tokens in a plain u16 file; so does the model's own
#     `data { train "F"; format llmc; }`; an llm.c file of another version is refused.
# The files are written here with numpy. Prints ok/FAIL/skip lines; exits 1 on any failure.
set -u
cd "$(dirname "$0")/../.."
BUILD=${BUILD:-build}
MOEC=${MOEC:-$BUILD/moec}
case "$MOEC" in /*) ;; *) MOEC=$(pwd)/$MOEC ;; esac
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-lm-inputs.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
M=tests/models/grad_lm_gpt.moe

if ! "$PY" -c 'import numpy' 2>/dev/null; then
  skip "lm inputs" "no Python with numpy to write the files (make deps installs python3-numpy)"
  exit 0
fi
steps() { grep '^step' "$1" | sed 's/  time .*//'; }   # the step lines without their timings
same() {  # LABEL RUN-A RUN-B: the same steps, bit for bit
  if [ -n "$(steps "$2")" ] && [ "$(steps "$2")" = "$(steps "$3")" ]; then
    ok "$1 ($(steps "$3" | awk '{printf "%s ", $4}'))"
  else
    bad "$1" "$(diff <(steps "$2") <(steps "$3"); tail -n 3 "$3")"
  fi
}

sed 's/optimizer sgd { lr 0.01; } }/optimizer sgd { lr 0.01; } data { train "tokens.bin"; format llmc; } }/' \
  "$M" >"$WORK/with_data.moe"
sed 's/batch 2;/batch 1;/; s/^layer block x 2/parallel { dp 2; mp 2; ep 4; }\nlayer block x 2/' "$M" >"$WORK/four.moe"
for model in "$M" "$WORK/with_data.moe" "$WORK/four.moe"; do
  out=$WORK/$(basename "$model" .moe)
  if ! "$MOEC" build "$model" -o "$out" 2>"$WORK/err"; then bad "lm inputs: build $model" "$(cat "$WORK/err")"; exit 1; fi
done
BIN=./grad_lm_gpt
run() { (cd "$WORK" && timeout 60 "$@" </dev/null); }

# ---- weights: an F32 file and a BF16 Hugging Face index of the same values ----
if run $BIN --steps 0 --save init.ckpt >"$WORK/init" 2>&1 &&
   "$PY" - "$WORK" <<'PYEOF'
import json, os, struct, sys
import numpy as np
work = sys.argv[1]

def read(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        assert t["dtype"] == "F32", t["dtype"]
        b, e = t["data_offsets"]
        out[name] = np.frombuffer(data[b:e], dtype="<f4").reshape(t["shape"])
    return out

def write(path, tensors):  # name -> (dtype name, little-endian array)
    header, chunks, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, (dtype, a) in tensors.items():
        raw = a.tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(raw)]}
        chunks.append(raw)
        at += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(chunks))

def bf16(a):  # round to nearest even: the bf16 bits, and the float32 they stand for
    u = a.astype("<f4").view("<u4").astype(np.uint64)
    h = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2")
    return h, (h.astype("<u4") << 16).view("<f4")

weights = read(os.path.join(work, "init.ckpt.rank0-of-1.safetensors"))
names = sorted(weights)
f32, shards, weight_map = {}, [{}, {}], {}
for i, name in enumerate(names):
    h, f = bf16(weights[name])
    f32[name] = ("F32", f)
    shard = "model-%05d-of-00002.safetensors" % (i % 2 + 1)
    shards[i % 2][name] = ("BF16", h)
    weight_map[name] = shard
write(os.path.join(work, "w32.safetensors"), f32)
os.mkdir(os.path.join(work, "hf"))
for k in range(2):
    write(os.path.join(work, "hf", "model-%05d-of-00002.safetensors" % (k + 1)), shards[k])
with open(os.path.join(work, "hf", "model.safetensors.index.json"), "w") as f:
    json.dump({"metadata": {"total_size": 2 * sum(a.size for _, a in f32.values())},
               "weight_map": weight_map}, f, indent=2)
print("# %d tensors, %d and %d per shard" % (len(names), len(shards[0]), len(shards[1])))
PYEOF
then
  run $BIN --steps 4 --weights w32.safetensors >"$WORK/w32" 2>&1
  run $BIN --steps 4 --weights hf >"$WORK/hf_dir" 2>&1
  run $BIN --steps 4 --weights hf/model.safetensors.index.json >"$WORK/hf_index" 2>&1
  run $BIN --steps 4 >"$WORK/seeded" 2>&1
  run $MPIRUN -np 4 ./four --steps 4 --weights w32.safetensors >"$WORK/w32_four" 2>&1
  run $MPIRUN -np 4 ./four --steps 4 --weights hf >"$WORK/hf_four" 2>&1
  same "lm inputs: --weights of a two-shard BF16 Hugging Face folder equals the F32 file" "$WORK/w32" "$WORK/hf_dir"
  same "lm inputs: --weights of its index file equals the F32 file" "$WORK/w32" "$WORK/hf_index"
  same "lm inputs: on dp2·mp2·ep4 (4 ranks, each its slice) too" "$WORK/w32_four" "$WORK/hf_four"
  if [ "$(steps "$WORK/w32")" = "$(steps "$WORK/seeded")" ]; then
    bad "lm inputs: the bf16-rounded weights should train differently from the seeded ones" "$(steps "$WORK/w32")"
  fi
else
  bad "lm inputs: write the weights files" "$(tail -n 5 "$WORK/init")"
fi

# ---- tokens: a plain u16 file and an llm.c file of the same tokens ----
"$PY" - "$WORK" <<'PYEOF'
import os, sys
import numpy as np
work = sys.argv[1]
tokens = np.random.default_rng(7).integers(0, 32, size=3000).astype("<u2")
def llmc(path, version, count):
    header = np.zeros(256, dtype="<i4")
    header[:3] = [20240520, version, count]
    with open(path, "wb") as f:
        f.write(header.tobytes() + tokens.tobytes())
with open(os.path.join(work, "tokens.u16"), "wb") as f:
    f.write(tokens.tobytes())
llmc(os.path.join(work, "tokens.bin"), 1, tokens.size)
llmc(os.path.join(work, "v2.bin"), 2, tokens.size)
PYEOF
run $BIN --steps 4 --data tokens.u16 >"$WORK/u16" 2>&1
run $BIN --steps 4 --data tokens.bin >"$WORK/llmc" 2>&1
run ./with_data --steps 4 >"$WORK/block" 2>&1
same "lm inputs: --data of an llm.c token file equals the same tokens as u16" "$WORK/u16" "$WORK/llmc"
same "lm inputs: data { format llmc; } equals the same tokens as u16" "$WORK/u16" "$WORK/block"
if run $BIN --steps 1 --data v2.bin >"$WORK/v2" 2>&1; then
  bad "lm inputs: an llm.c file of version 2 trained" "$(tail -n 3 "$WORK/v2")"
elif grep -q "llm.c token file 'v2.bin': version 2, this reader knows version 1" "$WORK/v2"; then
  ok "lm inputs: an llm.c file of version 2 is refused with a sentence"
else
  bad "lm inputs: the refusal of an llm.c file of version 2" "$(cat "$WORK/v2")"
fi
# A byte-level model (lang/models/gpt_moe_bytes.moe, vocab 256) learns from an llm.c token file of
# text bytes: 30 steps lower the loss.
"$PY" - "$WORK/text.bin" <<'PYEOF'
import sys
import numpy as np
text = ("the quick brown fox jumps over the lazy dog. " * 400).encode()
tokens = np.frombuffer(text, np.uint8).astype(np.uint16)
header = np.zeros(256, np.int32)
header[:3] = [20240520, 1, tokens.size]
open(sys.argv[1], "wb").write(header.tobytes() + tokens.tobytes())
PYEOF
if "$MOEC" build lang/models/gpt_moe_bytes.moe -o "$WORK/bytes" 2>"$WORK/err" &&
   (cd "$WORK" && ./bytes --steps 30 --data text.bin >bytes.out 2>&1) &&
   awk '/^step 1 / {a = $4} /^step 30 / {b = $4} END {exit !(b < 0.8 * a)}' "$WORK/bytes.out"; then
  ok "lm inputs: the byte-level gpt_moe_bytes learns from an llm.c token file (loss $(awk '/^step 1 / {print $4}' "$WORK/bytes.out") -> $(awk '/^step 30 / {print $4}' "$WORK/bytes.out") in 30 steps)"
else
  bad "lm inputs: gpt_moe_bytes on an llm.c token file" "$(cat "$WORK/err"; tail -n 3 "$WORK/bytes.out")"
fi
exit $failed
