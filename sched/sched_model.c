// The cost model of a generalized layer (lang/manual.md §8, paper §4.1-§4.2 and §5.1).
//
// A layer is cut into r chunks along the capacity dimension; each chunk's dispatch AlltoAll,
// ESP AllGather, expert GEMMs, ESP ReduceScatter and combine AlltoAll cost
// t_x,r = alpha_x + (n_x / r) * beta_x. The paper classifies a degree r into one of four cases
// by seven predicates Q1..Q7 (which resource dominates the pipeline) and gives each case a
// closed form; the cases partition the truth table, so the model time at an integer r is the
// closed form of the one case that holds. The baselines' own models (PipeMoE for tutel, one
// shared stream for fsmoe-no-iio) live here too, so every policy plans from the same costs.
#include <math.h>
#include <string.h>

#include "sched.h"

SchedFfn sched_ffn_of(const char *kind) {
  if (kind && strcmp(kind, "mixtral") == 0) return SCHED_FFN_MIXTRAL;
  if (kind && strcmp(kind, "oss") == 0) return SCHED_FFN_OSS;
  return SCHED_FFN_GPT;
}

// Dense gradient of the attention of a generalized layer, sharded over MP (lang/manual.md §8): GPT
// blocks have QKV (3M^2 + 3M) and the output projection (M^2 + M, its bias replicated);
// Mixtral uses grouped-query attention (K and V with 8 of 32 heads: 1.5 M^2) and no biases.
// (An oss layer is priced as GPT's: gpt-oss's attention has the biases.)
static double dense_grad_elems(const SchedLayerSpec *s) {
  double m = s->embed, mp = s->mp;
  if (s->ffn == SCHED_FFN_MIXTRAL) return 1.5 * m * m / mp + m * m / mp;
  return 3 * m * m / mp + 3 * m / mp + m * m / mp + m;
}

void sched_attention(const SchedLayerSpec *s, const SchedCluster *c, double *t_att, double *n_grad) {
  *t_att = *n_grad = 0;
  if (s->heads <= 0) return;
  double m = s->embed, l = s->seqlen, b = s->batch, mp = s->mp;
  *t_att = c->gemm.alpha + c->gemm.beta * (4 * b * l * m * m / mp + 2 * b * l * l * m / mp);
  if (s->dp > 1) *n_grad = dense_grad_elems(s);
}

void sched_layer_cost(const SchedLayerSpec *s, const SchedCluster *c, SchedLayerCost *out) {
  double gemms = sched_ffn_gemms(s->ffn);                // GEMMs per expert
  double tokens = s->f * s->batch * s->seqlen;          // f*B*L routed token slots
  double esp = s->esp;
  SchedPhase fwd = {0};
  // AlltoAll only where EP spans ranks, AllGather/ReduceScatter only where ESP does.
  if (s->ep > 1) fwd.a2a = c->alltoall;
  if (s->esp > 1) {
    fwd.ag = c->allgather;
    fwd.rs = c->reducescatter;
  }
  fwd.n_a2a = tokens * s->embed / esp;
  fwd.n_ag = fwd.n_rs = tokens * s->embed;
  fwd.n_exp = gemms * tokens * s->embed * s->hidden / esp;
  // Each chunk runs `gemms` GEMM launches: alpha scales with their number; beta applies to the
  // multiply-accumulates of all of them (n_exp already counts them).
  fwd.exp = (SchedCoef){gemms * c->gemm.alpha * sched_expert_scale(c), c->gemm.beta * sched_expert_scale(c)};
  double attention_grad;
  sched_attention(s, c, &fwd.t_att, &attention_grad);
  SchedPhase bwd = fwd;   // gradients w.r.t. inputs and weights: twice the GEMM work
  bwd.exp.alpha *= 2;
  bwd.exp.beta *= 2;
  bwd.t_att = 2 * fwd.t_att;
  out->phase[SCHED_FWD] = fwd;
  out->phase[SCHED_BWD] = bwd;
  out->ar = c->allreduce;
  out->n_grad = attention_grad;
  if (s->dp > 1) {
    // Experts are replicated when EP x ESP does not cover the ranks; their gradients then join
    // the layer's AllReduce (over the expert-data-parallel group).
    if (s->experts > 0 && (int64_t)s->ep * s->esp < (int64_t)s->dp * s->mp)
      out->n_grad += (double)s->experts / s->ep * gemms * s->embed * s->hidden / esp;
  }
}

SchedChunk sched_chunk(const SchedPhase *p, double r) {
  SchedChunk t;
  t.a2a = p->a2a.alpha + p->n_a2a / r * p->a2a.beta;
  t.ag = p->ag.alpha + p->n_ag / r * p->ag.beta;
  t.rs = p->rs.alpha + p->n_rs / r * p->rs.beta;
  t.exp = p->exp.alpha + p->n_exp / r * p->exp.beta;
  if (r > 1 && (p->slow_exp > 0 || p->slow_comm > 0)) {
    double covered = 1 - 1 / r, fc = 1 + p->slow_exp * covered, fm = 1 + p->slow_comm * covered;
    t.exp *= fc;
    t.a2a *= fm;
    t.ag *= fm;
    t.rs *= fm;
  }
  return t;
}

double sched_assembly(const SchedPhase *p, double r) {
  if (r <= 1) return 0;
  return (r - 1) * p->t_sum + log2(r) * p->t_level;
}

double sched_ar_time(const SchedCoef *ar, double n) { return n > 0 ? ar->alpha + ar->beta * n : 0; }

