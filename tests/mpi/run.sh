#!/usr/bin/env bash
# The MPI tests of runtime/comm.c: runs $BUILD/mpi/test_comm (tests/mpi/test_comm.c, built by
# `make test`, or here with mpicc when missing) under mpirun for every layout below, then the
# failure cases. One line per check (ok / FAIL, with its wall time); exit status 1 if anything
# failed.
#
# Layouts (ranks on one machine, --oversubscribe; "nodes" are gpus_per_node consecutive ranks):
#   P=1 without mpirun, P=2 (ep 2) on one and on two nodes, P=4 (ep 2 esp 2; ep 4;
#   dp 2 mp 2 with ep 2 esp 2), P=8 with gpus_per_node 4 (ep 2 esp 4; ep 4 esp 2; ep 8), and
#   P=6 with gpus_per_node 4, whose EP group is uneven over nodes (1dh and 2dh run flat).
# Failures, each under `timeout 60`: bad layouts exit non-zero on every rank with exactly one
# "moert: error:" line (from rank 0); a rank calling rt_comm_abort mid-run and a rank killed
# (SIGKILL) while the others wait in a collective make mpirun exit non-zero in bounded time, and
# so does an MPI error (it comes back through rt_comm_abort, naming the call and file:line).
set -u
cd "$(dirname "$0")/../.."
. tests/mpi/common.sh
work mpi
mpi_program test_comm
MPIRUN=("${MPIRUN_PLAIN[@]}")
TIMEOUT=60
now() { date +%s.%N; }
secs() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.1f s", b - a }'; }

# check NAME NP ARGS...: the whole test program on one layout (NP 1: without mpirun).
check() {
  local name=$1 np=$2; shift 2
  local t0; t0=$(now)
  local cmd=("$BIN" "$@")
  [ "$np" -gt 1 ] && cmd=("${MPIRUN[@]}" -np "$np" "${cmd[@]}")
  timeout "$TIMEOUT" "${cmd[@]}" >"$WORK/out" 2>"$WORK/err"
  local status=$?
  if [ $status -eq 0 ] && grep -q ' checks, 0 failed$' "$WORK/out"; then
    ok "$name ($(grep -o '[0-9]* checks' "$WORK/out"), $(secs "$t0"))"
  else
    bad "$name (exit status $status)" "$(cat "$WORK/out" "$WORK/err")"
  fi
}

# bad_layout NAME NP EXPECTED ARGS...: every rank exits non-zero, and stderr holds exactly one
# "moert: error:" line, equal to EXPECTED. Run twice: as users run it (mpirun must fail), and
# with every rank's exit status printed (mpirun told not to stop the others at the first).
bad_layout() {
  local name=$1 np=$2 expected=$3; shift 3
  local t0; t0=$(now)
  local cmd=("$BIN" --mode bad-layout "$@")
  [ "$np" -gt 1 ] && cmd=("${MPIRUN[@]}" -np "$np" "${cmd[@]}")
  timeout "$TIMEOUT" "${cmd[@]}" >"$WORK/out" 2>"$WORK/err"
  local status=$?
  local errors; errors=$(grep '^moert: error:' "$WORK/err")
  if [ $status -eq 0 ] || [ $status -eq 124 ]; then
    bad "$name: exit status $status, expected a failure" "$(cat "$WORK/out" "$WORK/err")"; return
  fi
  if [ "$errors" != "moert: error: $expected" ]; then
    bad "$name: error lines differ" \
      "$(printf 'expected: moert: error: %s\ngot:\n%s' "$expected" "$errors")"
    return
  fi
  local each=(sh -c '"$0" "$@"; s=$?; echo "exit status $s"; exit $s' "$BIN" --mode bad-layout "$@")
  [ "$np" -gt 1 ] &&
    each=("${MPIRUN[@]}" --mca orte_abort_on_non_zero_status 0 -np "$np" "${each[@]}")
  timeout "$TIMEOUT" "${each[@]}" >"$WORK/out" 2>"$WORK/err"
  local nonzero; nonzero=$(grep -c '^exit status [1-9]' "$WORK/out")
  if [ "$nonzero" -ne "$np" ] || [ "$(grep -c '^moert: error:' "$WORK/err")" -ne 1 ]; then
    bad "$name: $nonzero of $np ranks exited non-zero" "$(cat "$WORK/out" "$WORK/err")"; return
  fi
  ok "$name ($np of $np ranks exit non-zero, one error line, $(secs "$t0"))"
}

