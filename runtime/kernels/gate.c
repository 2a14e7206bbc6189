// The gate chain of libmoert: gate noise, the score functions (softmax, sigmoid for BASE /
// StableMoE, the softmax over the tokens of a group), top-k, the gather of the chosen gates,
// locations and the routing statistics they record, expert-choice routing (every expert picks
// its tokens instead of every token its experts) and rt_iota (choice j of every token is expert
// j); last, the reset of a step's statistics. The siblings of codegen/cuda/gate.cu; the gate's
// losses are gate_loss.c. Conventions of every CPU kernel, routing groups included:
// runtime/kernels.def.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_fused.h"
#include "rt_internal.h"

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

// ---- scores, top-k, gather ----

// The noise is keyed by the step's seed, step and token0.
void rt_gate_noise(const float *logits, float *out, int s, int e, float sigma, int layer,
                   uint64_t seed, int64_t step, int64_t token0) {
  size_t total = (size_t)s * e;
  if (sigma == 0.0f) {
    if (out != logits)
      memmove(out, logits, total * sizeof *out);
    return;
  }
  uint64_t key = rt_key(rt_key(rt_key(seed, RT_STREAM_NOISE), (uint64_t)step), (uint64_t)layer);
  double scale = (double)sigma / e;
  for (int t = 0; t < s; t++) {
    uint64_t base = (uint64_t)(token0 + t) * (uint64_t)e;
    for (int j = 0; j < e; j++) {
      size_t i = (size_t)t * e + j;
      out[i] = logits[i] + (float)(scale * rt_normal(key, base + (uint64_t)j));
    }
  }
}

void rt_softmax(const float *x, float *y, int s, int e) {
  for (int t = 0; t < s; t++) {
    const float *xr = x + (size_t)t * e;
    float *yr = y + (size_t)t * e;
    float mx = -INFINITY;
    for (int j = 0; j < e; j++)
      if (xr[j] > mx)
        mx = xr[j];
    double sum = 0.0;
    for (int j = 0; j < e; j++) {
      yr[j] = expf(xr[j] - mx);
      sum += yr[j];
    }
    float inv = (float)(1.0 / sum);
    for (int j = 0; j < e; j++)
      yr[j] *= inv;
  }
}

// dx = y (dy - <dy, y>) per row.
void rt_softmax_grad(const float *dy, const float *y, float *dx, int s, int e) {
  for (int t = 0; t < s; t++) {
    const float *dr = dy + (size_t)t * e, *yr = y + (size_t)t * e;
    float *xr = dx + (size_t)t * e;
    double dot = 0.0;
    for (int j = 0; j < e; j++)
      dot += (double)dr[j] * yr[j];
    float d = (float)dot;
    for (int j = 0; j < e; j++)
      xr[j] = yr[j] * (dr[j] - d);
  }
}

// The j-th choice is the largest score among those that come after choice j-1 in the order
// (score descending, index ascending); scanning indices upwards with a strict comparison gives
// ties to the lower index. NaN ranks as -inf so a row always yields k distinct experts. row[i] +
// bias[i] is expert i's score when bias is not NULL. With groups > 1 the experts are groups equal
// runs and only those of the best `best` groups take part: a group ranks by the sum of its two
// best scores (score_kind 0) or its best (1), ties to the lower group; the others count as -inf
// (transformers 5's masked_fill; the compiler checks the groups kept hold at least k experts).
static float choice_score(const float *row, const float *bias, int i) {
  float v = bias ? row[i] + bias[i] : row[i];
  return isnan(v) ? -INFINITY : v;
}

