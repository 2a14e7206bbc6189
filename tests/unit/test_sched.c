// Unit tests of the scheduling model (sched/sched_*.c, lang/manual.md §8):
//  - the chosen integer pipeline degree is within 1 % (simulated time) of the best degree found
//    by simulating every r in 1..32, over 2000 seeded random layers, and Algorithm 1 is fast
//    (solver time per layer printed and asserted under 1 ms);
//  - `sequential` costs exactly the closed form of lang/manual.md §8, recomputed here from the cluster
//    coefficients and the workload formulas (an independent formulation);
//  - the simulator agrees with the case model where one resource clearly dominates;
//  - on every Table 4 case of the shipped profiles, fsmoe's simulated iteration is no slower than
//    any other policy's (the list of exceptions must equal the documented one below), and the
//    resource lower bound is below every simulated time;
//  - the gradient partition conserves gradient and never all-reduces it before it exists;
//  - the Chrome trace parses as JSON (cJSON) and the SVG has one row per stream;
//  - planning is deterministic;
//  - shared chunks: the plan priced without the saved activations' assembly is never slower,
//    runs one degree in both phases when it took that way, and prices explicit degrees right.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cjson/cJSON.h>
#include <cmocka.h>
#include <math.h>

#include "frontend/fe.h"
#include "sched/sched.h"

#ifndef MOEC_ROOT
#define MOEC_ROOT "."
#endif

static const char *const profiles[] = {"testbed-a", "testbed-b", "testbed-a-solver"};
enum { NPROFILES = 3 };

static void load_cluster(const char *name, SchedCluster *c, FeCluster *fc) {
  char path[512];
  snprintf(path, sizeof path, "%s/lang/clusters/%s.cluster", MOEC_ROOT, name);
  IrDiag d;
  ir_diag_init(&d, stderr);
  assert_true(fe_load_cluster(&d, path, (SrcLoc){0}, fc));
  *c = (SchedCluster){.name = fc->name, .nodes = (int)fc->nodes, .gpus_per_node = (int)fc->gpus_per_node,
                      .gemm = {fc->gemm.alpha, fc->gemm.beta}, .alltoall = {fc->alltoall.alpha, fc->alltoall.beta},
                      .allgather = {fc->allgather.alpha, fc->allgather.beta},
                      .reducescatter = {fc->reducescatter.alpha, fc->reducescatter.beta},
                      .allreduce = {fc->allreduce.alpha, fc->allreduce.beta}};
}

// xorshift64*: a fixed sequence on every machine.
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double uniform(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return (double)((rng_state * 2685821657736338717ull) >> 11) / 9007199254740992.0;
}
static int pick(int n) { return (int)(uniform() * n) % n; }

// A random cluster around one of the shipped profiles (every coefficient scaled by 2^U(-2,2)).
static SchedCluster random_cluster(const SchedCluster *base) {
  SchedCluster c = *base;
  SchedCoef *all[] = {&c.gemm, &c.alltoall, &c.allgather, &c.reducescatter, &c.allreduce};
  for (int i = 0; i < 5; i++) {
    all[i]->alpha *= pow(2, 4 * uniform() - 2);
    all[i]->beta *= pow(2, 4 * uniform() - 2);
  }
  return c;
}

static SchedLayerSpec random_spec(const SchedCluster *c) {
  static const double batches[] = {1, 2, 4, 8}, seqlens[] = {256, 512, 1024, 2048, 4096},
                      embeds[] = {512, 1024, 2048, 4096, 8192};
  SchedLayerSpec s = {.batch = batches[pick(4)], .seqlen = seqlens[pick(5)], .embed = embeds[pick(5)],
                      .f = 0.5 + 3.5 * uniform(), .experts = c->nodes, .heads = 16,
                      .ffn = (SchedFfn)pick(3) /* gpt, mixtral, oss */, .dp = c->nodes, .mp = c->gpus_per_node,
                      .ep = c->nodes, .esp = c->gpus_per_node, .r_max = SCHED_R_MAX};
  s.hidden = (1 + pick(4)) * s.embed;
  return s;
}

static double elapsed_since(const struct timespec *t0) {
  struct timespec t1;
  clock_gettime(CLOCK_MONOTONIC, &t1);
  return (t1.tv_sec - t0->tv_sec) + (t1.tv_nsec - t0->tv_nsec) * 1e-9;
}

