// The gate kernels of the module library: what the gates other than gshard need.
//
// sigmoid (BASE / StableMoE scores), the softmax over tokens and expert-choice routing
// (expert_choice gates: every expert picks its tokens instead of every token its experts),
// L2-normalised rows and a division by a learned scalar (xmoe's cosine router with its
// temperature), and rt_iota, the idx of a routing in which choice j of every token is expert j.
// The conventions are kernels.c's: row-major float32, every kernel writes its whole result,
// reductions accumulate in double, and routing groups are equal runs of tokens in order.
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

// ---- elementwise ----

// exp of a non-positive number only, so that neither branch overflows.
void rt_sigmoid(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    if (v >= 0.0f) {
      y[i] = 1.0f / (1.0f + expf(-v));
    } else {
      float z = expf(v);
      y[i] = z / (1.0f + z);
    }
  }
}

void rt_sigmoid_grad(const float *dy, const float *y, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

void rt_div_scalar(const float *x, const float *s, float *y, int64_t n) {
  float d = s[0];
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] / d;
}

void rt_div_scalar_grad_x(const float *dy, const float *s, float *dx, int64_t n) {
  float d = s[0];
  for (int64_t i = 0; i < n; i++)
    dx[i] = dy[i] / d;
}

void rt_div_scalar_grad_s(const float *dy, const float *x, const float *s, float *ds, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++)
    acc += (double)dy[i] * x[i];
  double d = s[0];
  ds[0] = (float)(-acc / (d * d));
}

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

// ---- L2-normalised rows ----

void rt_l2norm(const float *x, float *y, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    float *yr = y + (size_t)r * n;
    double ss = 0.0;
    for (int i = 0; i < n; i++)
      ss += (double)xr[i] * xr[i];
    float inv = (float)(1.0 / sqrt(ss + 1e-12));
    for (int i = 0; i < n; i++)
      yr[i] = xr[i] * inv;
  }
}

// With r = sqrt(sum x^2 + 1e-12): dx = dy / r - x <dy, x> / r^3.
void rt_l2norm_grad(const float *dy, const float *x, float *dx, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n, *dr = dy + (size_t)r * n;
    float *out = dx + (size_t)r * n;
    double ss = 0.0, dot = 0.0;
    for (int i = 0; i < n; i++) {
      ss += (double)xr[i] * xr[i];
      dot += (double)dr[i] * xr[i];
    }
    double norm = sqrt(ss + 1e-12);
    float inv = (float)(1.0 / norm), proj = (float)(dot / (norm * norm * norm));
    for (int i = 0; i < n; i++)
      out[i] = dr[i] * inv - xr[i] * proj;
  }
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