static void topk_row(const float *row, const float *bias, int32_t *out, int e, int k, int groups, int best,
                     int score_kind) {
  uint64_t keep = ~(uint64_t)0;   // bit g: group g takes part (groups <= 64: the compiler checks)
  if (groups > 1 && best < groups) {
    int per = e / groups;
    float gscore[64];
    for (int g = 0; g < groups; g++) {
      float a = -INFINITY, b = -INFINITY;   // the group's best and second best
      for (int i = g * per; i < (g + 1) * per; i++) {
        float v = choice_score(row, bias, i);
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      gscore[g] = score_kind == 0 ? a + b : a;
    }
    keep = 0;
    for (int j = 0; j < best; j++) {
      int pick = -1;
      for (int g = 0; g < groups; g++)
        if (!(keep >> g & 1) && (pick < 0 || gscore[g] > gscore[pick]))
          pick = g;
      keep |= (uint64_t)1 << pick;
    }
  }
  int per = e / (groups > 0 ? groups : 1);
  float prev_v = INFINITY;
  int prev_i = -1;
  for (int j = 0; j < k; j++) {
    int pick = -1;
    float best_v = -INFINITY;
    for (int i = 0; i < e; i++) {
      float v = keep >> (i / per) & 1 ? choice_score(row, bias, i) : -INFINITY;
      bool after_prev = v < prev_v || (v == prev_v && i > prev_i);
      if (after_prev && (pick < 0 || v > best_v)) {
        pick = i;
        best_v = v;
      }
    }
    out[j] = pick;
    prev_v = best_v;
    prev_i = pick;
  }
}

void rt_topk(const float *scores, int32_t *idx, int s, int e, int k, int groups, int best, int score_kind) {
  for (int t = 0; t < s; t++)
    topk_row(scores + (size_t)t * e, NULL, idx + (size_t)t * k, e, k, groups, best, score_kind);
}

void rt_topk_bias(const float *scores, const float *bias, int32_t *idx, int s, int e, int k, int groups, int best,
                  int score_kind) {
  for (int t = 0; t < s; t++)
    topk_row(scores + (size_t)t * e, bias, idx + (size_t)t * k, e, k, groups, best, score_kind);
}

// E * count_i - S * K in integers (exact in float below 2^24 choices): only its sign is used.
void rt_balance_load(const int32_t *idx, float *load, int s, int k, int e) {
  int64_t *count = rt_alloc((size_t)e * sizeof *count, "rt_balance_load");
  for (int i = 0; i < e; i++)
    count[i] = 0;
  for (int64_t c = 0; c < (int64_t)s * k; c++)
    if (idx[c] >= 0 && idx[c] < e)
      count[idx[c]]++;
  for (int i = 0; i < e; i++)
    load[i] = (float)((int64_t)e * count[i] - (int64_t)s * k);
  free(count);
}

void rt_gate_gather(const float *scores, const int32_t *idx, float *gates, int s, int e, int k,
                    int renorm, float scale) {
  for (int t = 0; t < s; t++) {
    const float *row = scores + (size_t)t * e;
    const int32_t *ir = idx + (size_t)t * k;
    float *gr = gates + (size_t)t * k;
    double sum = 0.0;
    for (int j = 0; j < k; j++) {
      gr[j] = row[ir[j]];
      sum += gr[j];
    }
    if (renorm && sum > 0.0) {
      for (int j = 0; j < k; j++)
        gr[j] = (float)(gr[j] / sum);
    }
    for (int j = 0; j < k; j++)
      gr[j] *= scale;
  }
}

// Without renorm: dscores[idx_j] = dgates_j. With renorm, g_j = p_j / P (P = sum of the chosen
// scores): dL/dp_i = (dgates_i - sum_j dgates_j g_j) / P. dgates_j is scale * the incoming one.
void rt_gate_gather_grad(const float *dgates, const float *scores, const int32_t *idx,
                         float *dscores, int s, int e, int k, int renorm, float scale) {
  memset(dscores, 0, (size_t)s * e * sizeof *dscores);
  for (int t = 0; t < s; t++) {
    const float *row = scores + (size_t)t * e;
    const int32_t *ir = idx + (size_t)t * k;
    const float *dg = dgates + (size_t)t * k;
    float *dr = dscores + (size_t)t * e;
    if (!renorm) {
      for (int j = 0; j < k; j++)
        dr[ir[j]] += dg[j] * scale;
      continue;
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++)
      sum += row[ir[j]];
    if (!(sum > 0.0))
      continue;
    double dot = 0.0;
    for (int j = 0; j < k; j++)
      dot += (double)(dg[j] * scale) * (row[ir[j]] / sum);
    for (int j = 0; j < k; j++)
      dr[ir[j]] += (float)((dg[j] * scale - dot) / sum);
  }
}

// ---- sigmoid scores ----

// exp of a non-positive number only, so that neither branch overflows (runtime/rt_fused.h, which
// the CPU program's fused loops call too).
void rt_sigmoid(const float *x, float *y, int64_t n) { rt_fv_sigmoid(n, y, x); }

void rt_sigmoid_grad(const float *dy, const float *y, float *dx, int64_t n) { rt_fv_sigmoid_grad(n, dx, dy, y); }

// ---- softmax over the tokens of a group ----

// Column j of a group is strided by e; the group's rows are walked in order for every column at
// once, so the matrix is read row by row (contiguously) rather than column by column.
void rt_softmax_tokens(const float *x, float *y, int s, int e, int g) {
  if (g < 1)
    g = 1;
  float *mx = rt_alloc((size_t)e * sizeof *mx, "rt_softmax_tokens");
  double *sum = rt_alloc((size_t)e * sizeof *sum, "rt_softmax_tokens");
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    for (int j = 0; j < e; j++) {
      mx[j] = -INFINITY;
      sum[j] = 0.0;
    }
    for (int t = t0; t < t1; t++)
      for (int j = 0; j < e; j++)
        if (x[(size_t)t * e + j] > mx[j])
          mx[j] = x[(size_t)t * e + j];
    for (int t = t0; t < t1; t++)
      for (int j = 0; j < e; j++) {
        size_t i = (size_t)t * e + j;
        y[i] = expf(x[i] - mx[j]);
        sum[j] += y[i];
      }
    for (int j = 0; j < e; j++)
      mx[j] = (float)(1.0 / sum[j]);   // reused for the reciprocal
    for (int t = t0; t < t1; t++)
      for (int j = 0; j < e; j++)
        y[(size_t)t * e + j] *= mx[j];
  }
  free(mx);
  free(sum);
}

