// The cluster profile of the front end (a .cluster file or a model's `cluster` statement, parsed
// into FeCluster) in the scheduling model's form (SchedCluster). Below every command that prices
// with a profile (build.c, plan.c, layout.c, stages.c, sweep.c): it calls nothing in cli/.
#include "frontend/fe.h"
#include "sched/sched.h"
#include "cli/cli.h"

void cli_cluster_from_fe(const FeCluster *f, SchedCluster *c) {
  *c = (SchedCluster){.name = f->name, .nodes = (int)f->nodes, .gpus_per_node = (int)f->gpus_per_node,
                      .gemm = {f->gemm.alpha, f->gemm.beta}, .alltoall = {f->alltoall.alpha, f->alltoall.beta},
                      .allgather = {f->allgather.alpha, f->allgather.beta},
                      .reducescatter = {f->reducescatter.alpha, f->reducescatter.beta},
                      .allreduce = {f->allreduce.alpha, f->allreduce.beta},
                      .elementwise = {f->elementwise.alpha, f->elementwise.beta},
                      .attention = {f->attention.alpha, f->attention.beta}, .handoff = f->handoff,
                      .expert_gemm_scale = f->expert_gemm_scale,
                      .attention_grad = {f->attention_grad.alpha, f->attention_grad.beta},
                      .elementwise_math = {f->elementwise_math.alpha, f->elementwise_math.beta},
                      .update_adamw = {f->update_adamw.alpha, f->update_adamw.beta},
                      .update_sgd = {f->update_sgd.alpha, f->update_sgd.beta},
                      .overlap_compute = f->overlap_compute, .overlap_comm = f->overlap_comm,
                      .alltoall_intra = {f->alltoall_intra.alpha, f->alltoall_intra.beta},
                      .allreduce_intra = {f->allreduce_intra.alpha, f->allreduce_intra.beta},
                      .p2p = {f->p2p.alpha, f->p2p.beta}, .p2p_intra = {f->p2p_intra.alpha, f->p2p_intra.beta},
                      .memory = (double)f->memory};
  for (int i = 0; i < f->ngemm_at && i < SCHED_MAX_GEMM_AT; i++)
    c->gemm_at[c->ngemm_at++] = (SchedGemmAt){f->gemm_at[i][0], f->gemm_at[i][1], f->gemm_at[i][2], f->gemm_at[i][3]};
}
