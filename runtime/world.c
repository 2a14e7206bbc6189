// World-wide helpers over the driver's communicator: the few operations rt_main and the
// checkpoints need beyond the group collectives of comm.c (agreeing on an error, max
// reductions, gathers of whole tensors and of the DP batch to rank 0), all on the world group.
// Only here does the driver's side call MPI directly (point-to-point sends and receives); on a
// world of one (a NULL communicator, or one of one rank) none of them touches MPI.
#include "moert.h"
#include "rt_internal.h"
#include "rt_mpi.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int rt_world_agree(RtComm *c, int status) {
  int world = rt_all_size(c);   // every stage's ranks: a failing stage stops the others too
  if (world == 1)
    return status;
  int me = rt_all_rank(c);
  // The lowest failing rank (world when none), as the largest negated rank: a collective with the
  // deadline of every other (comm.c), so that a cut link ends the job here too.
  double lowest_neg = -(double)(status != 0 ? me : world);
  rt_all_max_f64(c, &lowest_neg, 1);
  int lowest = (int)-lowest_neg;
  if (lowest == world)
    return 0;
  char msg[1024];
  snprintf(msg, sizeof msg, "%s", rt_last_error()[0] ? rt_last_error() : "unknown failure");
  rt_all_bcast(c, msg, (int64_t)sizeof msg, lowest);
  msg[sizeof msg - 1] = '\0';
  if (lowest == 0)
    rt_fail("%s", msg);
  else
    rt_fail("rank %d: %s", lowest, msg);
  return -1;
}

void rt_world_max(RtComm *c, double *v, int n) {
  if (rt_comm_size(c, RT_GROUP_WORLD) > 1)
    rt_allreduce_max_f64(c, RT_GROUP_WORLD, v, n);   // with the collectives' deadline (comm.c)
}

// The coordinates of another rank of the same layout.
static RtRanks peer_of(const RtRanks *r, int rank) {
  RtLayout l = {.dp = r->dp, .mp = r->mp, .ep = r->ep, .esp = r->esp, .gpus_per_node = 1};
  return rt_ranks_of(&l, rank, r->world);
}

void rt_gather_param(RtComm *c, const RtParam *p, const RtRanks *r, const float *shard,
                     float *whole) {
  int64_t zero[4] = {0}, off[4];
  if (r->rank != 0) {
    if (rt_shard_owner(p, r))
      rt_send_floats(c, RT_GROUP_WORLD, 0, shard, p->numel);
    return;
  }
  float *buf = NULL;
  if (r->world > 1 && p->numel > 0)
    buf = rt_alloc((size_t)p->numel * sizeof(float), "a parameter's shard gathered on rank 0");
  for (int k = 0; k < r->world; k++) {
    RtRanks peer = peer_of(r, k);
    if (!rt_shard_owner(p, &peer))
      continue;
    const float *src = shard;
    if (k != 0) {
      rt_recv_floats(c, RT_GROUP_WORLD, k, buf, p->numel);
      src = buf;
    }
    rt_shard_offsets(p, &peer, off);
    rt_box_copy(p->rank, off, p->dims, src, zero, p->global_dims, whole);
  }
  free(buf);
}

void rt_gather_dp(RtComm *c, const RtRanks *r, const float *mine, int64_t n, float *whole) {
  if (r->rank != 0) {
    if (r->mp_index == 0)
      rt_send_floats(c, RT_GROUP_WORLD, 0, mine, n);
    return;
  }
  memcpy(whole, mine, (size_t)n * sizeof(float));
  for (int k = 1; k < r->dp; k++)
    rt_recv_floats(c, RT_GROUP_WORLD, k * r->mp, whole + k * n, n);
}