// dx = y (dy - <dy, y>) per column of a group.
void rt_softmax_tokens_grad(const float *dy, const float *y, float *dx, int s, int e, int g) {
  if (g < 1)
    g = 1;
  double *dot = rt_alloc((size_t)e * sizeof *dot, "rt_softmax_tokens_grad");
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    for (int j = 0; j < e; j++)
      dot[j] = 0.0;
    for (int t = t0; t < t1; t++)
      for (int j = 0; j < e; j++)
        dot[j] += (double)dy[(size_t)t * e + j] * y[(size_t)t * e + j];
    for (int t = t0; t < t1; t++)
      for (int j = 0; j < e; j++) {
        size_t i = (size_t)t * e + j;
        dx[i] = y[i] * (dy[i] - (float)dot[j]);
      }
  }
  free(dot);
}

// ---- locations and routing statistics ----

// A choice's location is the number of earlier choices of the same expert in its group (first
// choices of every token before any second choice); one at or past cap is dropped (-1). Counters
// only grow, so a dropped choice takes no slot and every later choice of that expert in the
// group is dropped as well. cap <= 0 is dropless: the counters have no limit. st (NULL in unit
// tests) gets the statistics of rt_route_stats.
//
// The result is the largest number of choices one expert received in one group, kept or not:
// the capacity at which nothing would be dropped (a dropless layer sizes its dispatch with it).
int rt_gate_locations(const int32_t *idx, int32_t *loc, RtStep *st, int s, int k, int e, int g,
                      int cap) {
  if (g < 1)
    g = 1;
  bool dropless = cap <= 0;
  int *count = rt_alloc(2 * (size_t)e * sizeof *count, "rt_gate_locations"), *wanted = count + e;
  int most_wanted = 0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    memset(count, 0, 2 * (size_t)e * sizeof *count);
    for (int j = 0; j < k; j++) {
      for (int t = t0; t < t1; t++) {
        size_t c = (size_t)t * k + j;
        int ex = idx[c];
        wanted[ex]++;
        loc[c] = dropless || count[ex] < cap ? count[ex]++ : -1;
      }
    }
    for (int i = 0; i < e; i++)
      if (wanted[i] > most_wanted)
        most_wanted = wanted[i];
  }
  free(count);
  rt_route_stats(st, idx, loc, s, k, e, g, cap);
  return most_wanted;
}

