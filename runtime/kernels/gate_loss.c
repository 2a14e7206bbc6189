// The gate's losses in libmoert: the load-balancing aux loss per routing group and pooled over
// the ranks (rt_pool_layer, rt_pool_finish), and the router z-loss, with their gradients. The
// siblings of codegen/cuda/gate_loss.cu. Conventions of every CPU kernel: runtime/kernels.def.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

// Per group: me_e = mean score of expert e, ce_e = fraction of tokens whose first choice is e,
// aux_g = E * sum_e me_e ce_e. Fills me and ce (e doubles each) for group gi.
static void aux_group_stats(const float *scores, const int32_t *idx, int s, int e, int k, int g,
                            int gi, double *me, double *ce) {
  int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
  for (int i = 0; i < e; i++)
    me[i] = ce[i] = 0.0;
  for (int t = t0; t < t1; t++) {
    const float *row = scores + (size_t)t * e;
    for (int i = 0; i < e; i++)
      me[i] += row[i];
    ce[idx[(size_t)t * k]] += 1.0;
  }
  int n = t1 - t0;
  for (int i = 0; i < e && n > 0; i++) {
    me[i] /= n;
    ce[i] /= n;
  }
}

void rt_aux_loss(const float *scores, const int32_t *idx, float *out, int s, int e, int k, int g,
                 float share) {
  out[0] = rt_aux_loss_value(scores, idx, s, e, k, g) / share;
}

float rt_aux_loss_value(const float *scores, const int32_t *idx, int s, int e, int k, int g) {
  if (g < 1)
    g = 1;
  double *me = rt_alloc(2 * (size_t)e * sizeof *me, "rt_aux_loss"), *ce = me + e;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    aux_group_stats(scores, idx, s, e, k, g, gi, me, ce);
    double dot = 0.0;
    for (int i = 0; i < e; i++)
      dot += me[i] * ce[i];
    total += e * dot;
  }
  free(me);
  return (float)(total / g);
}

// ce is treated as a constant (it is piecewise constant in the scores):
// d/dscores[t,e] = coef * E * ce_e / (S_g * G) for t in group g.
void rt_aux_loss_grad(const float *scores, const int32_t *idx, float *dscores, int s, int e,
                      int k, int g, float coef) {
  if (g < 1)
    g = 1;
  double *me = rt_alloc(2 * (size_t)e * sizeof *me, "rt_aux_loss_grad"), *ce = me + e;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    aux_group_stats(scores, idx, s, e, k, g, gi, me, ce);
    for (int t = t0; t < t1; t++) {
      float *dr = dscores + (size_t)t * e;
      for (int i = 0; i < e; i++)
        dr[i] = (float)((double)coef * e * ce[i] / ((double)(t1 - t0) * g));
    }
  }
  free(me);
}

// DeepSeek-V3's sequence-wise balance loss (manual §11.3 `aux sequence`): per group (a sequence)
// of T tokens, f_i = E / (K T) * (the choices of expert i among its T*K) and P_i = (1/T) * sum_t
// scores[t, i] / Z_t, Z_t = sum_j scores[t, j] (the scores normalised per token); the group's loss
// sum_i f_i P_i, the mean over the g groups. In double: Z_t over j ascending, P over t ascending.
static void seq_counts(const int32_t *idx, int t0, int t1, int e, int k, double *f) {
  for (int i = 0; i < e; i++)
    f[i] = 0.0;
  for (int64_t c = (int64_t)t0 * k; c < (int64_t)t1 * k; c++)
    f[idx[c]] += 1.0;
  double n = (double)(t1 - t0) * k;
  for (int i = 0; i < e && n > 0; i++)
    f[i] = f[i] * e / n;
}

static double row_sum(const float *row, int e) {
  double z = 0.0;
  for (int j = 0; j < e; j++)
    z += row[j];
  return z;
}

void rt_aux_seq(const float *scores, const int32_t *idx, float *out, int s, int e, int k, int g, float share) {
  if (g < 1)
    g = 1;
  double *f = rt_alloc(2 * (size_t)e * sizeof *f, "rt_aux_seq"), *p = f + e, total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    seq_counts(idx, t0, t1, e, k, f);
    for (int i = 0; i < e; i++)
      p[i] = 0.0;
    for (int t = t0; t < t1; t++) {
      const float *row = scores + (size_t)t * e;
      double z = row_sum(row, e);
      for (int i = 0; i < e && z > 0; i++)
        p[i] += row[i] / z;
    }
    double part = 0.0;
    for (int i = 0; i < e && t1 > t0; i++)
      part += f[i] * (p[i] / (t1 - t0));
    total += part;
  }
  free(f);
  out[0] = (float)(total / g) / share;
}

// f is a constant of the scores (piecewise constant): d/dscores[t, j] = coef / (T g) * (f_j -
// sum_i f_i scores[t, i] / Z_t) / Z_t.
void rt_aux_seq_grad(const float *scores, const int32_t *idx, float *dscores, int s, int e, int k, int g, float coef) {
  if (g < 1)
    g = 1;
  double *f = rt_alloc((size_t)e * sizeof *f, "rt_aux_seq_grad");
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    seq_counts(idx, t0, t1, e, k, f);
    for (int t = t0; t < t1; t++) {
      const float *row = scores + (size_t)t * e;
      float *dr = dscores + (size_t)t * e;
      double z = row_sum(row, e), dot = 0.0;
      for (int i = 0; i < e; i++)
        dot += f[i] * row[i];
      for (int j = 0; j < e; j++)
        dr[j] = z > 0 ? (float)((double)coef / ((double)(t1 - t0) * g) * (f[j] - dot / z) / z) : 0.0f;
    }
  }
  free(f);
}

