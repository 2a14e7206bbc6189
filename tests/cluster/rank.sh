#!/usr/bin/env bash
# One rank of the emulated cluster (started by cluster.sh's mpirun): enters the namespace of its
# node, moec-node(rank / ranks per node), and runs the command there.
rank=${OMPI_COMM_WORLD_RANK:?rank.sh runs under mpirun}
per_node=${MOEC_RANKS_PER_NODE:-1}
exec ip netns exec "moec-node$((rank / per_node))" "$@"