# dies NAME NP MODE LINE_ERE HOW_MANY ARGS...: mpirun exits non-zero before the timeout and no
# rank gets past the failed collective; stderr holds HOW_MANY lines (a number, or "some" for at
# least one) that match the extended regular expression LINE_ERE.
dies() {
  local name=$1 np=$2 mode=$3 pattern=$4 how_many=$5; shift 5
  local t0; t0=$(now)
  local cmd=("$BIN" --mode "$mode" "$@")
  [ "$np" -gt 1 ] && cmd=("${MPIRUN[@]}" -np "$np" "${cmd[@]}")
  timeout "$TIMEOUT" "${cmd[@]}" >"$WORK/out" 2>"$WORK/err"
  local status=$?
  if [ $status -eq 124 ]; then
    bad "$name: still running after ${TIMEOUT} s" "$(cat "$WORK/out" "$WORK/err")"; return
  fi
  if [ $status -eq 0 ]; then bad "$name: exit status 0" "$(cat "$WORK/out" "$WORK/err")"; return; fi
  if grep -q 'returned after' "$WORK/out"; then
    bad "$name: a collective returned" "$(cat "$WORK/out")"; return
  fi
  local lines; lines=$(grep -cE "$pattern" "$WORK/err")
  if { [ "$how_many" = some ] && [ "$lines" -lt 1 ]; } ||
     { [ "$how_many" != some ] && [ "$lines" -ne "$how_many" ]; }; then
    bad "$name: $lines lines match '$pattern', expected $how_many" "$(cat "$WORK/err")"; return
  fi
  ok "$name (exit status $status, $(secs "$t0"))"
}

echo "# MPI tests of runtime/comm.c ($(mpirun --version | head -n 1), $(nproc) cores)"
t_all=$(now)

check "P=1 world of one, no mpirun"                      1 --gpus-per-node 1
check "P=2 ep 2, one node"                               2 --dp 2 --ep 2 --gpus-per-node 2
check "P=2 ep 2, two nodes of 1"                         2 --dp 2 --ep 2 --gpus-per-node 1
check "P=4 ep 2 esp 2, two nodes of 2"                   4 --dp 4 --ep 2 --esp 2 --gpus-per-node 2
check "P=4 ep 4, two nodes of 2"                         4 --dp 4 --ep 4 --gpus-per-node 2
check "P=4 dp 2 mp 2 / ep 2 esp 2, two nodes of 2"       4 --dp 2 --mp 2 --ep 2 --esp 2 \
  --gpus-per-node 2
check "P=8 dp 8 / ep 2 esp 4, two nodes of 4"            8 --dp 8 --ep 2 --esp 4 --gpus-per-node 4
check "P=8 dp 4 mp 2 / ep 4 esp 2, two nodes of 4"       8 --dp 4 --mp 2 --ep 4 --esp 2 \
  --gpus-per-node 4
check "P=8 dp 2 mp 4 / ep 8, two nodes of 4"             8 --dp 2 --mp 4 --ep 8 \
  --gpus-per-node 4 --nodes 2
check "P=6 ep 6 uneven over nodes of 4 (1dh, 2dh flat)"  6 --dp 6 --ep 6 --gpus-per-node 4

bad_layout "bad layout: P=4 with dp 3" 4 \
  "the layout needs dp 3 x mp 1 = 3 ranks but 4 are running" --dp 3 --ep 4 --gpus-per-node 4
bad_layout "bad layout: P=4 on 1 node of 2" 4 \
  "the layout needs 4 ranks but the cluster has 2 (1 node x 2 gpus_per_node)" \
  --dp 4 --ep 4 --gpus-per-node 2 --nodes 1
bad_layout "bad layout: P=4 with mp 4 over nodes of 2" 4 \
  "mp 4 does not divide gpus_per_node 2: the MP groups would span nodes" \
  --mp 4 --ep 4 --gpus-per-node 2
bad_layout "bad layout: P=1 with ep 2" 1 \
  "the layout needs ep 2 x esp 1 = 2 ranks but 1 is running" --ep 2

host=$(hostname)
dies "rt_comm_abort on rank 1 of 4 mid-run" 4 abort \
  "^moert: error: rank 1 on $host: test: rank 1 gives up in the middle of a run\$" 1 \
  --dp 4 --ep 4 --gpus-per-node 2
dies "rt_comm_abort on a world of one" 1 abort \
  "^moert: error: rank 0 on $host: test: rank 0 gives up in the middle of a run\$" 1
dies "rank 1 of 4 killed (SIGKILL) during a collective" 4 kill "^moert: error:" 0 \
  --dp 4 --ep 4 --gpus-per-node 2
dies "an MPI error (truncated MPI_Bcast) ends the job through rt_comm_abort" 4 mpi-error \
  "^moert: error: rank [1-3] on $host: MPI_Ibcast failed at runtime/comm\.c:[0-9]+: MPI_ERR_TRUNCATE" \
  some --dp 4 --ep 4 --gpus-per-node 2

echo "# $passed passed, $nfailed failed ($(secs "$t_all"))"
exit $failed