// (1) + (2): the chosen r against every r, and the solver's time. The chosen r is the fastest in
// simulation of Algorithm 1's SLSQP answer, the case model's integer optimum and the simulator's
// own scan (lang/manual.md §8: "use whichever choice is better, and report both"); how often the paper's
// model alone is within 1 % is printed and held to a floor. The random layers perturb the shipped
// profiles' coefficients by up to 4x each way, so AllGather and ReduceScatter often differ by far
// more than the paper's model assumes ("AllGather and ReduceScatter require similar durations").
static void test_degree_within_one_percent(void **state) {
  SchedCluster base[NPROFILES];
  FeCluster fc[NPROFILES];
  for (int i = 0; i < NPROFILES; i++) load_cluster(profiles[i], &base[i], &fc[i]);
  enum { NCASES = 2000 };
  int chosen_ok = 0, slsqp_ok = 0, exh_ok = 0, slsqp_model_opt = 0, by_model = 0;
  double worst_model = 0, decide_s = 0, slsqp_s = 0;
  for (int k = 0; k < NCASES; k++) {
    SchedCluster c = random_cluster(&base[pick(NPROFILES)]);
    SchedLayerSpec s = random_spec(&c);
    SchedLayerCost cost;
    sched_layer_cost(&s, &c, &cost);
    int ph = pick(2);
    double grad = ph == SCHED_BWD && pick(3) ? 3 * uniform() * cost.n_grad : 0;
    double t_gar = sched_ar_time(&cost.ar, grad);
    SchedLayerPlan lp = {0};
    struct timespec t0;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    sched_fsmoe_degree(&cost, SCHED_R_MAX, ph, grad, SCHED_CHOOSE_BEST, &lp);
    decide_s += elapsed_since(&t0);
    clock_gettime(CLOCK_MONOTONIC, &t0);
    SchedDegree q = sched_find_degree(&cost.phase[ph], t_gar, SCHED_R_MAX, SCHED_METHOD_SLSQP);
    slsqp_s += elapsed_since(&t0);
    assert_int_equal(q.r, lp.r_slsqp[ph]);
    SchedDegree e = sched_find_degree(&cost.phase[ph], t_gar, SCHED_R_MAX, SCHED_METHOD_EXHAUSTIVE);
    slsqp_model_opt += q.t <= e.t * (1 + 1e-12);

    // The reference: every r simulated here, independently of the planner.
    double best = INFINITY;
    for (int r = 1; r <= SCHED_R_MAX; r++) best = fmin(best, sched_sim_moe(IR_POLICY_FSMOE, &cost, ph, r, grad));
    double t_chosen = sched_sim_moe(IR_POLICY_FSMOE, &cost, ph, lp.r[ph], grad);
    chosen_ok += t_chosen <= 1.01 * best;
    slsqp_ok += lp.t_sim_slsqp[ph] <= 1.01 * best;
    exh_ok += lp.t_sim_exhaustive[ph] <= 1.01 * best;
    by_model += strcmp(lp.chosen_by[ph], "simulator") != 0;
    worst_model = fmax(worst_model, lp.t_sim_slsqp[ph] / best - 1);
  }
  printf("# degree: %d random layers; chosen r within 1%% of the best simulated r: %d (a model answer in %d);\n"
         "#   the paper's model alone: SLSQP %d, exhaustive %d, worst %.1f%% slower;"
         " SLSQP reaches the model's integer optimum in %d\n",
         NCASES, chosen_ok, by_model, slsqp_ok, exh_ok, 100 * worst_model, slsqp_model_opt);
  printf("# solver time per layer (forward + backward): Algorithm 1 with SLSQP %.1f us; with the exhaustive\n"
         "#   model scan and the simulator's judgement %.1f us (paper: 193 ms in Python)\n",
         2e6 * slsqp_s / NCASES, 2e6 * decide_s / NCASES);
  assert_int_equal(chosen_ok, NCASES);
  assert_int_equal(slsqp_model_opt, NCASES);
  assert_true(slsqp_ok >= 0.9 * NCASES);
  assert_true(2 * slsqp_s / NCASES < 1e-3);   // Algorithm 1; the judgement is printed, not held (sanitizer builds)

  // On the shipped profiles' Table 4 layers (unperturbed; backward with the layer's whole dense
  // gradient inside the MoE), Algorithm 1 with SLSQP alone must be within 1 %.
  for (int pi = 0; pi < NPROFILES; pi++) {
    double seqlens[3];
    sched_table4_seqlens(&base[pi], seqlens);
    int ok = 0, n = 0;
    for (int id = 0; id < SCHED_TABLE4_CASES; id += 3)   // heads do not change the MoE layer
      for (int k = 0; k < 3; k++) {
        SchedTable4Case tc;
        SchedLayerSpec spec;
        sched_table4_case(id, &base[pi], seqlens, SCHED_DROPLESS_CAPACITY, &tc, &spec);
        SchedLayerCost cost;
        sched_layer_cost(&spec, &base[pi], &cost);
        SchedLayerPlan lp = {0};
        int ph = k == 0 ? SCHED_FWD : SCHED_BWD;
        sched_fsmoe_degree(&cost, SCHED_R_MAX, ph, k == 2 ? cost.n_grad : 0, SCHED_CHOOSE_BEST, &lp);
        ok += lp.t_sim_slsqp[ph] <= 1.01 * lp.t_sim_sim[ph];
        n++;
      }
    printf("# degree: %s Table 4 layers (forward, backward, backward + gradient): Algorithm 1 alone within 1%%"
           " in %d of %d\n", profiles[pi], ok, n);
    assert_int_equal(ok, n);
  }
}

