#!/usr/bin/env bash
# make interop: the README's Hugging Face walk-through ("Fine-tuning, start to end"), run as
# written in a scratch folder with transformers: path/to/mixtral is a tiny random Mixtral that
# transformers saves there (max_position_embeddings 512, bos 1, eos 2) with a byte-level BPE
# tokenizer trained on corpus.txt (a license text); `python3` is the interop environment's. The
# block's own commands then import it, tokenize, train 200 steps with a log, export, and generate
# with transformers from the export. Checks: every command succeeds, the log has 200 steps, the
# exported config.json is the checkpoint's key by key, and transformers generates from it.
#   tests/interop/readme.sh PYTHON MOEC_BUILD_DIR      (prints ok/FAIL lines)
set -u
cd "$(dirname "$0")/../.."
PYTHON=$(cd "$(dirname "$1")" && pwd)/$(basename "$1") BUILD_DIR=$(cd "$2" && pwd)
ROOT=$(pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-readme-hf.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
ln -s "$BUILD_DIR" "$WORK/build"
mkdir -p "$WORK/bin" "$WORK/path/to"
printf '#!/bin/sh\nexec "%s" "$@"\n' "$PYTHON" >"$WORK/bin/python3"   # (a link would leave the venv)
chmod +x "$WORK/bin/python3"
cat /usr/share/common-licenses/GPL-3 >"$WORK/corpus.txt" 2>/dev/null || cat "$ROOT/README.md" >"$WORK/corpus.txt"

# The checkpoint and its tokenizer, as a user would have them.
if ! (cd "$WORK" && "$PYTHON" - >make.out 2>&1 <<'EOF'
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
from transformers import MixtralConfig, MixtralForCausalLM, PreTrainedTokenizerFast
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train(["corpus.txt"], trainers.BpeTrainer(vocab_size=512, special_tokens=["<unk>", "<s>", "</s>"]))
fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
fast.save_pretrained("path/to/mixtral")
torch.manual_seed(0)
cfg = MixtralConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=512, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
MixtralForCausalLM(cfg).save_pretrained("path/to/mixtral")
EOF
); then
  echo "FAIL  README Hugging Face walk-through: the tiny checkpoint and tokenizer"; sed 's/^/      /' "$WORK/make.out" | tail -n 10
  exit 1
fi

# The README's block, whole (it has a heredoc and a command over three lines).
awk '/^## Hugging Face checkpoints$/ {inside = 1; next} /^## / {inside = 0}
     inside && /^```sh$/ && !done {grab = 1; next} grab && /^```$/ {grab = 0; done = 1} grab' README.md >"$WORK/walk.sh"
if [ "$(grep -c 'import-hf\|--export-hf\|generate' "$WORK/walk.sh")" -lt 3 ]; then
  echo "FAIL  README Hugging Face walk-through: the block was not found in README.md"; exit 1
fi
if (cd "$WORK" && PATH="$WORK/bin:$PATH" OMP_NUM_THREADS=2 timeout 900 bash -e walk.sh >walk.out 2>&1 </dev/null); then
  echo "ok    README Hugging Face walk-through: the block runs as written ($(grep -c . "$WORK/walk.sh") lines: import-hf, build, tokenize, train 200 steps, export, generate)"
else
  echo "FAIL  README Hugging Face walk-through fails as written"; grep -v 'Warning\|warn' "$WORK/walk.out" | tail -n 12 | sed 's/^/      /'
  exit 1
fi
steps=$(grep -c '"step"' "$WORK/train.jsonl" 2>/dev/null)
if [ "$steps" = 200 ]; then
  echo "ok    README Hugging Face walk-through: train.jsonl logs 200 steps (loss $(grep '"step": 1,' "$WORK/train.jsonl" | grep -o '"loss": [0-9.]*' | cut -d' ' -f2) -> $(grep '"step": 200,' "$WORK/train.jsonl" | grep -o '"loss": [0-9.]*' | cut -d' ' -f2))"
else
  echo "FAIL  README Hugging Face walk-through: train.jsonl has ${steps:-no} step lines, not 200"
fi
if "$PYTHON" - "$WORK/path/to/mixtral/config.json" "$WORK/mx-tuned/config.json" <<'EOF'
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:3])
diff = [k for k in set(a) | set(b) if a.get(k) != b.get(k)]
print("differ:", diff) if diff else None
sys.exit(1 if diff else 0)
EOF
then
  echo "ok    README Hugging Face walk-through: mx-tuned/config.json is the checkpoint's key by key (max_position_embeddings 512, bos 1, eos 2), with generation_config.json"
else
  echo "FAIL  README Hugging Face walk-through: the exported config.json differs from the checkpoint's"
fi
text=$(tail -n 1 "$WORK/walk.out")
if [ -n "$text" ] && [ -f "$WORK/mx-tuned/generation_config.json" ]; then
  echo "ok    README Hugging Face walk-through: transformers generated from the export: $(echo "$text" | cut -c1-80)"
else
  echo "FAIL  README Hugging Face walk-through: no generated text"
fi