// The pooled aux loss (manual §11.3 `aux pooled`): this layer's sums on this rank, stats[i] =
// sum_t scores[t, i] and stats[e + i] = the number of the s*k top-k choices that are expert i.
// rt_pool_layer and rt_pool_finish make the loss of them and write the pooled P and F/N back.
void rt_aux_pooled(const float *scores, const int32_t *idx, float *stats, int s, int e, int k) {
  double *sum = rt_alloc(2 * (size_t)e * sizeof *sum, "rt_aux_pooled"), *count = sum + e;
  for (int i = 0; i < 2 * e; i++)
    sum[i] = 0.0;
  for (int t = 0; t < s; t++) {
    const float *row = scores + (size_t)t * e;
    for (int i = 0; i < e; i++)
      sum[i] += row[i];
    for (int j = 0; j < k; j++)
      count[idx[(size_t)t * k + j]] += 1.0;
  }
  for (int i = 0; i < 2 * e; i++)
    stats[i] = (float)sum[i];
  free(sum);
}

// F is a constant of the scores (piecewise constant): d aux / d scores[t, i] = E * F_i / N, the
// same for every token; pooled[e + i] holds F_i / N.
void rt_aux_pooled_grad(const float *pooled, float *dscores, int s, int e, float coef) {
  for (int i = 0; i < e; i++) {
    float d = (float)((double)coef * e * pooled[e + i]);
    for (int t = 0; t < s; t++)
      dscores[(size_t)t * e + i] = d;
  }
}

// The sums are taken now (the buffer of a layer whose coefficient is 0 may be reused by later
// layers: nothing reads it after the forward); a buffer the backward reads is kept for the write-back.
void rt_pool_layer(RtStep *st, float *stats, int e, int64_t tokens, double coef) {
  if (!st->pool_sum) {
    st->pool_sum = rt_alloc((2 * (size_t)e + 1) * sizeof *st->pool_sum, "rt_pool_layer");
    for (int i = 0; i <= 2 * e; i++)
      st->pool_sum[i] = 0.0;
  }
  for (int i = 0; i < 2 * e; i++)
    st->pool_sum[i] += stats[i];
  st->pool_sum[2 * e] += (double)tokens;
  st->pool_experts = e;
  st->pool_coef = coef;
  if (coef == 0)
    return;
  if (st->npool == RT_POOL_MAX_LAYERS)
    rt_comm_abort("'aux pooled' in more than %d layers", RT_POOL_MAX_LAYERS);
  st->pool[st->npool++] = stats;
}

void rt_pool_finish(RtStep *st) {
  int e = st->pool_experts;
  double *sum = st->pool_sum;
  if (!sum)
    return;
  st->pool_sum = NULL;
  if (st->comm)  // every rank routes tokens of its own
    rt_allreduce_f64(st->comm, RT_GROUP_WORLD, sum, 2 * (int64_t)e + 1);
  double n = sum[2 * e], aux = 0.0;
  for (int i = 0; i < e && n > 0; i++)
    aux += (sum[i] / n) * (sum[e + i] / n);
  aux *= e;
  if (rt_comm_rank(st->comm, RT_GROUP_WORLD) == 0) {  // one share: the report sums over the world
    st->aux += aux;
    st->aux_total += (double)(float)st->pool_coef * aux;
  }
  for (int l = 0; l < st->npool; l++)
    for (int i = 0; i < e && n > 0; i++) {
      st->pool[l][i] = (float)(sum[i] / n);
      st->pool[l][e + i] = (float)(sum[e + i] / n / n);
    }
  free(sum);
}

static double row_logsumexp(const float *row, int e) {
  float mx = -INFINITY;
  for (int j = 0; j < e; j++)
    if (row[j] > mx)
      mx = row[j];
  double sum = 0.0;
  for (int j = 0; j < e; j++)
    sum += exp((double)row[j] - mx);
  return mx + log(sum);
}

// Mean over groups of the group's mean of lse^2 (the mean over tokens when groups are equal).
void rt_z_loss(const float *logits, float *out, int s, int e, int g, float share) {
  out[0] = rt_z_loss_value(logits, s, e, g) / share;
}

float rt_z_loss_value(const float *logits, int s, int e, int g) {
  if (g < 1)
    g = 1;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    double acc = 0.0;
    for (int t = t0; t < t1; t++) {
      double lse = row_logsumexp(logits + (size_t)t * e, e);
      acc += lse * lse;
    }
    if (t1 > t0)
      total += acc / (t1 - t0);
  }
  return (float)(total / g);
}

// d/dlogits[t] = coef * 2 lse_t softmax(logits_t) / (S_g * G).
void rt_z_loss_grad(const float *logits, float *dlogits, int s, int e, int g, float coef) {
  if (g < 1)
    g = 1;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    double scale = 2.0 * coef / ((double)(t1 - t0) * g);
    for (int t = t0; t < t1; t++) {
      const float *row = logits + (size_t)t * e;
      float *dr = dlogits + (size_t)t * e;
      double lse = row_logsumexp(row, e);
      for (int j = 0; j < e; j++)
        dr[j] = (float)(scale * lse * exp((double)row[j] - lse));
    }
  }
}