// (3): sequential = sum over layers of t_att + 2 t_a2a + t_ag + t_rs + t_exp (forward, r = 1), the
// same with backward times, plus one AllReduce per layer; recomputed from lang/manual.md §8's formulas.
static void test_sequential_closed_form(void **state) {
  SchedCluster base;
  FeCluster fc;
  load_cluster("testbed-a-solver", &base, &fc);
  for (int trial = 0; trial < 200; trial++) {
    SchedCluster c = random_cluster(&base);
    int n = 1 + pick(4);
    SchedLayerCost cost[4];
    int rm[4];
    double want = 0;
    for (int i = 0; i < n; i++) {
      SchedLayerSpec s = random_spec(&c);
      s.heads = pick(4) ? 16 : 0;
      sched_layer_cost(&s, &c, &cost[i]);
      rm[i] = SCHED_R_MAX;
      double g = s.ffn == SCHED_FFN_GPT ? 2 : 3, tokens = s.f * s.batch * s.seqlen, m = s.embed;
      double t_a2a = c.alltoall.alpha + c.alltoall.beta * tokens * m / s.esp;
      double t_ag = c.allgather.alpha + c.allgather.beta * tokens * m;
      double t_rs = c.reducescatter.alpha + c.reducescatter.beta * tokens * m;
      double t_exp = g * c.gemm.alpha + c.gemm.beta * g * tokens * m * s.hidden / s.esp;
      double t_att = s.heads ? c.gemm.alpha + c.gemm.beta * (4 * s.batch * s.seqlen * m * m / s.mp +
                                                              2 * s.batch * s.seqlen * s.seqlen * m / s.mp)
                             : 0;
      double grad = !s.heads ? 0
                    : s.ffn == SCHED_FFN_MIXTRAL ? 1.5 * m * m / s.mp + m * m / s.mp
                                                 : 3 * m * m / s.mp + 3 * m / s.mp + m * m / s.mp + m;
      double t_gar = grad > 0 ? c.allreduce.alpha + c.allreduce.beta * grad : 0;
      want += (t_att + 2 * t_a2a + t_ag + t_rs + t_exp) + (2 * t_att + 2 * t_a2a + t_ag + t_rs + 2 * t_exp) + t_gar;
    }
    SchedStack st = {n, cost, rm};
    SchedPlan p;
    assert_true(sched_plan(&st, IR_POLICY_SEQUENTIAL, &p));
    assert_true(fabs(p.t_iter - want) <= 1e-9 * want);
    assert_true(fabs(sched_sequential_time(cost, n) - want) <= 1e-9 * want);
    for (int i = 0; i < n; i++) assert_true(p.layer[i].r[0] == 1 && p.layer[i].r[1] == 1);
    sched_plan_free(&p);
  }
}

