// The dense (GShard einsum) order and the small elementwise kernels of the module library.
//
// `order gshard` moves tokens with matrices instead of indices: a one-hot dispatch mask and a
// combine-weight matrix, both [s, e*c] with c = g*cap slots per expert, so that
//     dispatch = mask^T x          ([e*c, m] = the [e, c, m] of rt_order_encode)
//     combined = cw y              ([s, m]   = rt_order_decode's output)
// are two GEMMs. The slot of choice (t, j) of a token in group gi is exactly the dispatch row
// rt_order_encode gives it, column idx*c + gi*cap + loc; dropped choices (loc < 0 or >= cap)
// have no column. The backward of the combine weights is a gather of dcw at those columns.
//
// The elementwise kernels (copy, silu, mul) serve SwiGLU experts (`ffn mixtral`) and hooks.
#include <math.h>
#include <string.h>

#include "moert.h"

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

static bool kept(const int32_t *loc, size_t c, int cap) { return loc[c] >= 0 && loc[c] < cap; }

// Column of kept choice c of a token in group gi, in a row of e*g*cap columns.
static size_t slot_column(const int32_t *idx, const int32_t *loc, size_t c, int gi, int cap,
                          int g) {
  return ((size_t)idx[c] * g + gi) * cap + (size_t)loc[c];
}

// Writes gates[c] (or 1 when gates is NULL) at every kept choice's column, zero elsewhere.
static void scatter_choices(const int32_t *idx, const int32_t *loc, const float *gates, float *out,
                            int s, int k, int e, int g, int cap) {
  if (g < 1)
    g = 1;
  size_t width = (size_t)e * g * cap;
  memset(out, 0, (size_t)s * width * sizeof *out);
  for (int gi = 0; gi < g; gi++) {
    for (int t = group_begin(s, g, gi); t < group_begin(s, g, gi + 1); t++) {
      float *row = out + (size_t)t * width;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (kept(loc, c, cap))
          row[slot_column(idx, loc, c, gi, cap, g)] = gates ? gates[c] : 1.0f;
      }
    }
  }
}

void rt_dispatch_mask(const int32_t *idx, const int32_t *loc, float *mask, int s, int k, int e,
                      int g, int cap) {
  scatter_choices(idx, loc, NULL, mask, s, k, e, g, cap);
}

void rt_combine_weights(const int32_t *idx, const int32_t *loc, const float *gates, float *cw,
                        int s, int k, int e, int g, int cap) {
  scatter_choices(idx, loc, gates, cw, s, k, e, g, cap);
}

void rt_combine_weights_grad(const float *dcw, const int32_t *idx, const int32_t *loc,
                             float *dgates, int s, int k, int e, int g, int cap) {
  if (g < 1)
    g = 1;
  size_t width = (size_t)e * g * cap;
  for (int gi = 0; gi < g; gi++) {
    for (int t = group_begin(s, g, gi); t < group_begin(s, g, gi + 1); t++) {
      const float *row = dcw + (size_t)t * width;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        dgates[c] = kept(loc, c, cap) ? row[slot_column(idx, loc, c, gi, cap, g)] : 0.0f;
      }
    }
  }
}

// ---- elementwise ----

void rt_copy(const float *x, float *y, int64_t n) {
  if (x != y && n > 0)
    memmove(y, x, (size_t)n * sizeof *y);
}

void rt_zero(float *y, int64_t n) {
  if (n > 0)
    memset(y, 0, (size_t)n * sizeof *y);
}

// silu(x) = x sigmoid(x); the sigmoid as in rt_sigmoid, exp of a non-positive number only.
static float sigmoid1(float v) {
  if (v >= 0.0f)
    return 1.0f / (1.0f + expf(-v));
  float z = expf(v);
  return z / (1.0f + z);
}

void rt_silu(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] * sigmoid1(x[i]);
}

// d silu/dx = sigma (1 + x (1 - sigma)).
void rt_silu_grad(const float *dy, const float *x, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float sg = sigmoid1(x[i]);
    dx[i] = dy[i] * sg * (1.0f + x[i] * (1.0f - sg));
  }
}

// The gradient w.r.t. a is rt_mul(dy, b), w.r.t. b rt_mul(dy, a): no separate kernel.
void rt_mul(const float *a, const float *b, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    y[i] = a[i] * b[i];
}
