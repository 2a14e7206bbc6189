// Normalisations over the last dimension of a [rows, n] matrix, one row at a time, with the sums
// in double: L2-normalised rows (xmoe's cosine router), RMSNorm, LayerNorm, and the learned
// scales by column (a norm's weight) or by row (the shared expert's gate). The siblings of
// codegen/cuda/norm.cu, which run one block per row and reduce in the same precision.
// Conventions of every CPU kernel: runtime/kernels.def.
//
// RMSNorm (Zhang and Sennrich 2019) without its learned scale, which is a separate op:
//   r = 1 / sqrt(mean(x^2) + eps),  y = x r,
//   dx = r dy - x r^3 <dy, x> / n.
#include <math.h>

#include "moert.h"
#include "rt_fused.h"
#include "rt_internal.h"

#define ROW_INLINE static inline __attribute__((always_inline))   // into each vector path

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

// The sums of a row: in double, element i into running sum i % RT_LANES (rt_internal.h), so that
// they vectorise; inlined into each row's function of restrict pointers, compiled per vector width.
// row_sum: x; row_dev2: (x - m)^2; row_dot_dev: dy ((x - m) r); a b is rt_lanes_dot's.
ROW_INLINE double row_sum(const float *restrict x, int n) {
  double s[RT_LANES] = {0};
  int i = 0;
  for (; i + RT_LANES <= n; i += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) s[u] += x[i + u];
  for (; i < n; i++) s[i % RT_LANES] += x[i];
  return rt_lanes_total(s);
}

ROW_INLINE double row_dev2(const float *restrict x, int n, double m) {
  double s[RT_LANES] = {0};
  int i = 0;
  for (; i + RT_LANES <= n; i += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) s[u] += (x[i + u] - m) * (x[i + u] - m);
  for (; i < n; i++) s[i % RT_LANES] += (x[i] - m) * (x[i] - m);
  return rt_lanes_total(s);
}

ROW_INLINE double row_dot_dev(const float *restrict dy, const float *restrict x, int n, double m, double r) {
  double s[RT_LANES] = {0};
  int i = 0;
  for (; i + RT_LANES <= n; i += RT_LANES)
    for (int u = 0; u < RT_LANES; u++) s[u] += dy[i + u] * ((x[i + u] - m) * r);
  for (; i < n; i++) s[i % RT_LANES] += dy[i] * ((x[i] - m) * r);
  return rt_lanes_total(s);
}

// 1 / sqrt(mean(x^2) + eps) of one row.
ROW_INLINE double rms_inverse(const float *restrict x, int n, float eps) {
  double ss = rt_lanes_dot(x, x, n);
  return 1.0 / sqrt(ss / n + (double)eps);
}

RT_VECTOR_BODY void rmsnorm_row_body(const float *restrict x, float *restrict y, int n, float eps) {
  float inv = (float)rms_inverse(x, n, eps);
  for (int i = 0; i < n; i++) y[i] = x[i] * inv;
}
RT_VECTOR_PATHS(rmsnorm_row, (const float *restrict x, float *restrict y, int n, float eps),
                (x, y, n, eps))

void rt_rmsnorm_rows(const float *x, float *y, int64_t lo, int64_t hi, int n, float eps) {
  for (int64_t r = lo; r < hi; r++) rmsnorm_row(x + (size_t)r * n, y + (size_t)r * n, n, eps);
}

void rt_rmsnorm(const float *x, float *y, int rows, int n, float eps) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) rmsnorm_row(x + (size_t)r * n, y + (size_t)r * n, n, eps);
}

RT_VECTOR_BODY void rmsnorm_grad_row_body(const float *restrict dy, const float *restrict x, float *restrict dx,
                                          int n, float eps) {
  double inv = rms_inverse(x, n, eps), dot = rt_lanes_dot(dy, x, n);
  float scale = (float)inv, proj = (float)(inv * inv * inv * dot / n);
  for (int i = 0; i < n; i++) dx[i] = dy[i] * scale - x[i] * proj;
}
RT_VECTOR_PATHS(rmsnorm_grad_row, (const float *restrict dy, const float *restrict x, float *restrict dx, int n,
                                   float eps),
                (dy, x, dx, n, eps))

void rt_rmsnorm_grad_rows(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi, int n, float eps) {
  for (int64_t r = lo; r < hi; r++) rmsnorm_grad_row(dy + (size_t)r * n, x + (size_t)r * n, dx + (size_t)r * n, n, eps);
}

void rt_rmsnorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) {
    size_t at = (size_t)r * n;
    rmsnorm_grad_row(dy + at, x + at, dx + at, n, eps);
  }
}

