// Causal grouped-query attention (DESIGN §2.1) and the column slice its backward needs.
//
// Rows r = b*seq + i of q [rows, heads*d], k and v [rows, kv*d]; query head h reads key/value
// head h / (heads/kv); query i of sample b sees keys j <= i of the same sample, and with a window
// W > 0 (Mixtral's sliding window) only those with i - W < j <= i: keys lo(i) = max(0, i - W + 1)
// to i. Each output row is computed by itself, in a fixed order, without the seq x seq matrix:
//   s_j = (q_i . k_j) * scale (the dot in column order), scale = 1/sqrt(d)
//   m = max_j s_j;  l = sum_j exp(s_j - m);  o_i = (sum_j exp(s_j - m) v_j) / l   (j ascending)
// The backward keeps per (row, head) lse = m + log(l) and D = dO_i . O_i (rt_attn_stats,
// [rows, 2*heads]: lse at column h, D at column heads + h), then
//   p_ij = exp(s_ij - lse_i),  dS_ij = p_ij (dO_i . v_j - D_i)
//   dq_i = scale * sum_j dS_ij k_j                  (j ascending)
//   dk_j = scale * sum_h sum_i dS_ij q_i            (heads of the group ascending, then i)
//   dv_j = sum_h sum_i p_ij dO_i                    (i from j to min(seq, j + W) - 1)
// into one packed row [dq | dk | dv] of width (heads + 2 kv) * d. exp is rt_exp (rt_internal.h),
// log logf. The CUDA kernels of the same names (codegen/cuda/attn.cu) do the same float
// operations per output element in the same order, so the two targets agree to the bit.
//
// How it runs here: every dot product is still a sum over c ascending of a[c] * b[c], but the dots
// of one row against all its keys (or of one key against all its queries) are computed side by
// side, one per SIMD lane, from copies of k, v (or q, dO) transposed per sample and head into
// [d][seq] columns; the exps of a row's scores form one vectorised loop; the weighted sums over t
// (o, dq, dk, dv) run over t ascending with the d columns in lanes. Sums over t of scalars (l)
// stay sequential. So each output element sees the float operations of the scalar definition in
// its order, and the results do not depend on the number of threads.
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "moert.h"
#include "rt_internal.h"

// Rows are independent: a parallel loop over them, each row computed as on one thread, when the
// causal work (rows * seq / 2 dot products of qcols) pays for the threads.
#define ATTN_PARALLEL RT_PARALLEL_FOR((int64_t)rows * seq * qcols >= 32 * RT_PAR_MIN)

