#!/usr/bin/env bash
# The IR goldens: tests/golden/NAME.PASS.ir is `moec dump-ir tests/golden/NAME.moe --after=PASS`.
. "$(dirname "$0")/../lib.sh"
work ir-golden
for golden in tests/golden/*.ir; do
  [ -f "$golden" ] || continue
  g=$(basename "$golden" .ir)        # NAME.PASS
  pass=${g##*.}; model=tests/golden/${g%.*}.moe
  if "$MOEC" dump-ir "$model" --after="$pass" >"$WORK/g.ir" 2>"$WORK/err" && diff -u "$golden" "$WORK/g.ir" >"$WORK/diff"; then
    ok "golden $g"
  else
    bad "golden $g" "$(cat "$WORK/err" "$WORK/diff" | head -n 40)"
  fi
done
exit $failed