// Where one resource dominates every chunk, the simulated fsmoe layer is the case's closed form.
static void test_simulator_matches_cases(void **state) {
  SchedLayerCost c = {0};
  SchedPhase *p = &c.phase[SCHED_FWD];
  struct {
    SchedCoef a2a, ag, rs, exp;
    int kase;
  } regimes[] = {
      {{0.01, 1e-9}, {0.01, 1e-9}, {0.01, 1e-9}, {0.5, 1e-6}, 2},   // experts dominate
      {{0.2, 1e-6}, {0.01, 1e-9}, {0.01, 1e-9}, {0.01, 1e-9}, 3},   // AlltoAll dominates
      {{0.01, 1e-9}, {0.2, 1e-6}, {0.2, 1e-6}, {0.01, 1e-9}, 4},    // AllGather/ReduceScatter dominate
  };
  for (int k = 0; k < 3; k++) {
    p->a2a = regimes[k].a2a;
    p->ag = regimes[k].ag;
    p->rs = regimes[k].rs;
    p->exp = regimes[k].exp;
    p->n_a2a = p->n_ag = p->n_rs = p->n_exp = 1e6;
    for (int r = 1; r <= 8; r++) {
      assert_int_equal(sched_case(p, r, 0), r == 1 ? 2 : regimes[k].kase);   // r = 1: Q2 and Q3 hold
      double model = sched_model_time(p, r, 0), sim = sched_sim_moe(IR_POLICY_FSMOE, &c, SCHED_FWD, r, 0);
      assert_true(fabs(model - sim) <= 1e-9 * model);
    }
  }
}

// The Table 4 exceptions: (profile, case id, faster policy). Documented in the README beside
// the sweep table; empty means fsmoe is never slower than another policy on that profile.
typedef struct Exception {
  const char *profile;
  int id;
  const char *faster;
} Exception;
static const Exception expected_exceptions[] = {{NULL, 0, NULL}};

// (4) + (5): fsmoe is the fastest on every Table 4 case (up to the documented exceptions), and
// the lower bound is below every simulated time.
static void test_table4_fsmoe_fastest(void **state) {
  int unexpected = 0, found = 0, expected = 0;
  for (const Exception *e = expected_exceptions; e->profile; e++) expected++;
  for (int pi = 0; pi < NPROFILES; pi++) {
    SchedCluster c;
    FeCluster fc;
    load_cluster(profiles[pi], &c, &fc);
    double seqlens[3];
    sched_table4_seqlens(&c, seqlens);
    for (int id = 0; id < SCHED_TABLE4_CASES; id++) {
      SchedTable4Case tc;
      SchedLayerSpec spec;
      sched_table4_case(id, &c, seqlens, SCHED_DROPLESS_CAPACITY, &tc, &spec);
      SchedLayerCost cost[2];
      sched_layer_cost(&spec, &c, &cost[0]);
      cost[1] = cost[0];
      int rm[2] = {spec.r_max, spec.r_max};
      SchedStack st = {2, cost, rm};
      double lb = sched_lower_bound(&st, NULL, NULL);
      SchedPlan plans[IR_NPOLICIES];
      for (int q = 0; q < IR_NPOLICIES; q++) {
        assert_true(sched_plan(&st, (IrPolicy)q, &plans[q]));
        assert_true(lb <= plans[q].t_iter * (1 + 1e-12));
      }
      for (int q = 1; q < IR_NPOLICIES; q++) {
        if (plans[IR_POLICY_FSMOE].t_iter <= plans[q].t_iter * (1 + 1e-9)) continue;
        found++;
        bool listed = false;
        for (const Exception *e = expected_exceptions; e->profile; e++)
          listed |= strcmp(e->profile, profiles[pi]) == 0 && e->id == id && strcmp(e->faster, ir_policy_name[q]) == 0;
        if (!listed) {
          unexpected++;
          printf("# unexpected: %s case %d: %s %.6f ms < fsmoe %.6f ms\n", profiles[pi], id, ir_policy_name[q],
                 plans[q].t_iter, plans[IR_POLICY_FSMOE].t_iter);
        }
      }
      for (int q = 0; q < IR_NPOLICIES; q++) sched_plan_free(&plans[q]);
    }
  }
  printf("# table 4: %d x %d cases, fsmoe slower than another policy in %d (expected %d)\n", NPROFILES,
         SCHED_TABLE4_CASES, found, expected);
  assert_int_equal(unexpected, 0);
  assert_int_equal(found, expected);
}

