#!/usr/bin/env bash
# Layers (issue 64): the files of each folder below call only downward; no file calls, directly
# or through others of its folder, back into itself (tests/circles.py over the objects' symbols).
. "$(dirname "$0")/../lib.sh"
BUILD=${BUILD:-build}
for folder in cli frontend passes codegen runtime runtime/kernels ir sched; do
  out=$("$PY" tests/circles.py --obj "$BUILD/obj" "$folder" 2>&1); status=$?
  if [ $status -eq 0 ]; then ok "layers: $folder/ has no circle"
  else bad "layers: $folder/ has circles" "$out"; fi
done
# The check itself: a planted circle (two objects calling each other) is found.
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/obj/x"
printf 'void b(void);\nvoid a(void) { b(); }\n' >"$tmp/a.c"
printf 'void a(void);\nvoid b(void) { a(); }\n' >"$tmp/b.c"
cc -c "$tmp/a.c" -o "$tmp/obj/x/a.o" && cc -c "$tmp/b.c" -o "$tmp/obj/x/b.o"
out=$("$PY" tests/circles.py --obj "$tmp/obj" x 2>&1); status=$?
if [ $status -eq 1 ] && grep -q 'circle of 2 files: x/a.c x/b.c' <<<"$out"; then ok "layers: a planted circle is found"
else bad "layers: a planted circle was not found (exit $status)" "$out"; fi
exit $failed
