# grad_planted LABEL DIR CMD...: CMD (run in DIR: a model's binary and its options) passes
# --check-grad, and a gradient planted 10 % off (MOERT_CHECK_GRAD_PLANT=NAME, tests only) in an
# attention projection, an expert, a norm, the head, the embedding and the router, each
# that the model has (the second such parameter, else the first), fails a check of that
# parameter alone (--check-grad=NAME). Prints ok/FAIL lines through the caller's ok and bad.
# Sourced by tests/suites/gradcheck.sh and tests/lm/hf.sh.
grad_planted() {
  local label=$1 dir=$2 kind pattern param kinds=""
  shift 2
  if (cd "$dir" && "$@" --check-grad >gc 2>&1); then
    ok "gradcheck $label: $(grep '^# [0-9]* parameters:' "$dir/gc" | sed 's/^# //')"
  else
    bad "gradcheck $label" "$(grep -v '^#' "$dir/gc" | grep -v ' OK$')"
    return
  fi
  for kind in "attention projection|attn[.]wo$" "expert|experts[.]w1$" "norm|norm[.]weight$" \
              "head|^head[.]w$" "embedding (the head too where tied)|^embed[.]wte$" "router|gate[.]wg$"; do
    pattern=${kind#*|}
    param=$(awk -v p="$pattern" '!/^#/ && $1 ~ p {n++; name = $1; if (n == 2) exit} END {print name}' "$dir/gc")
    [ -n "$param" ] || continue
    if ! (cd "$dir" && MOERT_CHECK_GRAD_PLANT="$param" "$@" --check-grad="$param" >plant 2>&1) &&
       grep -q "^$param .*FAILED\$" "$dir/plant"; then
      kinds="$kinds, ${kind%%|*} $param"
    else
      bad "gradcheck $label: a 10 % error in $param (${kind%%|*}) passes" "$(grep -v '^#' "$dir/plant")"
      return
    fi
  done
  ok "gradcheck $label fails on a gradient 10 % off in each of:${kinds#,}"
}
