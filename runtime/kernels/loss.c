// The model's losses: the mean squared error and the fused softmax + cross-entropy over the
// vocabulary (lang/manual.md §7.2), sums in double. The siblings of codegen/cuda/loss.cu, which reduce in
// the same precision. Conventions of every CPU kernel: runtime/kernels.def.
#include <math.h>
#include <stdlib.h>

#include "moert.h"
#include "rt_internal.h"

// The last loss a kernel computed, before its rounding to the float the step carries: --check-grad
// differences losses that float rounding would quantise to steps of 2^-24 |loss| (rt_loss_exact).
static double last_exact;

double rt_loss_exact(double value) {
  return fabs(last_exact - value) <= 4 * 0x1p-23 * fabs(value) ? last_exact : value;
}

void rt_loss_exact_parts(const double *part, int64_t n, int64_t div, double scale) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++) acc += part[i];
  last_exact = div > 0 ? scale * acc / (double)div : 0.0;
}

// ---- mean squared error ----

static double mse_sum(const float *out, const float *target, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++) {
    double d = (double)out[i] - target[i];
    acc += d * d;
  }
  return acc;
}

void rt_mse(const float *out, const float *target, float *loss, int64_t n, float scale) {
  double acc = mse_sum(out, target, n);
  loss[0] = scale * (n > 0 ? (float)(acc / (2.0 * n)) : 0.0f);
  last_exact = n > 0 ? (double)scale * acc / (2.0 * n) : 0.0;
}

float rt_mse_value(const float *out, const float *target, int64_t n) {
  return n > 0 ? (float)(mse_sum(out, target, n) / (2.0 * n)) : 0.0f;
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
// The exponentials are rt_exp's (float, within 1.3 ulp; mk_exp on CUDA computes the same bits),
// so that a row's loops vectorise; their sum is in double, in sixteen running sums (element j
// into sum j % 16) added pairwise. libm's double exp was 5 % of a vocabulary-8192 model's step.
RT_VECTOR_BODY void row_logsumexp_body(const float *row, int v, double *lse) {
  float m[RT_LANES];
  for (int u = 0; u < RT_LANES; u++) m[u] = -INFINITY;
  int j = 0;
  for (; j + RT_LANES <= v; j += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) m[u] = row[j + u] > m[u] ? row[j + u] : m[u];
  float mx = -INFINITY;
  for (int u = 0; u < RT_LANES; u++) mx = m[u] > mx ? m[u] : mx;
  for (; j < v; j++) mx = row[j] > mx ? row[j] : mx;
  double s[RT_LANES] = {0};
  for (j = 0; j + RT_LANES <= v; j += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) s[u] += (double)rt_exp(row[j + u] - mx);
  for (; j < v; j++) s[j % RT_LANES] += (double)rt_exp(row[j] - mx);
  *lse = mx + log(rt_lanes_total(s));
}
RT_VECTOR_PATHS(row_logsumexp, (const float *row, int v, double *lse), (row, v, lse))

// The rows' terms in parallel (each row's logsumexp on one thread), their sum in row order: the
// bits of the one-thread loop.
void rt_xent(const float *logits, const int32_t *targets, float *loss, int t, int v, float scale) {
  double *term = rt_alloc((size_t)(t > 0 ? t : 1) * sizeof *term, "the cross-entropy's rows");
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    const float *row = logits + (size_t)i * v;
    double lse;
    row_logsumexp(row, v, &lse);
    term[i] = lse - row[targets[i]];
  }
  double acc = 0.0;
  for (int i = 0; i < t; i++) acc += term[i];
  free(term);
  loss[0] = t > 0 ? (float)(scale * acc / t) : 0.0f;
  last_exact = t > 0 ? scale * acc / t : 0.0;
}