double sched_ar_elems(const SchedCoef *ar, double t) {
  if (t <= ar->alpha || ar->beta <= 0) return 0;
  return (t - ar->alpha) / ar->beta;
}

void sched_q(const SchedPhase *p, double r, double t_gar, bool q[8]) {
  SchedChunk t = sched_chunk(p, r);
  double a2a2 = 2 * (r - 1) * t.a2a;
  q[0] = false;
  q[1] = t.a2a > t.ag;
  q[2] = r * t.exp > a2a2;
  q[3] = r * t.exp > (r - 1) * (t.ag + t.rs);
  q[4] = t_gar > t.ag + t.rs;
  q[5] = t_gar > r * t.exp - a2a2 + t.ag + t.rs;
  q[6] = t_gar > r * t.ag + r * t.rs - a2a2;
  q[7] = t_gar > t.ag + t.rs + r * t.exp - a2a2;
}

int sched_case(const SchedPhase *p, double r, double t_gar) {
  bool q[8];
  sched_q(p, r, t_gar, q);
  if (q[1]) {
    if (q[2]) return q[5] ? 1 : 2;
    return q[4] ? 1 : 3;
  }
  if (q[3]) return q[7] ? 1 : 2;
  return q[6] ? 1 : 4;
}

double sched_case_time(const SchedPhase *p, int c, double r, double t_gar) {
  SchedChunk t = sched_chunk(p, r);
  double assembly = sched_assembly(p, r);
  switch (c) {
  case 1: return 2 * r * t.a2a + t_gar + assembly;
  case 2: return 2 * t.a2a + t.ag + t.rs + r * t.exp + assembly;
  case 3: return 2 * r * t.a2a + t.ag + t.rs + assembly;
  case 4: return 2 * t.a2a + r * t.ag + r * t.rs + assembly;
  }
  return INFINITY;  // not a case
}

double sched_model_time(const SchedPhase *p, double r, double t_gar) {
  return sched_case_time(p, sched_case(p, r, t_gar), r, t_gar);
}

double sched_olp_moe(const SchedPhase *p, double r) {
  SchedChunk t = sched_chunk(p, r);
  double idle = sched_model_time(p, r, 0) - sched_assembly(p, r) - 2 * r * t.a2a;
  return idle > 0 ? idle : 0;
}

double sched_tutel_model(const SchedPhase *p, double r) {
  SchedChunk t = sched_chunk(p, r);
  return fmax(2 * r * t.a2a, 2 * t.a2a + r * t.exp) + sched_assembly(p, r);
}

double sched_noiio_model(const SchedPhase *p, double r, double t_gar) {
  SchedChunk t = sched_chunk(p, r);
  double comm = r * (2 * t.a2a + t.ag + t.rs) + t_gar;
  double compute = 2 * t.a2a + t.ag + t.rs + r * t.exp;
  return fmax(comm, compute) + sched_assembly(p, r);
}

double sched_noiio_olp(const SchedPhase *p, double r) {
  SchedChunk t = sched_chunk(p, r);
  double idle = sched_noiio_model(p, r, 0) - sched_assembly(p, r) - r * (2 * t.a2a + t.ag + t.rs);
  return idle > 0 ? idle : 0;
}

double sched_sequential_time(const SchedLayerCost *c, int n) {
  double total = 0;
  for (int i = 0; i < n; i++) {
    for (int ph = 0; ph < 2; ph++) {
      const SchedPhase *p = &c[i].phase[ph];
      SchedChunk t = sched_chunk(p, 1);
      total += p->t_att + 2 * t.a2a + t.ag + t.rs + t.exp;
    }
    total += sched_ar_time(&c[i].ar, c[i].n_grad);
  }
  return total;
}

void sched_table4_seqlens(const SchedCluster *c, double out[3]) {
  static const double a[3] = {512, 1024, 2048}, b[3] = {256, 512, 1024};
  memcpy(out, c->name && strncmp(c->name, "testbed_b", 9) == 0 ? b : a, 3 * sizeof *out);
}

void sched_table4_case(int id, const SchedCluster *c, const double seqlens[3], double dropless_capacity,
                       SchedTable4Case *tc, SchedLayerSpec *spec) {
  static const double batches[] = {1, 2, 4}, embeds[] = {1024, 2048, 4096}, hscales[] = {2, 3, 4};
  static const int heads[] = {8, 16, 32};
  int k = id;
  int ffn = k % 2; k /= 2;
  int f = k % 3; k /= 3;
  int hs = k % 3; k /= 3;
  int m = k % 3; k /= 3;
  int l = k % 3; k /= 3;
  int h = k % 3; k /= 3;
  int b = k % 3;
  double fs[3] = {1.2, 2.4, 2 * dropless_capacity};   // f = k*capacity; `*`: top-2, dropless
  *tc = (SchedTable4Case){id, batches[b], seqlens[l], embeds[m], hscales[hs], fs[f], heads[h],
                          ffn ? SCHED_FFN_MIXTRAL : SCHED_FFN_GPT, f == 2};
  int gpn = c->gpus_per_node, nodes = c->nodes;
  *spec = (SchedLayerSpec){.batch = tc->batch, .seqlen = tc->seqlen, .embed = tc->embed,
                           .hidden = tc->hscale * tc->embed, .f = tc->f, .experts = nodes, .heads = tc->heads,
                           .ffn = tc->ffn, .dp = nodes, .mp = gpn, .ep = nodes, .esp = gpn, .r_max = SCHED_R_MAX};
}