// The drops, the routed choices and the per-expert loads (kept choices of each expert in each
// routing group), then route_hash over (idx, loc) of every choice in [t, j] order, and for a
// dropless layer (cap <= 0) capacity_max. Loads are per routing group, the unit capacity
// applies to, so a P-rank run (one group per rank) reports what its single-rank twin with P
// groups reports. An expert index outside [0, e) (a corrupted routing) counts nowhere.
void rt_route_stats(RtStep *st, const int32_t *idx, const int32_t *loc, int s, int k, int e,
                    int g, int cap) {
  if (!st)
    return;
  if (g < 1)
    g = 1;
  int64_t *load = rt_alloc(2 * (size_t)e * sizeof *load, "rt_route_stats"), *wanted = load + e;
  int64_t dropped = 0, most_wanted = 0;
  RtLayerStats *layer = rt_layer_next(st);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    memset(load, 0, 2 * (size_t)e * sizeof *load);
    for (size_t c = (size_t)t0 * k; c < (size_t)t1 * k; c++) {
      if (loc[c] < 0)
        dropped++;
      if (idx[c] < 0 || idx[c] >= e)
        continue;
      wanted[idx[c]]++;
      load[idx[c]] += loc[c] >= 0;
    }
    for (int i = 0; i < e; i++)
      if (wanted[i] > most_wanted)
        most_wanted = wanted[i];
    rt_add_loads(st, load, e);
    rt_layer_loads(layer, load, e);
  }
  free(load);
  st->dropped += dropped;
  st->routed += (int64_t)s * k;
  if (layer) {
    layer->dropped = dropped;
    layer->routed = (int64_t)s * k;
  }
  for (size_t c = 0; c < (size_t)s * k; c++)
    st->route_hash = rt_key(st->route_hash, (uint64_t)(uint32_t)idx[c] * 1000003u +
                                                (uint64_t)(int64_t)(loc[c] + 1));
  if (cap <= 0 && most_wanted > st->capacity_max)
    st->capacity_max = most_wanted;
}

RtLayerStats *rt_layer_next(RtStep *st) {
  if (!st->layer_stats || st->nlayer_stats >= st->max_layer_stats)
    return NULL;
  RtLayerStats *l = &st->layer_stats[st->nlayer_stats++];
  *l = (RtLayerStats){.load_min = INT64_MAX};
  return l;
}

// Folds loads into a min / max / sum / count.
static void fold_loads(int64_t *lo, int64_t *hi, double *sum, int64_t *count, const int64_t *load, int e) {
  for (int i = 0; i < e; i++) {
    if (load[i] < *lo)
      *lo = load[i];
    if (load[i] > *hi)
      *hi = load[i];
    *sum += (double)load[i];
  }
  *count += e;
}

void rt_layer_loads(RtLayerStats *l, const int64_t *load, int e) {
  if (l)
    fold_loads(&l->load_min, &l->load_max, &l->load_sum, &l->load_count, load, e);
}

// Folds one layer's per-expert loads into the step's min / max / mean.
void rt_add_loads(RtStep *st, const int64_t *load, int e) {
  if (st)
    fold_loads(&st->load_min, &st->load_max, &st->load_sum, &st->load_count, load, e);
}

// ---- expert choice ----