// out[j] = f * (exp(row[j] - lse) - (j == target)), the exponential rt_exp's of the float
// difference (mk_xent_grad's operations).
// Sixteen columns at a time, row and out apart (restrict): at -O2 GCC vectorises only loops of a
// fixed count that need no check at run time.
RT_VECTOR_BODY void xent_grad_row_body(const float *restrict row, float *restrict out, int v, double lse,
                                       double f, int target) {
  enum { W = 16 };
  int j = 0;
  for (; j + W <= v; j += W)
    for (int u = 0; u < W; u++) out[j + u] = (float)(f * (double)rt_exp((float)((double)row[j + u] - lse)));
  for (; j < v; j++) out[j] = (float)(f * (double)rt_exp((float)((double)row[j] - lse)));
  if (target >= 0) out[target] = (float)(f * ((double)rt_exp((float)((double)row[target] - lse)) - 1.0));
}
RT_VECTOR_PATHS(xent_grad_row, (const float *restrict row, float *restrict out, int v, double lse, double f,
                                int target),
                (row, out, v, lse, f, target))

void rt_xent_grad(const float *logits, const int32_t *targets, float *dlogits, int t, int v, float scale) {
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    const float *row = logits + (size_t)i * v;
    double lse;
    row_logsumexp(row, v, &lse);
    xent_grad_row(row, dlogits + (size_t)i * v, v, lse, (double)scale / t, targets[i]);
  }
}

// ---- cross-entropy over a vocabulary split over MP ranks ----
// Each rank holds the logits of tokens [v0, v0 + v) (its rows of the tied table, its columns of the
// head). A row's statistics: its slice's logsumexp (row_logsumexp's, as a double split into two
// floats: high, and the rest) and the target's logit where the target is in the slice, else 0.
// The ranks' statistics, gathered, give the whole row's logsumexp: M + log(sum_r exp(lse_r - M)),
// M the largest; the target's logit is the one part's that holds it (the others add 0).

void rt_xent_stats(const float *logits, const int32_t *targets, float *stats, int t, int v, int64_t v0) {
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    const float *row = logits + (size_t)i * v;
    double lse;
    row_logsumexp(row, v, &lse);
    int64_t k = targets[i] - v0;
    float hi = (float)lse;
    stats[3 * (size_t)i] = hi;
    stats[3 * (size_t)i + 1] = (float)(lse - hi);
    stats[3 * (size_t)i + 2] = k >= 0 && k < v ? row[k] : 0.0f;
  }
}

// Row i's logsumexp over the whole vocabulary and its target's logit, from the parts' statistics
// [parts * t, 3] (part r's rows r*t ... r*t + t - 1).
static double whole_lse(const float *stats, int t, int parts, int i, double *target) {
  double m = -INFINITY, s = 0.0;
  *target = 0.0;
  for (int r = 0; r < parts; r++) {
    const float *p = stats + 3 * ((size_t)r * t + i);
    double l = (double)p[0] + (double)p[1];
    m = l > m ? l : m;
    *target += p[2];
  }
  for (int r = 0; r < parts; r++) {
    const float *p = stats + 3 * ((size_t)r * t + i);
    s += exp((double)p[0] + (double)p[1] - m);
  }
  return m + log(s);
}

// loss[0] = scale * mean over rows of (logsumexp - the target's logit), the rows' sum in order.
void rt_xent_vp(const float *stats, float *loss, int n, int parts, float scale) {
  int t = parts > 0 ? n / parts : 0;
  double acc = 0.0;
  for (int i = 0; i < t; i++) {
    double target, lse = whole_lse(stats, t, parts, i, &target);
    acc += lse - target;
  }
  loss[0] = t > 0 ? (float)(scale * acc / t) : 0.0f;
  last_exact = t > 0 ? scale * acc / t : 0.0;
}

// The gradient of the rank's columns: scale * (softmax - onehot) / t, xent_grad_row's operations
// with the whole row's logsumexp.
void rt_xent_vp_grad(const float *logits, const int32_t *targets, const float *stats, float *dlogits, int t, int v,
                     int parts, int64_t v0, float scale) {
  RT_PARALLEL_FOR((int64_t)t * v >= RT_PAR_MIN / 8)
  for (int i = 0; i < t; i++) {
    double target, lse = whole_lse(stats, t, parts, i, &target);
    int64_t k = targets[i] - v0;
    xent_grad_row(logits + (size_t)i * v, dlogits + (size_t)i * v, v, lse, (double)scale / t, k >= 0 && k < v ? (int)k : -1);
  }
}
