#!/usr/bin/env bash
# The numpy reference (tests/ref): its own backward against its finite differences, then the
# binaries' --dump against it (MoE models; language models, lang/manual.md §7.2), within 1e-5. A check
# that exits 77 (what it needs is missing) is a skip.
. "$(dirname "$0")/../lib.sh"
work ref
if [ ! -x "$PY" ] || ! "$PY" -c 'import numpy' 2>/dev/null; then
  bad "numpy reference" "/usr/bin/python3 with numpy is missing (make deps installs python3-numpy)"; exit 1
fi
# The four checks side by side (spawn, tests/lib.sh), their lines in this order.
moe_self() {
  if "$PY" tests/ref/moe_ref.py --selftest >"$WORK/self.out" 2>&1; then ok "numpy reference self-test (its backward vs its own finite differences)"
  else bad "numpy reference self-test" "$(tail -n 40 "$WORK/self.out")"; fi
}
moe_binary() {
  local status
  MOEC=$MOEC "$PY" tests/ref/test_ref.py >"$WORK/ref.out" 2>&1
  status=$?
  if [ $status -eq 0 ]; then ok "numpy reference vs the binary's --dump: $(grep -c ' ok *$\| OK *$' "$WORK/ref.out") tensors within 1e-5"
  elif [ $status -eq 77 ]; then skip "numpy reference vs the binary" "$(tail -n 1 "$WORK/ref.out")"
  else bad "numpy reference vs the binary" "$(tail -n 40 "$WORK/ref.out")"; fi
}
lm_self() {
  if "$PY" tests/ref/lm_ref.py --selftest >"$WORK/lmself.out" 2>&1; then ok "language-model reference self-test (its backward vs its own finite differences)"
  else bad "language-model reference self-test" "$(tail -n 40 "$WORK/lmself.out")"; fi
}
lm_binary() {
  local status
  MOEC=$MOEC "$PY" tests/ref/test_lm_ref.py >"$WORK/lmref.out" 2>&1
  status=$?
  if [ $status -eq 0 ]; then ok "language-model reference vs the binary's --dump: $(grep -c ' ok ' "$WORK/lmref.out") tensors (logits, loss, ce, every gradient) within 1e-5"
  elif [ $status -eq 77 ]; then skip "language-model reference vs the binary" "$(tail -n 1 "$WORK/lmref.out")"
  else bad "language-model reference vs the binary" "$(tail -n 40 "$WORK/lmref.out")"; fi
}
spawn moe_binary moe_binary
spawn lm_binary lm_binary
spawn moe_self moe_self
spawn lm_self lm_self
collect moe_self moe_binary lm_self lm_binary
exit $failed