typedef struct Candidate {
  float score;   // NaN already replaced by -inf
  int token;
} Candidate;

// Score descending, then token ascending: a total order, so qsort's instability cannot matter.
static int by_score_then_token(const void *pa, const void *pb) {
  const Candidate *a = pa, *b = pb;
  if (a->score != b->score)
    return a->score > b->score ? -1 : 1;
  return (a->token > b->token) - (a->token < b->token);
}

// Every expert sorts its group's tokens and keeps the first cap; a token nobody keeps is dropped
// (its MoE output is zero). The statistics are rt_expert_choice_stats' (called after it).
void rt_expert_choice(const float *scores, int32_t *loc, int s, int e, int g, int cap) {
  if (g < 1)
    g = 1;
  int most = s / g + 1;
  Candidate *cand = rt_alloc((size_t)most * sizeof *cand, "rt_expert_choice");
  for (size_t i = 0; i < (size_t)s * e; i++)
    loc[i] = -1;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1), n = t1 - t0;
    int take = cap < n ? cap : n;
    if (take <= 0)
      continue;
    for (int j = 0; j < e; j++) {
      for (int t = t0; t < t1; t++) {
        float v = scores[(size_t)t * e + j];
        cand[t - t0] = (Candidate){isnan(v) ? -INFINITY : v, t};
      }
      qsort(cand, (size_t)n, sizeof *cand, by_score_then_token);
      for (int r = 0; r < take; r++)
        loc[(size_t)cand[r].token * e + j] = r;
    }
  }
  free(cand);
}

// Per routing group where experts take tokens (min(cap, group size) > 0), the loads (tokens each
// expert took), as rt_gate_locations' statistics; then the tokens no expert took (dropped),
// s routed, and route_hash over (j, loc) of every [t, j] in order, so that --check-grad sees
// when a perturbation changes the choice.
void rt_expert_choice_stats(RtStep *st, const int32_t *loc, int s, int e, int g, int cap) {
  if (!st)
    return;
  if (g < 1)
    g = 1;
  int64_t *load = rt_alloc((size_t)e * sizeof *load, "rt_expert_choice_stats");
  RtLayerStats *layer = rt_layer_next(st);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1), n = t1 - t0;
    if ((cap < n ? cap : n) <= 0)
      continue;
    for (int j = 0; j < e; j++) {
      load[j] = 0;
      for (int t = t0; t < t1; t++)
        load[j] += loc[(size_t)t * e + j] >= 0;
    }
    rt_add_loads(st, load, e);
    rt_layer_loads(layer, load, e);
  }
  free(load);
  int64_t dropped = 0;
  for (int t = 0; t < s; t++) {
    bool taken = false;
    for (int j = 0; j < e; j++)
      taken |= loc[(size_t)t * e + j] >= 0;
    dropped += !taken;
  }
  st->dropped += dropped;
  st->routed += s;
  if (layer) {
    layer->dropped = dropped;
    layer->routed = s;
  }
  for (size_t c = 0; c < (size_t)s * e; c++)
    st->route_hash = rt_key(st->route_hash, (uint64_t)(c % (size_t)e) * 1000003u +
                                                (uint64_t)(int64_t)(loc[c] + 1));
}

void rt_iota(int32_t *idx, int s, int e) {
  for (int t = 0; t < s; t++)
    for (int j = 0; j < e; j++)
      idx[(size_t)t * e + j] = j;
}

// ---- step statistics ----

void rt_step_begin_forward(RtStep *st) {
  st->mse = st->aux_total = st->aux = st->z = 0.0;
  st->dropped = st->routed = 0;
  st->route_hash = 0;
  st->load_min = INT64_MAX;
  st->load_max = 0;
  st->load_sum = 0.0;
  st->load_count = 0;
  st->capacity_max = 0;
  st->nlayer_stats = 0;
  st->npool = 0;
  free(st->pool_sum);   // a forward that stopped before rt_pool_finish (none does)
  st->pool_sum = NULL;
}