static float dot(const float *a, const float *b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// The first key query i sees: 0, or i - window + 1 under a window.
static int first_key(int i, int window) { return window > 0 && i >= window ? i - window + 1 : 0; }

static float *attn_alloc(size_t floats) { return rt_alloc(floats * sizeof(float), "attention scratch"); }

static int thread_id(void) {
#ifdef _OPENMP
  return omp_get_thread_num();
#else
  return 0;
#endif
}

// x [rows, nh*d] as columns: xt[((b*nh + h)*d + c)*seq + t] = x[(b*seq + t)*nh*d + h*d + c], for
// the samples b of rows (rows is whole samples, as everywhere in attention).
static float *transpose_heads(const float *x, int rows, int seq, int nh, int d) {
  int samples = rows / seq;
  float *xt = attn_alloc((size_t)rows * nh * d);
  RT_PARALLEL_FOR((int64_t)rows * nh * d >= RT_PAR_MIN)
  for (int bh = 0; bh < samples * nh; bh++) {
    int b = bh / nh, h = bh % nh;
    float *col = xt + (size_t)bh * d * seq;
    for (int t = 0; t < seq; t++) {
      const float *row = x + (size_t)(b * seq + t) * nh * d + (size_t)h * d;
      for (int c = 0; c < d; c++) col[(size_t)c * seq + t] = row[c];
    }
  }
  return xt;
}

// The helpers below are inlined into the per-row functions, which are compiled for AVX2 and the
// baseline (RT_VECTOR_CLONES): same bits either way.
#define ATTN_INLINE static inline __attribute__((always_inline))

// out[t] = dot(a, column t of xt) for t < n, columns [d][seq] (a * x per term, c ascending): 16
// columns at a time in registers.
ATTN_INLINE void dots(const float *a, const float *xt, int seq, int n, int d, float *out) {
  enum { W = 16 };
  int t0 = 0;
  for (; t0 + W <= n; t0 += W) {
    float acc[W] = {0};
    for (int c = 0; c < d; c++) {
      float ac = a[c];
      const float *xc = xt + (size_t)c * seq + t0;
RT_SIMD
      for (int l = 0; l < W; l++) acc[l] += ac * xc[l];
    }
    memcpy(out + t0, acc, sizeof acc);
  }
  if (t0 < n) {
    memset(out + t0, 0, (size_t)(n - t0) * sizeof *out);
    for (int c = 0; c < d; c++) {
      float ac = a[c];
      const float *xc = xt + (size_t)c * seq;
RT_SIMD
      for (int t = t0; t < n; t++) out[t] += ac * xc[t];
    }
  }
}

// p[t] = rt_exp(s[t] * scale - sub[t * sub_step]) for t < n (sub_step 0: one value for all).
ATTN_INLINE void scaled_exps(const float *s, float scale, const float *sub, int sub_step, int n, float *p) {
RT_SIMD
  for (int t = 0; t < n; t++) p[t] = rt_exp(s[t] * scale - sub[t * sub_step]);
}

// y[c] += w * x[c] for c < d.
ATTN_INLINE void axpy(float w, const float *x, float *y, int d) {
RT_SIMD
  for (int c = 0; c < d; c++) y[c] += w * x[c];
}

// A row's scores against its keys 0..n-1 (s: the dots, unscaled), p = their exps less the
// maximum m of s * scale, and l = the sum of p over t ascending; returns m.
ATTN_INLINE float row_softmax(const float *qi, const float *kt, int seq, int n, int d, float scale, float *s, float *p,
                              float *l) {
  dots(qi, kt, seq, n, d, s);
  float m = -INFINITY;
  for (int t = 0; t < n; t++) {
    float v = s[t] * scale;
    m = v > m ? v : m;
  }
  scaled_exps(s, scale, &m, 0, n, p);
  float sum = 0.0f;
  for (int t = 0; t < n; t++) sum += p[t];
  *l = sum;
  return m;
}

// The output of a query row of a sample for one head over its n keys: kt the key head's columns
// from the row's first key on, v0 the value row of that key (stride kcols).
RT_VECTOR_CLONES static void fwd_row(const float *qi, const float *kt, const float *v0, float *oi, int n, int seq, int d,
                                     int kcols, float scale, float *s, float *p) {
  float l;
  row_softmax(qi, kt, seq, n, d, scale, s, p, &l);
  memset(oi, 0, (size_t)d * sizeof *oi);
  for (int t = 0; t < n; t++) axpy(p[t], v0 + (size_t)t * kcols, oi, d);
  for (int c = 0; c < d; c++) oi[c] /= l;
}

void rt_attn_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq, int heads, int kv,
                 int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d;
  float scale = 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *scratch = attn_alloc((size_t)rt_threads() * 2 * seq);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++) {
    float *s = scratch + (size_t)thread_id() * 2 * seq;
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group, lo = first_key(i, window);
      size_t at = (size_t)r * qcols + (size_t)h * d;
      fwd_row(q + at, kt + ((size_t)(r0 / seq) * kv + j) * d * seq + lo, v + (size_t)(r0 + lo) * kcols + (size_t)j * d,
              o + at, i - lo + 1, seq, d, kcols, scale, s, s + seq);
    }
  }
  free(kt);
  free(scratch);
}

RT_VECTOR_CLONES static float lse_row(const float *qi, const float *kt, int n, int seq, int d, float scale, float *s,
                                      float *p) {
  float l, m = row_softmax(qi, kt, seq, n, d, scale, s, p, &l);
  return m + logf(l);
}

void rt_attn_stats(const float *dy, const float *q, const float *k, const float *o, float *stats, int rows, int seq,
                   int heads, int kv, int qcols, int window) {
  int d = qcols / heads, group = heads / kv;
  float scale = 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *scratch = attn_alloc((size_t)rt_threads() * 2 * seq);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++) {
    float *s = scratch + (size_t)thread_id() * 2 * seq;
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group, lo = first_key(i, window);
      size_t at = (size_t)r * qcols + (size_t)h * d;
      stats[(size_t)r * 2 * heads + h] = lse_row(q + at, kt + ((size_t)(r0 / seq) * kv + j) * d * seq + lo, i - lo + 1,
                                                 seq, d, scale, s, s + seq);
      stats[(size_t)r * 2 * heads + heads + h] = dot(dy + at, o + at, d);
    }
  }
  free(kt);
  free(scratch);
}

