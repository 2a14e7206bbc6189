// The orders of libmoert: encode (dispatch by location) and decode (the gated combine) with their
// gradients, and the dense (GShard einsum) order. The siblings of codegen/cuda/order.cu.
// Conventions of every CPU kernel, routing groups included: runtime/kernels.def.
//
// `order gshard` moves tokens with matrices instead of indices: a one-hot dispatch mask and a
// combine-weight matrix, both [s, e*c] with c = g*cap slots per expert, so that
//     dispatch = mask^T x          ([e*c, m] = the [e, c, m] of rt_order_encode)
//     combined = cw y              ([s, m]   = rt_order_decode's output)
// are two GEMMs. The slot of choice (t, j) of a token in group gi is exactly the dispatch row
// rt_order_encode gives it, column idx*c + gi*cap + loc; dropped choices (loc < 0 or >= cap)
// have no column. The backward of the combine weights is a gather of dcw at those columns.
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

// ---- order: encode (dispatch by location) and decode (gated combine) ----
// Threads split a group's tokens: every token writes its own row (encode_grad, decode) or its own
// slots (encode, decode_grad_y) and its own gate gradients, in the one-thread order.

// Offset (in floats) of the dispatch row of kept choice c, a choice of a token in group gi:
// row gi*cap + loc of expert idx[c] in [e, g*cap, m].
static size_t slot_offset(const int32_t *idx, const int32_t *loc, size_t c, int gi, int cap,
                          int g, int m) {
  return (((size_t)idx[c] * g + gi) * cap + (size_t)loc[c]) * m;
}

static bool kept(const int32_t *loc, size_t c, int cap) { return loc[c] >= 0 && loc[c] < cap; }

// Marks the rows of [e, g*cap] that a kept choice fills (mark[r] = 1); NULL when out of memory.
static unsigned char *filled_rows(const int32_t *idx, const int32_t *loc, int s, int k, int e, int g, int cap) {
  unsigned char *mark = calloc((size_t)e * g * cap + 1, 1);
  if (!mark)
    return NULL;
  for (int gi = 0; gi < g; gi++)
    for (int t = group_begin(s, g, gi); t < group_begin(s, g, gi + 1); t++)
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (kept(loc, c, cap))
          mark[((size_t)idx[c] * g + gi) * cap + (size_t)loc[c]] = 1;
      }
  return mark;
}

// Zeroes the rows of out ([rows, m]) that no kept choice fills (all of them when mark is NULL,
// before the choices are written).
static void zero_empty_rows(float *out, const unsigned char *mark, int64_t rows, int m) {
  if (!mark) {
    memset(out, 0, (size_t)rows * m * sizeof *out);
    return;
  }
  RT_PARALLEL_FOR(rows * m >= RT_PAR_MIN)
  for (int64_t r = 0; r < rows; r++)
    if (!mark[r])
      memset(out + r * m, 0, (size_t)m * sizeof *out);
}

// Every row of the result is written: a kept choice's row in its slot, the empty slots zero.
void rt_order_encode(const float *x, const int32_t *idx, const int32_t *loc, float *disp, int s,
                     int m, int k, int e, int g, int cap) {
  if (g < 1)
    g = 1;
  unsigned char *mark = filled_rows(idx, loc, s, k, e, g, cap);
  zero_empty_rows(disp, mark, (int64_t)e * g * cap, m);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    RT_PARALLEL_FOR((int64_t)(t1 - t0) * k * m >= RT_PAR_MIN)
    for (int t = t0; t < t1; t++) {
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (!kept(loc, c, cap))
          continue;
        float *dst = disp + slot_offset(idx, loc, c, gi, cap, g, m);
        memcpy(dst, x + (size_t)t * m, (size_t)m * sizeof *dst);
      }
    }
  }
  free(mark);
}

// out[t] = the sum over the kept choices c of token t of gates[c] times c's dispatch row of rows
// (weight 1 when gates is NULL), out zeroed first: rt_order_decode, and with unit weights the
// gradient of rt_order_encode.
static void gather_choices(const float *rows, const int32_t *idx, const int32_t *loc, const float *gates,
                           float *out, int s, int m, int k, int g, int cap) {
  if (g < 1)
    g = 1;
  memset(out, 0, (size_t)s * m * sizeof *out);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    RT_PARALLEL_FOR((int64_t)(t1 - t0) * k * m >= RT_PAR_MIN)
    for (int t = t0; t < t1; t++) {
      float *dst = out + (size_t)t * m;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (!kept(loc, c, cap))
          continue;
        const float *src = rows + slot_offset(idx, loc, c, gi, cap, g, m);
        if (!gates) {
          RT_SIMD
          for (int i = 0; i < m; i++)
            dst[i] += src[i];
          continue;
        }
        float w = gates[c];
        RT_SIMD
        for (int i = 0; i < m; i++)
          dst[i] += w * src[i];
      }
    }
  }
}

void rt_order_encode_grad(const float *ddisp, const int32_t *idx, const int32_t *loc, float *dx,
                          int s, int m, int k, int e, int g, int cap) {
  gather_choices(ddisp, idx, loc, NULL, dx, s, m, k, g, cap);
}

void rt_order_decode(const float *y, const int32_t *idx, const int32_t *loc, const float *gates,
                     float *out, int s, int m, int k, int e, int g, int cap) {
  gather_choices(y, idx, loc, gates, out, s, m, k, g, cap);
}

// Every row of the result is written: 0 + gate * dout row in a kept choice's slot (the sum its
// one term makes), the empty slots zero.
void rt_order_decode_grad_y(const float *dout, const int32_t *idx, const int32_t *loc,
                            const float *gates, float *dy, int s, int m, int k, int e, int g,
                            int cap) {
  if (g < 1)
    g = 1;
  unsigned char *mark = filled_rows(idx, loc, s, k, e, g, cap);
  zero_empty_rows(dy, mark, (int64_t)e * g * cap, m);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    RT_PARALLEL_FOR((int64_t)(t1 - t0) * k * m >= RT_PAR_MIN)
    for (int t = t0; t < t1; t++) {
      const float *dr = dout + (size_t)t * m;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (!kept(loc, c, cap))
          continue;
        float *dst = dy + slot_offset(idx, loc, c, gi, cap, g, m);
        float w = gates[c];
        RT_SIMD
        for (int i = 0; i < m; i++)
          dst[i] = 0.0f + w * dr[i];
      }
    }
  }
  free(mark);
}

void rt_order_decode_grad_gates(const float *dout, const float *y, const int32_t *idx,
                                const int32_t *loc, float *dgates, int s, int m, int k, int e,
                                int g, int cap) {
  if (g < 1)
    g = 1;
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    RT_PARALLEL_FOR((int64_t)(t1 - t0) * k * m >= RT_PAR_MIN)
    for (int t = t0; t < t1; t++) {
      const float *dr = dout + (size_t)t * m;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (!kept(loc, c, cap)) {
          dgates[c] = 0.0f;
          continue;
        }
        const float *src = y + slot_offset(idx, loc, c, gi, cap, g, m);
        double dot = 0.0;
        for (int i = 0; i < m; i++)
          dot += (double)dr[i] * src[i];
        dgates[c] = (float)dot;
      }
    }
  }
}

// ---- the dense (GShard einsum) order ----

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
