#!/usr/bin/env bash
# Is the emulated link faithful? (docs/cluster.md) Two nodes at 300 Mbit/s exchange 4 MB in each
# direction as one AlltoAll, as 4 back-to-back chunks and as 4 chunks each after 10 ms of idle
# link (tests/cluster/link.c). A real link moves them all at its rate:
#   - the whole message within 0.9-1.35x the bytes' time at the line rate (headers, TCP);
#   - back-to-back chunks at most 1.25x the whole message (no handshake per message stuck
#     behind queued bytes: with Open MPI's default 64 KiB eager limit they took 1.5-1.8x);
#   - gapped chunks at least 0.8x the whole message (the shaper's bucket does not send them above
#     the rate: with a 10 ms bucket they took 0.1x).
# Skips with one line where namespaces cannot be made. Prints ok/FAIL/skip lines; exits 1 on a failure.
set -u
cd "$(dirname "$0")/../.."
WORK=$(mktemp -d "${TMPDIR:-/tmp}/moec-link.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
. tests/mpi/common.sh
CLUSTER=tests/cluster/cluster.sh

if ! why=$($CLUSTER check); then
  skip "emulated link" "network namespaces cannot be made here ($why)"
  exit 0
fi
if ! mpicc -O2 -std=c11 -D_POSIX_C_SOURCE=200809L -Wall -o "$WORK/link" tests/cluster/link.c 2>"$WORK/err"; then
  bad "build tests/cluster/link.c" "$(cat "$WORK/err")"; exit 1
fi
BYTES=4000000 RATE=300mbit
if ! timeout 120 $CLUSTER run 2 1 $RATE -- "$WORK/link" $BYTES 4 10 5 >"$WORK/out" 2>&1 </dev/null; then
  bad "emulated link at $RATE: the exchange failed" "$(tail -n 20 "$WORK/out")"; exit 1
fi
read -r whole chunks gaps < <(awk '$1 == "link" { print $3, $5, $7 }' "$WORK/out")
line=$(awk -v b=$BYTES -v r="$($CLUSTER bits $RATE)" 'BEGIN { printf "%.2f", b * 8 / r * 1e3 }')
what="4 MB each way at $RATE (line ${line} ms): whole ${whole} ms, 4 back-to-back chunks ${chunks} ms, 4 chunks after 10 ms idle ${gaps} ms"
if [ -z "${gaps:-}" ]; then
  bad "emulated link: no result" "$(tail -n 20 "$WORK/out")"
elif ! awk -v w="$whole" -v l="$line" 'BEGIN { exit !(w >= 0.9 * l && w <= 1.35 * l) }'; then
  bad "emulated link: the whole message is not at the line rate: $what"
elif ! awk -v c="$chunks" -v w="$whole" 'BEGIN { exit !(c <= 1.25 * w) }'; then
  bad "emulated link: back-to-back chunks pay per message: $what"
elif ! awk -v g="$gaps" -v w="$whole" 'BEGIN { exit !(g >= 0.8 * w) }'; then
  bad "emulated link: chunks after idle gaps go above the rate (the shaper's bucket): $what"
else
  ok "emulated link is faithful: $what"
fi
exit "${failed:-0}"
