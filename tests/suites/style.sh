#!/usr/bin/env bash
# Style: no C function of the source folders over 120 lines (tests/funclen.py, issue 26).
. "$(dirname "$0")/../lib.sh"
limit=120
out=$("$PY" tests/funclen.py --max $limit 2>&1); status=$?
if [ $status -eq 0 ]; then
  ok "style: no function over $limit lines"
elif [ $status -eq 1 ] && [ -n "$out" ]; then
  n=$(grep -c . <<<"$out")
  bad "style: $n functions over $limit lines: $(awk '{print $2 " (" $1 ")"}' <<<"$out" | paste -sd' ')" "$out"
else
  bad "style: tests/funclen.py failed (exit $status)" "$out"
fi
exit $failed
