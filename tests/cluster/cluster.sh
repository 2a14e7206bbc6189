#!/usr/bin/env bash
# The emulated cluster (docs/cluster.md): N "nodes" as Linux network namespaces on
# one machine, each joined to a bridge in the host namespace by a veth pair whose two ends are
# shaped with tbf at the link rate (traffic into and out of a node). Ranks of one node share its
# namespace and talk over its loopback-speed local route; ranks of different nodes cross two
# shaped links and the bridge.
#
#   cluster.sh up NODES RATE          make it (RATE as tc writes it: 1gbit, 200mbit, ...)
#   cluster.sh down [--force]         remove everything this script made (idempotent; leaves a
#                                     cluster another run holds, unless --force)
#   cluster.sh status                 what exists now
#   cluster.sh rate RATE [NODE]       change the rate of every node's link (or one node's)
#   cluster.sh cut NODE | heal NODE   take node NODE's link down / up
#   cluster.sh run NODES RANKS_PER_NODE RATE -- CMD ARGS...
#                                     up, run CMD under mpirun placed on the cluster (rank r on
#                                     node r / RANKS_PER_NODE), down on every exit path: normal
#                                     end, failure, Ctrl-C, TERM; exits with CMD's status
#   cluster.sh bits RATE              RATE in bit/s (an error when tc would not read it)
#   cluster.sh mpirun RANKS_PER_NODE CMD ARGS...
#                                     mpirun on a cluster that is up (the wrapper alone)
#
# MOEC_CLUSTER_BURST_MS and MOEC_CLUSTER_QUEUE_MS set tbf's bucket and queue (below).
# Only one cluster at a time: `up` and `run` take an exclusive lock, waiting up to
# MOEC_CLUSTER_WAIT seconds (900) for another run to end, and refuse, naming the holder, after
# that; `down` leaves a cluster another run holds (unless --force). Names are moec-prefixed (namespaces moec-node0.., bridge
# moecbr0, host-side veths moecv0..) on the subnet 10.77.0.0/24 (MOEC_CLUSTER_NET=10.77.0 to
# change the first three octets). Needs root and iproute2 (ip, tc); `cluster.sh check` exits 0
# when namespaces can be made here, else 1 with the reason on stdout.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
NET=${MOEC_CLUSTER_NET:-10.77.0}
BR=moecbr0
LOCK=${MOEC_CLUSTER_LOCK:-/run/lock/moec-cluster.lock}
STATE=${MOEC_CLUSTER_STATE:-/run/lock/moec-cluster.state}

die() { echo "cluster.sh: $*" >&2; exit 1; }

# The link rate in bit/s, or an error.
bits_of() {
  local rate=$1 bits
  bits=$(awk -v r="$rate" 'BEGIN { n = r + 0; u = tolower(r); sub(/^[0-9.]+/, "", u);
    m = (u == "kbit") ? 1e3 : (u == "mbit") ? 1e6 : (u == "gbit") ? 1e9 : (u == "bit" || u == "") ? 1 : -1;
    if (m < 0 || n <= 0) { print -1; exit } printf "%.0f", n * m }')
  [ "$bits" -gt 0 ] 2>/dev/null || die "not a link rate: '$rate' (write it like 1gbit, 200mbit or 500kbit)"
  echo "$bits"
}