// Random heterogeneous stacks: lower bound below every policy, gradient conserved and causal.
static void test_stacks_bound_and_gradients(void **state) {
  SchedCluster base;
  FeCluster fc;
  load_cluster("testbed-b", &base, &fc);
  int slower = 0;
  double worst = 0;
  enum { NTRIALS = 300 };
  for (int trial = 0; trial < NTRIALS; trial++) {
    SchedCluster c = random_cluster(&base);
    int n = 1 + pick(6);
    SchedLayerCost cost[6];
    int rm[6];
    for (int i = 0; i < n; i++) {
      SchedLayerSpec s = random_spec(&c);
      sched_layer_cost(&s, &c, &cost[i]);
      rm[i] = 1 + pick(SCHED_R_MAX);
    }
    SchedStack st = {n, cost, rm};
    double lb = sched_lower_bound(&st, NULL, NULL), t_fsmoe = 0;
    for (int q = 0; q < IR_NPOLICIES; q++) {
      SchedPlan p;
      assert_true(sched_plan(&st, (IrPolicy)q, &p));
      assert_true(lb <= p.t_iter * (1 + 1e-12));
      if (q == IR_POLICY_FSMOE) t_fsmoe = p.t_iter;
      else if (t_fsmoe > p.t_iter * (1 + 1e-9)) {
        slower++;
        worst = fmax(worst, t_fsmoe / p.t_iter - 1);
      }
      double placed = p.grad_tail, produced = 0, available = 0;
      for (int i = n - 1; i >= 0; i--) {
        for (int ph = 0; ph < 2; ph++) assert_true(p.layer[i].r[ph] >= 1 && p.layer[i].r[ph] <= rm[i]);
        // Slots of layer i only hold gradient of the layers visited before it (i+1..n-1).
        available -= p.layer[i].grad_moe + p.layer[i].grad_dense;
        assert_true(available >= -1e-6 * (1 + produced));
        placed += p.layer[i].grad_moe + p.layer[i].grad_dense;
        available += cost[i].n_grad;
        produced += cost[i].n_grad;
      }
      if (q != IR_POLICY_PIPEMOE_LINA) assert_true(fabs(placed - produced) <= 1e-6 * (1 + produced));
      sched_plan_free(&p);
    }
  }
  printf("# random stacks: %d of %d x %d policy pairs where fsmoe is slower (worst by %.2f%%)\n", slower, NTRIALS,
         IR_NPOLICIES - 1, 100 * worst);
}

// (8) Shared chunks (sched_plan): a backward at its forward's degree reads the forward's chunks
// of the saved activations in place, so the forward's assembly of them (t_level_shared) is not
// paid. With that part of t_level marked shared, no plan is slower than without it; a plan that
// took a shared degree runs one degree in both phases of every layer; explicit equal degrees are
// priced without the shared copies, unequal ones as before; and the shared plan is chosen at
// least sometimes (the test is not vacuous).
static void test_shared_chunks(void **state) {
  (void)state;
  SchedCluster base;
  FeCluster fc;
  load_cluster("testbed-b", &base, &fc);
  int taken = 0;
  enum { NTRIALS = 200 };
  for (int trial = 0; trial < NTRIALS; trial++) {
    SchedCluster c = random_cluster(&base);
    int n = 1 + pick(4);
    SchedLayerCost plain[4], shared[4];
    int rm[4];
    for (int i = 0; i < n; i++) {
      SchedLayerSpec s = random_spec(&c);
      sched_layer_cost(&s, &c, &plain[i]);
      rm[i] = 1 + pick(SCHED_R_MAX);
      // Copies of the size of a few expert GEMMs' outputs, priced like the profile's GEMM beta.
      SchedPhase *f = &plain[i].phase[SCHED_FWD];
      f->t_level = (1 + 4 * uniform()) * f->exp.beta * f->n_exp * 0.05;
      shared[i] = plain[i];
      shared[i].phase[SCHED_FWD].t_level_shared = f->t_level * (0.5 + 0.5 * uniform());
    }
    for (int q = 0; q < IR_NPOLICIES; q++) {
      SchedStack a = {n, plain, rm}, b = {n, shared, rm};
      SchedPlan pa, pb;
      assert_true(sched_plan(&a, (IrPolicy)q, &pa));
      assert_true(sched_plan(&b, (IrPolicy)q, &pb));
      assert_true(pb.t_iter <= pa.t_iter * (1 + 1e-12));
      if (pb.layer[0].chosen_by[SCHED_FWD] && strcmp(pb.layer[0].chosen_by[SCHED_FWD], "shared chunks") == 0) {
        taken++;
        for (int i = 0; i < n; i++) assert_int_equal(pb.layer[i].r[SCHED_FWD], pb.layer[i].r[SCHED_BWD]);
      }
      sched_plan_free(&pa);
      sched_plan_free(&pb);
      if (q == IR_POLICY_SEQUENTIAL) continue;
      int x = 2 + pick(3);
      for (int uneven = 0; uneven < 2; uneven++) {
        SchedStack fa = {n, plain, rm, .r_fix = {x, x + uneven}}, fb = {n, shared, rm, .r_fix = {x, x + uneven}};
        assert_true(sched_plan(&fa, (IrPolicy)q, &pa));
        assert_true(sched_plan(&fb, (IrPolicy)q, &pb));
        if (uneven) assert_true(fabs(pb.t_iter - pa.t_iter) <= 1e-9 * pa.t_iter);
        else assert_true(pb.t_iter <= pa.t_iter * (1 + 1e-12));
        sched_plan_free(&pa);
        sched_plan_free(&pb);
      }
    }
  }
  printf("# shared chunks: taken in %d of %d x %d plans\n", taken, NTRIALS, IR_NPOLICIES);
  assert_true(taken > 0);
}

