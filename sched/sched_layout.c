// Collectives on the groups of a layout: the profile's fits carried over to groups of other
// shapes (sched.h, lang/manual.md §6, manual §10).
//
// The profile measured (cli/tune.c):
//   alltoall, allreduce   over the inter-node group: one rank on each of the N nodes, and all
//                         G such groups at once, so every rank of a node sends through its
//                         link together; a rank's AlltoAll of n elements sends (N-1)/N of
//                         them to other nodes, to N-1 remote peers.
//   allgather, reducescatter, alltoall_intra, allreduce_intra
//                         over the G ranks of one node.
// A layout's group g has size p members, per_node of them on each of its nodes. The model:
//   inside a node (g.nodes == 1): the intra fit, beta scaled by the share of the elements
//     that leave a rank, (p-1)/p against the measured (G-1)/G.
//   AlltoAll across nodes, flat (nccl): each rank sends (p - per_node)/p of its elements off
//     the node, to p - per_node peers, while every rank of the node does the same: beta_inter
//     scaled by that share against (N-1)/N, alpha by the remote peers against N-1; the elements
//     that stay in the node, (per_node-1)/p, travel at the same time (the slower of the two).
//   2dh: an intra-node AlltoAll of the n elements among the group's per_node ranks of a node,
//     then an AlltoAll among the g.nodes ranks of the same local index (g.nodes - 1 remote
//     peers), one after the other.
//   1dh: the node's per_node blocks gathered on a leader (an AllGather of per_node * n),
//     the leaders' exchange (g.nodes - 1 remote peers), and the scatter back (as the gather).
//   AllReduce across nodes (hierarchical): a reduction inside the node, the G/per_node groups
//     of a node each sending 2n(nodes-1)/nodes over its link, a broadcast inside the node:
//     beta_inter scaled by (nodes-1)/nodes / (per_node (N-1)/N), plus an intra AllReduce when
//     per_node > 1.
// Without alltoall_intra, the intra AlltoAll is priced by allgather; without allreduce_intra,
// the intra AllReduce by reducescatter + allgather.
#include "sched.h"

const char *const sched_a2a_name[3] = {"nccl", "1dh", "2dh"};

SchedGroup sched_group_of(int count, int stride, int gpus_per_node) {
  SchedGroup g = {count > 0 ? count : 1, 1, count > 0 ? count : 1};
  if (gpus_per_node < 1) return g;
  int nodes = 0, last = -1;
  for (int i = 0; i < g.size; i++) {   // members ascend, so do their nodes
    int node = i * stride / gpus_per_node;
    if (node != last) nodes++, last = node;
  }
  g.nodes = nodes;
  g.per_node = g.size / nodes;
  return g;
}

static double share(int p) { return p > 1 ? (double)(p - 1) / p : 0; }

// The intra fit of a node's G ranks used for a group of p ranks inside a node.
static SchedCoef intra(SchedCoef fit, int p, int G) {
  double s = share(G) > 0 ? share(p) / share(G) : 1;
  return (SchedCoef){fit.alpha, fit.beta * s};
}

static SchedCoef sum(SchedCoef a, SchedCoef b) { return (SchedCoef){a.alpha + b.alpha, a.beta + b.beta}; }

static bool given(SchedCoef f) { return f.alpha > 0 || f.beta > 0; }

SchedCoef sched_group_fit(const SchedCluster *c, SchedColl k, SchedGroup g, SchedA2a algo) {
  if (g.size <= 1) return (SchedCoef){0, 0};
  int N = c->nodes > 1 ? c->nodes : 1, G = c->gpus_per_node > 1 ? c->gpus_per_node : 1;
  SchedCoef a2a_in = given(c->alltoall_intra) ? c->alltoall_intra : c->allgather;
  SchedCoef ar_in = given(c->allreduce_intra) ? c->allreduce_intra : sum(c->reducescatter, c->allgather);
  if (g.nodes <= 1 || N <= 1) {
    switch (k) {
    case SCHED_ALLTOALL: return intra(a2a_in, g.size, G);
    case SCHED_ALLGATHER: return intra(c->allgather, g.size, G);
    case SCHED_REDUCESCATTER: return intra(c->reducescatter, g.size, G);
    case SCHED_ALLREDUCE: return intra(ar_in, g.size, G);
    }
  }
  double cross_t = share(N);   // the share of a rank's elements that crossed a link when measured
  double remote_t = N - 1;     // remote peers per rank when measured
  int per = g.per_node, nn = g.nodes;
  switch (k) {
  case SCHED_ALLTOALL: {
    double cross = (double)(g.size - per) / g.size;
    SchedCoef inter = {c->alltoall.alpha * (g.size - per) / remote_t, c->alltoall.beta * cross / cross_t};
    if (per == 1 || algo == SCHED_A2A_FLAT) {
      double stay_beta = per > 1 && share(G) > 0 ? a2a_in.beta * ((double)(per - 1) / g.size) / share(G) : 0;
      return (SchedCoef){inter.alpha, inter.beta > stay_beta ? inter.beta : stay_beta};
    }
    SchedCoef leaders = {c->alltoall.alpha * (nn - 1) / remote_t, inter.beta};
    if (algo == SCHED_A2A_2DH) return sum(intra(a2a_in, per, G), leaders);
    SchedCoef gather = intra(c->allgather, per, G);   // n = per * n elements gathered
    gather.beta *= per;
    return sum(sum(gather, gather), leaders);
  }
  case SCHED_ALLREDUCE: {
    SchedCoef inter = {c->allreduce.alpha, c->allreduce.beta * share(nn) / (per * cross_t)};
    return per > 1 ? sum(inter, intra(ar_in, per, G)) : inter;
  }
  case SCHED_ALLGATHER:
  case SCHED_REDUCESCATTER: {
    // Across nodes: a sharded optimizer's over a DP group (an ESP group stays in a node). A ring
    // AllReduce is a ReduceScatter and then an AllGather over the same links, so each is half of
    // the group's AllReduce, priced from the profile's allreduce fit over those links.
    SchedCoef ar = sched_group_fit(c, SCHED_ALLREDUCE, g, algo);
    return (SchedCoef){ar.alpha / 2, ar.beta / 2};
  }
  }
  return (SchedCoef){0, 0};
}