# tbf at RATE. Its bucket holds MOEC_CLUSTER_BURST_MS (default 1) ms of traffic and at least 16 kB;
# its queue holds MOEC_CLUSTER_QUEUE_MS (default 100) ms. The bucket is what a message that
# follows an idle gap may send above the rate (a real link sends nothing above it): 1 ms is the
# least that still carries the full rate here (smaller buckets lose tokens while the shaper's
# timer waits for a busy core); docs/cluster.md has the measurements.
shape() {  # shape DEV RATE [NETNS]
  local dev=$1 rate=$2 ns=${3:-} bits burst
  bits=$(bits_of "$rate")
  burst=$(awk -v b="$bits" -v MS="${MOEC_CLUSTER_BURST_MS:-1}" 'BEGIN { x = b / 8 * MS / 1000; if (x < 16000) x = 16000; printf "%.0f", x }')
  local args=(qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" latency "${MOEC_CLUSTER_QUEUE_MS:-100}ms")
  if [ -n "$ns" ]; then ip netns exec "$ns" tc "${args[@]}"; else tc "${args[@]}"; fi
}

nodes_up() { ip -o link show 2>/dev/null | grep -o 'moecv[0-9]*' | sort -u | wc -l; }

do_down() {
  local ns
  for ns in $(ip netns list 2>/dev/null | awk '/^moec-node[0-9]+/ {print $1}'); do
    ip netns pids "$ns" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  for dev in $(ip -o link show 2>/dev/null | grep -o 'moecv[0-9]*' | sort -u); do
    ip link del "$dev" 2>/dev/null || true
  done
  ip link del "$BR" 2>/dev/null || true
  rm -f "$STATE"
}

do_up() {
  local nodes=$1 rate=$2
  [[ "$nodes" =~ ^[0-9]+$ ]] && [ "$nodes" -ge 1 ] && [ "$nodes" -le 64 ] ||
    die "the number of nodes must be 1..64, not '$nodes'"
  bits_of "$rate" >/dev/null
  do_down   # leftovers of a run that was killed before its cleanup
  ip link add "$BR" type bridge
  ip addr add "$NET.254/24" dev "$BR"
  ip link set "$BR" up
  for ((n = 0; n < nodes; n++)); do
    ip netns add "moec-node$n"
    ip link add "moecv$n" type veth peer name "moecp$n"
    ip link set "moecp$n" netns "moec-node$n"
    ip netns exec "moec-node$n" ip link set "moecp$n" name eth0
    ip netns exec "moec-node$n" ip addr add "$NET.$((n + 1))/24" dev eth0
    ip netns exec "moec-node$n" ip link set lo up
    ip netns exec "moec-node$n" ip link set eth0 up
    ip link set "moecv$n" master "$BR"
    ip link set "moecv$n" up
    shape "moecv$n" "$rate"                 # into the node
    shape eth0 "$rate" "moec-node$n"        # out of the node
  done
  printf 'nodes=%s rate=%s pid=%s\n' "$nodes" "$rate" "$$" >"$STATE"
}

do_rate() {
  local rate=$1 only=${2:-} n count
  count=$(nodes_up)
  [ "$count" -gt 0 ] || die "no emulated cluster is up"
  for ((n = 0; n < count; n++)); do
    [ -n "$only" ] && [ "$only" != "$n" ] && continue
    shape "moecv$n" "$rate"
    shape eth0 "$rate" "moec-node$n"
  done
}

do_link() {  # do_link NODE up|down
  ip link show "moecv$1" >/dev/null 2>&1 || die "node $1 is not part of the emulated cluster"
  ip link set "moecv$1" "$2"
  ip netns exec "moec-node$1" ip link set eth0 "$2"
}

# Open MPI's TCP transport as a GPU cluster's collectives behave: every message up to EAGER bytes
# is sent at once (no rendezvous: NCCL has none), and fixed socket buffers. With the defaults
# (64 KiB eager limit, autotuned buffers) a message that follows another one on a shaped link
# paid a handshake stuck behind queued bytes: four back-to-back 1 MB AlltoAlls took 1.5-1.8x the
# time of one 4 MB one (docs/cluster.md).
EAGER=${MOEC_CLUSTER_EAGER:-16777216}

# mpirun placed on the cluster: every rank starts in its node's namespace (rank.sh), MPI's TCP
# transport on the cluster subnet only (no shared memory, which would bypass the links), and
# PMIx and the runtime's out-of-band channel reachable from the namespaces over the bridge.
do_mpirun() {
  local per_node=$1; shift
  local count np
  count=$(nodes_up)
  [ "$count" -gt 0 ] || die "no emulated cluster is up (cluster.sh up NODES RATE)"
  np=$((count * per_node))
  OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
  PMIX_MCA_ptl_tcp_remote_connections=1 PMIX_MCA_ptl_tcp_if_include="$NET.0/24" \
  PMIX_MCA_gds=hash \
  MOEC_RANKS_PER_NODE=$per_node \
    mpirun --allow-run-as-root --oversubscribe -np "$np" --bind-to none \
      --mca oob_tcp_if_include "$NET.0/24" --mca btl tcp,self --mca btl_tcp_if_include "$NET.0/24" \
      --mca pml ob1 \
      --mca btl_tcp_eager_limit "$EAGER" --mca btl_tcp_max_send_size "$EAGER" \
      --mca btl_tcp_sndbuf 16777216 --mca btl_tcp_rcvbuf 16777216 \
      "$HERE/rank.sh" "$@"
}

# Can namespaces, veths and tbf be made here? (root, iproute2, a kernel that allows them)
do_check() {
  [ "$(id -u)" = 0 ] || { echo "needs root (network namespaces)"; return 1; }
  command -v ip >/dev/null && command -v tc >/dev/null || { echo "needs iproute2 (ip, tc)"; return 1; }
  command -v mpirun >/dev/null || { echo "needs Open MPI's mpirun"; return 1; }
  local ns=moec-probe$$ err
  if ! err=$(ip netns add "$ns" 2>&1); then echo "cannot make a network namespace: $err"; return 1; fi
  if ! err=$(ip link add moecq$$ type veth peer name moecr$$ 2>&1); then
    ip netns del "$ns"; echo "cannot make a veth pair: $err"; return 1
  fi
  if ! err=$(tc qdisc add dev moecq$$ root tbf rate 1gbit burst 256kb latency 100ms 2>&1); then
    ip link del moecq$$; ip netns del "$ns"; echo "cannot shape a link with tbf: $err"; return 1
  fi
  ip link del moecq$$; ip netns del "$ns"
  return 0
}

locked() {  # take the lock on fd 9, waiting up to MOEC_CLUSTER_WAIT seconds (default 900), or say who holds it
  mkdir -p "$(dirname "$LOCK")"
  exec 9>>"$LOCK"
  if ! flock -w "${MOEC_CLUSTER_WAIT:-900}" 9; then
    die "another emulated cluster is running ($(cat "$STATE" 2>/dev/null || echo 'state unknown')); wait for it, or stop it and run 'cluster.sh down --force'"
  fi
}

# down: takes the lock first, so that a script's clean-up never removes a cluster another run is
# using (then it says so and leaves it); --force removes it anyway.
down_unless_used() {
  mkdir -p "$(dirname "$LOCK")"
  exec 9>>"$LOCK"
  if [ "${1:-}" != --force ] && ! flock -n 9; then
    echo "cluster.sh: another run holds the emulated cluster ($(cat "$STATE" 2>/dev/null || echo 'state unknown')); left up (cluster.sh down --force removes it)" >&2
    return 0
  fi
  do_down
}

cmd=${1:-}; shift || true
case "$cmd" in
  up)     [ $# -eq 2 ] || die "usage: cluster.sh up NODES RATE"
          locked; do_up "$1" "$2"
          echo "cluster.sh: $1 node(s) at $2 up (the lock is released now; 'run' holds it for a whole run)" ;;
  down)   down_unless_used "${1:-}" ;;
  status) ip netns list | grep '^moec-node' || echo "no emulated cluster"; [ -f "$STATE" ] && cat "$STATE"; true ;;
  rate)   [ $# -ge 1 ] || die "usage: cluster.sh rate RATE [NODE]"; do_rate "$@" ;;
  cut)    [ $# -eq 1 ] || die "usage: cluster.sh cut NODE"; do_link "$1" down ;;
  heal)   [ $# -eq 1 ] || die "usage: cluster.sh heal NODE"; do_link "$1" up ;;
  check)  do_check ;;
  bits)   [ $# -eq 1 ] || die "usage: cluster.sh bits RATE"; bits_of "$1" ;;
  mpirun) [ $# -ge 2 ] || die "usage: cluster.sh mpirun RANKS_PER_NODE CMD ARGS..."; do_mpirun "$@" ;;
  run)
    [ $# -ge 5 ] && [ "$4" = "--" ] || die "usage: cluster.sh run NODES RANKS_PER_NODE RATE -- CMD ARGS..."
    nodes=$1 per_node=$2 rate=$3; shift 4
    [[ "$per_node" =~ ^[0-9]+$ ]] && [ "$per_node" -ge 1 ] || die "ranks per node must be at least 1, not '$per_node'"
    locked
    trap 'do_down' EXIT
    trap 'do_down; exit 130' INT
    trap 'do_down; exit 143' TERM
    do_up "$nodes" "$rate"
    status=0
    do_mpirun "$per_node" "$@" || status=$?
    exit "$status" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; [ -z "$cmd" ] || [ "$cmd" = -h ] || [ "$cmd" = --help ] || exit 2 ;;
esac
