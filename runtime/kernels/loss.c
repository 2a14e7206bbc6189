// The model's losses: the mean squared error and the fused softmax + cross-entropy over the
// vocabulary (DESIGN §2.1), sums in double. The siblings of codegen/cuda/loss.cu, which reduce in
// the same precision. Conventions of every CPU kernel: runtime/kernels.def.
#include <math.h>
#include <stdlib.h>

#include "moert.h"
#include "rt_internal.h"

// ---- mean squared error ----

void rt_mse(const float *out, const float *target, float *loss, int64_t n, float scale) {
  loss[0] = scale * rt_mse_value(out, target, n);
}

float rt_mse_value(const float *out, const float *target, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)out[i] - target[i];
    acc += d * d;
  }
  return n > 0 ? (float)(acc / (2.0 * n)) : 0.0f;
}

void rt_mse_grad(const float *out, const float *target, float *dout, int64_t n, float scale) {
  double inv = n > 0 ? 1.0 / n : 0.0;
  for (int64_t i = 0; i < n; i++)
    dout[i] = (float)(((double)out[i] - target[i]) * inv);
  if (scale != 1.0f)
    rt_scale(dout, n, scale);
}

// ---- cross-entropy over the vocabulary ----

// Cross-entropy of rows of logits [t, v] against targets: loss[0] = scale * mean over rows of
// logsumexp(row) - row[target]; the gradient scale * (softmax(row) - onehot(target)) / t.
static double row_logsumexp(const float *row, int v) {
  float mx = -INFINITY;
  for (int j = 0; j < v; j++) mx = row[j] > mx ? row[j] : mx;
  double s = 0.0;
  for (int j = 0; j < v; j++) s += exp((double)row[j] - mx);
  return mx + log(s);
}

// The rows' terms in parallel (each row's logsumexp on one thread), their sum in row order: the
// bits of the one-thread loop.
void rt_xent(const float *logits, const int32_t *targets, float *loss, int t, int v, float scale) {
  double *term = rt_alloc((size_t)(t > 0 ? t : 1) * sizeof *term, "the cross-entropy's rows");
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    const float *row = logits + (size_t)i * v;
    term[i] = row_logsumexp(row, v) - row[targets[i]];
  }
  double acc = 0.0;
  for (int i = 0; i < t; i++) acc += term[i];
  free(term);
  loss[0] = t > 0 ? (float)(scale * acc / t) : 0.0f;
}

void rt_xent_grad(const float *logits, const int32_t *targets, float *dlogits, int t, int v, float scale) {
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    const float *row = logits + (size_t)i * v;
    float *out = dlogits + (size_t)i * v;
    double lse = row_logsumexp(row, v), f = (double)scale / t;
    for (int j = 0; j < v; j++) out[j] = (float)(f * (exp(row[j] - lse) - (j == targets[i])));
  }
}