// dq of a query row for one head over its n keys: kt, vt its key head's columns of k and v from
// the row's first key on, k0 that key's row (stride kcols).
RT_VECTOR_CLONES static void grad_q_row(const float *qi, const float *dyi, const float *kt, const float *vt,
                                        const float *k0, float lse, float D, float *dq, int n, int seq, int d,
                                        int kcols, float scale, float *s, float *u) {
  dots(qi, kt, seq, n, d, s);
  scaled_exps(s, scale, &lse, 0, n, s);   // s: p
  dots(dyi, vt, seq, n, d, u);
  memset(dq, 0, (size_t)d * sizeof *dq);
  for (int t = 0; t < n; t++) axpy(s[t] * (u[t] - D), k0 + (size_t)t * kcols, dq, d);
  for (int c = 0; c < d; c++) dq[c] *= scale;
}

void rt_attn_grad_q(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                    int rows, int seq, int heads, int kv, int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *vt = transpose_heads(v, rows, seq, kv, d);
  float *scratch = attn_alloc((size_t)rt_threads() * 2 * seq);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++) {
    float *s = scratch + (size_t)thread_id() * 2 * seq;
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group, lo = first_key(i, window);
      size_t at = (size_t)r * qcols + (size_t)h * d, col = ((size_t)(r0 / seq) * kv + j) * d * seq + lo;
      grad_q_row(q + at, dy + at, kt + col, vt + col, k + (size_t)(r0 + lo) * kcols + (size_t)j * d,
                 stats[(size_t)r * 2 * heads + h], stats[(size_t)r * 2 * heads + heads + h],
                 dqkv + (size_t)r * width + (size_t)h * d, i - lo + 1, seq, d, kcols, scale, s, s + seq);
    }
  }
  free(kt);
  free(vt);
  free(scratch);
}

// dk, dv of key t (row kt, vt) from one head's queries t .. t + n - 1: qt, dyt their columns from
// query t on, q0 and dy0 the head's row of query t (stride qcols), lse and D theirs.
RT_VECTOR_CLONES static void grad_kv_head(const float *kt, const float *vt, const float *qt, const float *dyt,
                                          const float *q0, const float *dy0, const float *lse, const float *D,
                                          float *dk, float *dv, int n, int seq, int d, int qcols, float scale,
                                          float *s, float *u) {
  dots(kt, qt, seq, n, d, s);
  scaled_exps(s, scale, lse, 1, n, s);   // s: p
  dots(vt, dyt, seq, n, d, u);
  for (int x = 0; x < n; x++) {
    axpy(s[x] * (u[x] - D[x]), q0 + (size_t)x * qcols, dk, d);
    axpy(s[x], dy0 + (size_t)x * qcols, dv, d);
  }
}

void rt_attn_grad_kv(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                     int rows, int seq, int heads, int kv, int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = 1.0f / sqrtf((float)d);
  float *qt = transpose_heads(q, rows, seq, heads, d), *dyt = transpose_heads(dy, rows, seq, heads, d);
  float *scratch = attn_alloc((size_t)rt_threads() * 4 * seq);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++) {
    float *s = scratch + (size_t)thread_id() * 4 * seq, *u = s + seq, *lse = u + seq, *D = lse + seq;
    for (int j = 0; j < kv; j++) {
      int t = r % seq, r0 = r - t, b = r0 / seq;   // key t of sample b
      int n = window > 0 && window < seq - t ? window : seq - t;   // its queries t .. t + n - 1
      float *dk = dqkv + (size_t)r * width + qcols + (size_t)j * d, *dv = dk + kcols;
      memset(dk, 0, (size_t)d * sizeof *dk);
      memset(dv, 0, (size_t)d * sizeof *dv);
      for (int h = j * group; h < (j + 1) * group; h++) {
        for (int x = 0; x < n; x++) {
          const float *st = stats + (size_t)(r + x) * 2 * heads;
          lse[x] = st[h];
          D[x] = st[heads + h];
        }
        size_t col = ((size_t)b * heads + h) * d * seq + (size_t)t, at = (size_t)r * qcols + (size_t)h * d;
        grad_kv_head(k + (size_t)r * kcols + (size_t)j * d, v + (size_t)r * kcols + (size_t)j * d, qt + col, dyt + col,
                     q + at, dy + at, lse, D, dk, dv, n, seq, d, qcols, scale, s, u);
      }
      for (int c = 0; c < d; c++) dk[c] *= scale;
    }
  }
  free(qt);
  free(dyt);
  free(scratch);
}

void rt_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  for (int r = 0; r < rows; r++)
    memcpy(y + (size_t)r * width, x + (size_t)r * cols + offset, (size_t)width * sizeof *y);
}