// LayerNorm without its learned scale and shift (separate ops: scale, bias), biased variance:
//   r = 1 / sqrt(var(x) + eps),  xh = (x - mean) r,  y = xh,
//   dx = r (dy - mean(dy) - xh mean(dy xh)).
ROW_INLINE void row_moments(const float *restrict x, int n, float eps, double *mean, double *inv) {
  *mean = row_sum(x, n) / n;
  *inv = 1.0 / sqrt(row_dev2(x, n, *mean) / n + (double)eps);
}

RT_VECTOR_BODY void layernorm_row_body(const float *restrict x, float *restrict y, int n, float eps) {
  double mean, inv;
  row_moments(x, n, eps, &mean, &inv);
  for (int i = 0; i < n; i++) y[i] = (float)((x[i] - mean) * inv);
}
RT_VECTOR_PATHS(layernorm_row, (const float *restrict x, float *restrict y, int n, float eps),
                (x, y, n, eps))

void rt_layernorm_rows(const float *x, float *y, int64_t lo, int64_t hi, int n, float eps) {
  for (int64_t r = lo; r < hi; r++) layernorm_row(x + (size_t)r * n, y + (size_t)r * n, n, eps);
}

void rt_layernorm(const float *x, float *y, int rows, int n, float eps) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) layernorm_row(x + (size_t)r * n, y + (size_t)r * n, n, eps);
}

RT_VECTOR_BODY void layernorm_grad_row_body(const float *restrict dy, const float *restrict x,
                                            float *restrict dx, int n, float eps) {
  double mean, inv;
  row_moments(x, n, eps, &mean, &inv);
  double sd = row_sum(dy, n) / n, sdx = row_dot_dev(dy, x, n, mean, inv) / n;
  for (int i = 0; i < n; i++) dx[i] = (float)(inv * (dy[i] - sd - (x[i] - mean) * inv * sdx));
}
RT_VECTOR_PATHS(layernorm_grad_row, (const float *restrict dy, const float *restrict x, float *restrict dx, int n,
                                     float eps),
                (dy, x, dx, n, eps))

void rt_layernorm_grad_rows(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi, int n, float eps) {
  for (int64_t r = lo; r < hi; r++) layernorm_grad_row(dy + (size_t)r * n, x + (size_t)r * n, dx + (size_t)r * n, n, eps);
}

void rt_layernorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) {
    size_t at = (size_t)r * n;
    layernorm_grad_row(dy + at, x + at, dx + at, n, eps);
  }
}

// The learned scale of a norm (op scale): y = x w, w [n] along every row; dw = column sums of dy x, rows in
// order in double (dx = scale(dy, w)).
void rt_scale_cols(const float *x, const float *w, float *y, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < n; i++) y[(size_t)r * n + i] = x[(size_t)r * n + i] * w[i];
}

// Blocks of columns, the rows streamed through each block's accumulators (each column's sum
// still over rows in order, one column per lane): the bits of the column-at-a-time loop.
void rt_scale_cols_grad_w_share(const float *dy, const float *x, float *dw, int rows, int n) {
  enum { BLOCK = 64 };
  int nblocks = (n + BLOCK - 1) / BLOCK;
  RT_FOR_SHARE
  for (int bi = 0; bi < nblocks; bi++) {
    double acc[BLOCK];
    int c0 = bi * BLOCK, width = n - c0 < BLOCK ? n - c0 : BLOCK;
    for (int i = 0; i < width; i++) acc[i] = 0.0;
    for (int r = 0; r < rows; r++) {
      const float *dr = dy + (size_t)r * n + c0, *xr = x + (size_t)r * n + c0;
RT_SIMD
      for (int i = 0; i < width; i++) acc[i] += (double)dr[i] * xr[i];
    }
    for (int i = 0; i < width; i++) dw[c0 + i] = (float)acc[i];
  }
}

void rt_scale_cols_grad_w(const float *dy, const float *x, float *dw, int rows, int n) {
  RT_PARALLEL(n > 64 && (int64_t)rows * n >= RT_PAR_MIN)
  rt_scale_cols_grad_w_share(dy, x, dw, rows, n);
}

// A per-row scale (the shared expert's sigmoid gate, op scale_rows): y = x g, g [rows] one factor
// per row; dg = row sums of dy x, columns in order in double (dx = scale_rows(dy, g)).
void rt_scale_rows(const float *x, const float *g, float *y, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int i = 0; i < n; i++) y[(size_t)r * n + i] = x[(size_t)r * n + i] * g[r];
}

void rt_scale_rows_grad_g(const float *dy, const float *x, float *dg, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) {
    double acc = 0.0;
    for (int i = 0; i < n; i++) acc += (double)dy[(size_t)r * n + i] * x[(size_t)r * n + i];
    dg[r] = (float)acc;
  }
}