static char *slurp(FILE *f, size_t *len) {
  fflush(f);
  long n = ftell(f);
  rewind(f);
  char *buf = malloc((size_t)n + 1);
  assert_non_null(buf);
  assert_int_equal(fread(buf, 1, (size_t)n, f), (size_t)n);
  buf[n] = '\0';
  *len = (size_t)n;
  return buf;
}

static int count(const char *hay, const char *needle) {
  int k = 0;
  for (const char *p = strstr(hay, needle); p; p = strstr(p + 1, needle)) k++;
  return k;
}

// (6): the trace is JSON with one complete event per op and one thread per stream; the SVG is an
// <svg> with one row group per stream and balanced groups.
static void test_trace_and_svg(void **state) {
  SchedCluster c;
  FeCluster fc;
  load_cluster("testbed-a-solver", &c, &fc);
  double seqlens[3];
  sched_table4_seqlens(&c, seqlens);
  for (int q = 0; q < IR_NPOLICIES; q++) {
    SchedTable4Case tc;
    SchedLayerSpec spec;
    sched_table4_case(1000, &c, seqlens, SCHED_DROPLESS_CAPACITY, &tc, &spec);
    SchedLayerCost cost[2];
    sched_layer_cost(&spec, &c, &cost[0]);
    cost[1] = cost[0];
    int rm[2] = {SCHED_R_MAX, SCHED_R_MAX};
    SchedStack st = {2, cost, rm};
    SchedPlan plan;
    assert_true(sched_plan(&st, (IrPolicy)q, &plan));
    SchedProgram g;
    assert_true(sched_build_program(&st, &plan, &g));
    assert_true(sched_simulate(&g));
    assert_true(fabs(g.makespan - plan.t_iter) <= 1e-12 * plan.t_iter);

    FILE *f = tmpfile();
    assert_non_null(f);
    assert_true(sched_write_trace(f, &g, "test \"trace\" <1>"));
    size_t len;
    char *text = slurp(f, &len);
    fclose(f);
    cJSON *root = cJSON_Parse(text);
    assert_non_null(root);
    cJSON *events = cJSON_GetObjectItemCaseSensitive(root, "traceEvents");
    assert_true(cJSON_IsArray(events));
    int complete = 0, threads = 0;
    cJSON *ev;
    cJSON_ArrayForEach(ev, events) {
      const cJSON *ph = cJSON_GetObjectItemCaseSensitive(ev, "ph");
      assert_true(cJSON_IsString(ph));
      if (strcmp(ph->valuestring, "X") == 0) {
        complete++;
        const cJSON *ts = cJSON_GetObjectItemCaseSensitive(ev, "ts"), *dur = cJSON_GetObjectItemCaseSensitive(ev, "dur");
        const cJSON *tid = cJSON_GetObjectItemCaseSensitive(ev, "tid");
        assert_true(cJSON_IsNumber(ts) && ts->valuedouble >= 0);
        assert_true(cJSON_IsNumber(dur) && dur->valuedouble >= 0);
        assert_true(cJSON_IsNumber(tid) && tid->valueint >= 0 && tid->valueint < g.nstreams);
      } else if (strcmp(cJSON_GetObjectItemCaseSensitive(ev, "name")->valuestring, "thread_name") == 0) {
        threads++;
      }
    }
    assert_int_equal(complete, g.nops);
    assert_int_equal(threads, g.nstreams);
    cJSON_Delete(root);
    free(text);

    f = tmpfile();
    assert_non_null(f);
    assert_true(sched_write_svg(f, &g, "test <svg> & \"rows\""));
    text = slurp(f, &len);
    fclose(f);
    assert_true(strncmp(text, "<svg", 4) == 0);
    assert_true(len > 7 && strcmp(text + len - 7, "</svg>\n") == 0);
    assert_int_equal(count(text, "class=\"stream\""), g.nstreams);
    assert_int_equal(count(text, "<g "), count(text, "</g>"));
    assert_int_equal(count(text, "<svg"), 1);
    free(text);
    sched_program_free(&g);
    sched_plan_free(&plan);
  }
}

