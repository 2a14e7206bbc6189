// Time of the scheduling model per generalized layer, over the Table 4 layers of each shipped
// cluster profile: Algorithm 1 with SLSQP (the paper's method; the paper reports 193 ms per
// configuration in Python), the exhaustive scan of the case model, fsmoe's whole per-phase
// decision (both, plus the simulator's scan of every r), and planning + simulating a whole
// 2-layer case under all six policies. '#' lines are metadata; FAILED if Algorithm 1 takes
// 1 ms or more per layer.
//
//   cc -O2 -I. bench/sched_bench.c build/libmoec.a -lnlopt -lm -o build/bench/sched_bench
//   build/bench/sched_bench [ROOT]      (ROOT: the repository, for lang/clusters; default .)
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "frontend/fe.h"
#include "sched/sched.h"

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  const char *root = argc > 1 ? argv[1] : ".";
  static const char *const profiles[] = {"testbed-a", "testbed-a-solver", "testbed-b"};
  printf("# scheduling model time per generalized layer (forward + backward), Table 4 layers, us\n");
  printf("%-18s %6s %10s %12s %12s %14s\n", "profile", "layers", "slsqp", "exhaustive", "decision", "case (6 pol)");
  bool ok = true;
  for (int pi = 0; pi < 3; pi++) {
    char path[1024];
    snprintf(path, sizeof path, "%s/lang/clusters/%s.cluster", root, profiles[pi]);
    IrDiag d;
    ir_diag_init(&d, stderr);
    FeCluster fc;
    if (!fe_load_cluster(&d, path, (SrcLoc){0}, &fc)) return 1;
    SchedCluster c = {fc.name, (int)fc.nodes, (int)fc.gpus_per_node, {fc.gemm.alpha, fc.gemm.beta},
                      {fc.alltoall.alpha, fc.alltoall.beta}, {fc.allgather.alpha, fc.allgather.beta},
                      {fc.reducescatter.alpha, fc.reducescatter.beta}, {fc.allreduce.alpha, fc.allreduce.beta}};
    double seqlens[3], t_slsqp = 0, t_exh = 0, t_decide = 0, t_case = 0;
    sched_table4_seqlens(&c, seqlens);
    int n = 0;
    for (int id = 0; id < SCHED_TABLE4_CASES; id++, n++) {
      SchedTable4Case tc;
      SchedLayerSpec spec;
      sched_table4_case(id, &c, seqlens, SCHED_DROPLESS_CAPACITY, &tc, &spec);
      SchedLayerCost cost[2];
      sched_layer_cost(&spec, &c, &cost[0]);
      cost[1] = cost[0];
      double t_gar = sched_ar_time(&cost[0].ar, cost[0].n_grad);
      double t0 = now_s();
      for (int ph = 0; ph < 2; ph++) sched_find_degree(&cost[0].phase[ph], ph ? t_gar : 0, SCHED_R_MAX, SCHED_METHOD_SLSQP);
      double t1 = now_s();
      for (int ph = 0; ph < 2; ph++)
        sched_find_degree(&cost[0].phase[ph], ph ? t_gar : 0, SCHED_R_MAX, SCHED_METHOD_EXHAUSTIVE);
      double t2 = now_s();
      SchedLayerPlan lp = {0};
      for (int ph = 0; ph < 2; ph++) sched_fsmoe_degree(&cost[0], SCHED_R_MAX, ph, ph ? cost[0].n_grad : 0, SCHED_CHOOSE_BEST, &lp);
      double t3 = now_s();
      int rm[2] = {SCHED_R_MAX, SCHED_R_MAX};
      SchedStack st = {2, cost, rm};
      for (int q = 0; q < IR_NPOLICIES; q++) {
        SchedPlan p;
        if (!sched_plan(&st, (IrPolicy)q, &p)) return 1;
        sched_plan_free(&p);
      }
      double t4 = now_s();
      t_slsqp += t1 - t0;
      t_exh += t2 - t1;
      t_decide += t3 - t2;
      t_case += t4 - t3;
    }
    printf("%-18s %6d %10.1f %12.2f %12.1f %14.1f\n", profiles[pi], n, 1e6 * t_slsqp / n, 1e6 * t_exh / n,
           1e6 * t_decide / n, 1e6 * t_case / n);
    ok &= t_slsqp / n < 1e-3;
  }
  printf("# slsqp: Algorithm 1 (8 SLSQP sub-problems + integer neighbours) for both phases; exhaustive: the model at\n"
         "# r = 1..32; decision: fsmoe's choice incl. simulating r = 1..32; case: a 2-layer stack, 6 policies planned\n"
         "# and simulated (fsmoe includes its gradient partition and 4 placement variants)\n");
  puts(ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