static void test_deterministic(void **state) {
  SchedCluster c;
  FeCluster fc;
  load_cluster("testbed-a", &c, &fc);
  double seqlens[3];
  sched_table4_seqlens(&c, seqlens);
  for (int id = 0; id < SCHED_TABLE4_CASES; id += 97) {
    SchedTable4Case tc;
    SchedLayerSpec spec;
    sched_table4_case(id, &c, seqlens, SCHED_DROPLESS_CAPACITY, &tc, &spec);
    SchedLayerCost cost[2];
    sched_layer_cost(&spec, &c, &cost[0]);
    cost[1] = cost[0];
    int rm[2] = {SCHED_R_MAX, SCHED_R_MAX};
    SchedStack st = {2, cost, rm};
    for (int q = 0; q < IR_NPOLICIES; q++) {
      SchedPlan a, b;
      assert_true(sched_plan(&st, (IrPolicy)q, &a));
      assert_true(sched_plan(&st, (IrPolicy)q, &b));
      assert_true(a.t_iter == b.t_iter && a.t_fwd == b.t_fwd && a.grad_tail == b.grad_tail);
      assert_memory_equal(a.layer, b.layer, 2 * sizeof *a.layer);
      sched_plan_free(&a);
      sched_plan_free(&b);
    }
  }
}

// GEMMs by shape (sched/sched_gemm.c): a grid point's own time, the geometric mean of two rows'
// speeds halfway (in log m) between them, clamping past the grid, a shape the sweep left out
// taken at the speed of the most rows measured at its k and n, and the chunk line of narrow rows.
static void test_gemm_by_shape(void **state) {
  (void)state;
  SchedCluster c = {.gemm = {0.5, 1e-6}};
  assert_true(fabs(sched_gemm_ms(&c, 8, 8, 8) - (0.5 + 1e-6 * 512)) < 1e-12);   // no grid: the line
  // ms per multiply-accumulate: 4e-8 at m 16, 1e-8 at m 256 (k = n = 64); 2e-8 at m 16, k = n = 256.
  SchedGemmAt g[] = {{16, 64, 64, 16 * 64 * 64 * 4e-8}, {256, 64, 64, 256 * 64 * 64 * 1e-8},
                     {16, 256, 256, 16 * 256 * 256 * 2e-8}};
  for (int i = 0; i < 3; i++) c.gemm_at[c.ngemm_at++] = g[i];
  double e;
  e = sched_gemm_ms(&c, 16, 64, 64) / (16 * 64 * 64);
  assert_true(fabs(e / 4e-8 - 1) < 1e-12);
  e = sched_gemm_ms(&c, 64, 64, 64) / (64 * 64 * 64);   // log-halfway between 16 and 256
  assert_true(fabs(e / 2e-8 - 1) < 1e-12);
  e = sched_gemm_ms(&c, 4096, 64, 64) / (4096.0 * 64 * 64);   // past the grid: the last row's speed
  assert_true(fabs(e / 1e-8 - 1) < 1e-12);
  e = sched_gemm_ms(&c, 1, 64, 64) / (64 * 64);   // below it: the first row's
  assert_true(fabs(e / 4e-8 - 1) < 1e-12);
  // [256, 256] x [256, 256] was left out: the speed of m 16 at that k and n.
  e = sched_gemm_ms(&c, 256, 256, 256) / (256.0 * 256 * 256);
  assert_true(fabs(e / 2e-8 - 1) < 1e-12);
  // 8 experts of 256 rows in chunks: whole (r = 1) at 1e-8, a quarter (64 rows) at 2e-8 a
  // multiply-accumulate: the chunk line passes through both.
  SchedCoef k = sched_gemm_chunks(&c, 8, 256, 64, 64);
  double x1 = 8 * 256 * 64 * 64.0;
  assert_true(fabs(k.alpha + k.beta * x1 - x1 * 1e-8) < 1e-9);
  assert_true(fabs(4 * (k.alpha + k.beta * x1 / 4) - x1 * 2e-8) < 1e-9);
  assert_true(k.alpha > 0);
}

// The pipeline's step (sched_pipe_step): the runtime's orders simulated. Equal stages take
// (M + P - 1) microbatches, GPipe and 1F1B alike; a faster first stage only adds its own
// microbatch to the last stage's M; each stage's wait is its idle time before a step that needed
// a message.
static void test_pipe_step(void **state) {
  (void)state;
  double t3[4] = {3, 3, 3, 3}, f1[4] = {1, 1, 1, 1}, zero[3] = {0, 0, 0};
  for (int P = 1; P <= 4; P++)
    for (int M = 1; M <= 8; M++)
      for (int g = 0; g < 2; g++) {
        SchedPipe p = {.stages = P, .micro = M, .gpipe = g, .t_micro = t3, .t_fwd = f1, .t_msg = zero};
        SchedPipePlan out;
        sched_pipe_step(&p, &out);
        assert_true(fabs(out.t_step - (M + P - 1) * 3.0) < 1e-12);
        assert_true(fabs(out.t_fill - out.t_step) < 1e-12);
      }
  // P 2, M 2, 1F1B by hand: stage 0 F0 [0,1] F1 [1,2] B0 [4,6] B1 [7,9]; stage 1 F0 [1,2] B0 [2,4]
  // F1 [4,5] B1 [5,7]: stage 0 waits 2 + 1, stage 1 1; the last microbatch's reductions (+1 on
  // stage 1) and the updates (0.5, 2) come after.
  SchedPipe p = {.stages = 2, .micro = 2, .t_micro = t3, .t_fwd = f1, .t_msg = zero};
  SchedPipePlan out;
  sched_pipe_step(&p, &out);
  assert_true(fabs(out.t_step - 9) < 1e-12 && fabs(out.wait[0] - 3) < 1e-12 && fabs(out.wait[1] - 1) < 1e-12);
  assert_true(fabs(out.bubble - (3.0 / 9 + 1.0 / 9) / 2) < 1e-12);
  double last[2] = {3, 4}, upd[2] = {0.5, 2};
  p.t_last = last, p.t_update = upd;
  sched_pipe_step(&p, &out);   // stage 1's B1 [5,8], stage 0's B1 [8,10] + 0.5; stage 1 8 + 2
  assert_true(fabs(out.t_step - 10.5) < 1e-12 && fabs(out.t_pipe - 10) < 1e-12 && fabs(out.t_reduce - 1) < 1e-12);
  // stage 0 (1 + 2) faster than stage 1 (2 + 4), M 4, messages 0.5: stage 1 computes without a
  // break once F0 arrives (1 + 0.5), stage 0's last backward follows its last gradient (+0.5 + 2).
  double t[2] = {3, 6}, f[2] = {1, 2}, msg[1] = {0.5};
  SchedPipe q = {.stages = 2, .micro = 4, .t_micro = t, .t_fwd = f, .t_msg = msg};
  sched_pipe_step(&q, &out);
  assert_true(fabs(out.t_step - (1 + 0.5 + 4 * 6 + 0.5 + 2)) < 1e-12 && out.slowest == 1);
  assert_true(fabs(out.wait[1] - 1.5) < 1e-12 && out.t_step < out.t_fill);
  assert_true(fabs(out.bubble_equal - 1.0 / 5) < 1e-12);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_degree_within_one_percent),
      cmocka_unit_test(test_sequential_closed_form),
      cmocka_unit_test(test_simulator_matches_cases),
      cmocka_unit_test(test_stacks_bound_and_gradients),
      cmocka_unit_test(test_trace_and_svg),
      cmocka_unit_test(test_deterministic),
      cmocka_unit_test(test_table4_fsmoe_fastest),
      cmocka_unit_test(test_shared_chunks),
      cmocka_unit_test(test_gemm_by_shape),
      cmocka_unit_test(test_pipe_step),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
