// Causal grouped-query attention (lang/manual.md §7.2) and the column slice its backward needs.
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
// into one packed row [dq | dk | dv] of width (heads + 2 kv) * d. With attention sinks (attn.sink,
// gpt-oss: a logit sink_h per head in every row's softmax, with no value) m is also at least
// sink_h and l ends with exp(sink_h - m); the statistics' lse holds it, so the same backward
// gives dq, dk, dv, and d sink_h = -sum_i exp(sink_h - lse_i) D_i (rt_attn_sink_grad). exp is rt_exp (rt_internal.h),
// log logf. The CUDA kernels of the same names (codegen/cuda/attn.cu) do the same float
// operations per output element in the same order, so the fake device agrees to the bit (a GPU
// fuses the multiply-adds of the dot products and weighted sums: equal up to those roundings).
//
// How it runs here: every dot product is still a sum over c ascending of a[c] * b[c], and every
// weighted sum over t (o, dq, dk, dv) a sum over t ascending, but as a GEMM's register tile:
// TILE query rows (or keys) at a time against blocks of W keys (queries), from copies of k, v
// (or q, dO) transposed per sample and head into [d][seq] columns, so one load of a block feeds
// the TILE rows' sums, each in its own lanes; the weighted sums likewise hold TILE rows x W
// columns in registers over t. The exps of a row's scores form one vectorised loop; sums over t
// of scalars (l) stay sequential. So each output element sees the float operations of the
// scalar definition in its order (the results are those of one row at a time, to the bit), and
// do not depend on the number of threads. Tiles go round robin over the threads (the later rows
// of a causal sample see more keys).
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "moert.h"
#include "rt_internal.h"


static float dot(const float *a, const float *b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// The first key query i sees: 0, or i - window + 1 under a window.
static int first_key(int i, int window) { return window > 0 && i >= window ? i - window + 1 : 0; }

// Rows are taken TILE at a time (TILE query rows of one sample and head, or TILE keys): the
// loads of a column block of k, v (or q, dO) are shared by the TILE rows' sums, as in a GEMM's
// register tile, while each element's sum keeps its order. W columns (lanes) per block.
enum { TILE = 4, W = 16 };

static float *attn_alloc(size_t floats) { return rt_alloc(floats * sizeof(float), "attention scratch"); }

// x [rows, nh*d] as columns: xt[((b*nh + h)*d + c)*seq + t] = x[(b*seq + t)*nh*d + h*d + c], for
// the samples b of rows (rows is whole samples, as everywhere in attention).
static float *transpose_heads(const float *x, int rows, int seq, int nh, int d) {
  enum { B = 16 };   // B x B blocks: a block's rows read and its columns written as whole lines
  int samples = rows / seq;
  float *xt = attn_alloc((size_t)rows * nh * d + W);   // W floats of padding read by dots_tile
  memset(xt + (size_t)rows * nh * d, 0, W * sizeof *xt);
  RT_PARALLEL_FOR((int64_t)rows * nh * d >= RT_PAR_MIN)
  for (int bh = 0; bh < samples * nh; bh++) {
    int b = bh / nh, h = bh % nh;
    float *col = xt + (size_t)bh * d * seq;
    for (int t0 = 0; t0 < seq; t0 += B)
      for (int c0 = 0; c0 < d; c0 += B) {
        int tn = seq - t0 < B ? seq - t0 : B, cn = d - c0 < B ? d - c0 : B;
        for (int t = t0; t < t0 + tn; t++) {
          const float *row = x + (size_t)(b * seq + t) * nh * d + (size_t)h * d;
          for (int c = c0; c < c0 + cn; c++) col[(size_t)c * seq + t] = row[c];
        }
      }
  }
  return xt;
}

// The helpers below are inlined into the per-tile functions, which are compiled for AVX-512, AVX2
// and the baseline (RT_VECTOR_PATHS_P): same bits either way.
#define ATTN_INLINE static inline __attribute__((always_inline))


// A block of W floats is held in registers as one vector of GCC's vector extension where the
// path's registers are that wide (AVX-512), else as two of W / 2 (AVX2: one ymm each; the
// baseline's SSE2 splits them further). GCC lowers a vector wider than the path's registers
// through the stack (the AVX2 copy of one 16-float vector ran at a fifth of its speed), so the
// blocking follows the path, passed to the bodies as a constant (RT_VECTOR_PATHS_P). Each lane is
// its own column's sum either way: + and * on the vectors round as the scalar ones, the same
// bits on every path. VLOAD(v, p) reads one from p (any alignment).
typedef float vfloat __attribute__((vector_size(W * sizeof(float))));
typedef float vhalf __attribute__((vector_size(W / 2 * sizeof(float))));
#define VLOAD(v, p) memcpy(&(v), (p), sizeof(v))
#define VSTORE(p, v) memcpy((p), &(v), sizeof(v))

// out[k * ostride + t] = dot(a[k], column t of xt) for the rows k < TILE and t < n, columns
// [d][seq] (a * x per term, c ascending, from 0), in blocks of W columns: the last block also
// writes out[k * ostride + t] for t up to n rounded up to W, from what xt holds past column n (a
// row of columns runs into the next one; the buffer has W floats of padding at its end). Rows
// past the caller's count repeat its last one (computed and not used). T, NV: a block as NV
// vectors of type T (1 vfloat or 2 vhalf).
#define DOTS_BLOCKS(T, NV)                                                                         \
  for (int t0 = 0; t0 < n; t0 += W) { /* the last block's lanes past n read on (padding) */      \
    enum { H = W / NV };                                                                           \
    T s0 = {0}, s1 = {0}, s2 = {0}, s3 = {0}, u0 = {0}, u1 = {0}, u2 = {0}, u3 = {0};              \
    const float *a0 = a[0], *a1 = a[1], *a2 = a[2], *a3 = a[3];                                    \
    for (int c = 0; c < d; c++) {                                                                  \
      T x, y = {0};                                                                                \
      VLOAD(x, xt + (size_t)c * seq + t0);                                                         \
      s0 += a0[c] * x, s1 += a1[c] * x, s2 += a2[c] * x, s3 += a3[c] * x;                          \
      if (NV == 2) {                                                                               \
        VLOAD(y, xt + (size_t)c * seq + t0 + H);                                                   \
        u0 += a0[c] * y, u1 += a1[c] * y, u2 += a2[c] * y, u3 += a3[c] * y;                        \
      }                                                                                            \
    }                                                                                              \
    VSTORE(out + t0, s0), VSTORE(out + (size_t)ostride + t0, s1);                                  \
    VSTORE(out + (size_t)2 * ostride + t0, s2), VSTORE(out + (size_t)3 * ostride + t0, s3);        \
    if (NV == 2) {                                                                                 \
      VSTORE(out + t0 + H, u0), VSTORE(out + (size_t)ostride + t0 + H, u1);                        \
      VSTORE(out + (size_t)2 * ostride + t0 + H, u2), VSTORE(out + (size_t)3 * ostride + t0 + H, u3); \
    }                                                                                              \
  }
ATTN_INLINE void dots_tile(RtVectorPath path, const float *const a[TILE], const float *xt, int seq, int n, int d,
                           float *out, int ostride) {
  if (path == RT_VECTOR_AVX512) DOTS_BLOCKS(vfloat, 1)
  else DOTS_BLOCKS(vhalf, 2)
}
#undef DOTS_BLOCKS

// p[t] = rt_exp(s[t] * scale - sub[t * sub_step]) for t < n (sub_step 0: one value for all).
ATTN_INLINE void scaled_exps(const float *s, float scale, const float *sub, int sub_step, int n, float *p) {
RT_SIMD
  for (int t = 0; t < n; t++) p[t] = rt_exp(s[t] * scale - sub[t * sub_step]);
}

// Row k's weighted sum y[k][c] (+)= sum over j of w[k][j - first[k]] * x[j][c], over the rows
// j = first[k] .. last[k] of x (stride xs) that row k takes, j ascending, for the rows k < nr;
// y[k] starts from 0 (zero) or from what it holds. The TILE rows share the loads of x's rows.
// Rows past nr repeat row nr - 1's pointers and take nothing.
ATTN_INLINE void wsum_tile(RtVectorPath path, const float *const w[TILE], const int first[TILE],
                           const int last[TILE], int nr, const float *x, size_t xs, float *const y[TILE], int d,
                           bool zero) {
  int lo = first[0], hi = last[0], f[TILE], e[TILE], all_f = first[0], all_e = last[0];
  for (int k = 0; k < TILE; k++) {
    f[k] = k < nr ? first[k] : 1;   // an empty range
    e[k] = k < nr ? last[k] : 0;
    lo = f[k] < lo && k < nr ? f[k] : lo;
    hi = e[k] > hi ? e[k] : hi;
  }
  if (nr < TILE) all_f = 1, all_e = 0;   // an empty row: no common range
  for (int k = 0; k < nr; k++) {
    all_f = f[k] > all_f ? f[k] : all_f;
    all_e = e[k] < all_e ? e[k] : all_e;
  }
  int c0 = 0;
  // One block of columns c0 .. c0 + NV * lanes(T) - 1 of the TILE rows in NV (1 or 2) registers
  // of type T each.
#define WSUM_BLOCK(T, NV)                                                                          \
  do {                                                                                             \
    enum { H = (int)(sizeof(T) / sizeof(float)) };                                                 \
    T y0 = {0}, y1 = {0}, y2 = {0}, y3 = {0}, z0 = {0}, z1 = {0}, z2 = {0}, z3 = {0}, xj, xh = {0}; \
    if (!zero) {                                                                                   \
      VLOAD(y0, y[0] + c0), VLOAD(y1, y[1] + c0), VLOAD(y2, y[2] + c0), VLOAD(y3, y[3] + c0);      \
      if (NV == 2)                                                                                 \
        VLOAD(z0, y[0] + c0 + H), VLOAD(z1, y[1] + c0 + H), VLOAD(z2, y[2] + c0 + H), VLOAD(z3, y[3] + c0 + H); \
    }                                                                                              \
    for (int j = lo; j <= hi; j++) {                                                               \
      if (j >= all_f && j <= all_e) { /* every row takes rows all_f .. all_e of x */               \
        for (; j <= all_e; j++) {                                                                  \
          const float *xr = x + (size_t)j * xs + c0;                                               \
          float w0 = w[0][j - f[0]], w1 = w[1][j - f[1]], w2 = w[2][j - f[2]], w3 = w[3][j - f[3]]; \
          VLOAD(xj, xr);                                                                           \
          y0 += w0 * xj, y1 += w1 * xj, y2 += w2 * xj, y3 += w3 * xj;                              \
          if (NV == 2) {                                                                           \
            VLOAD(xh, xr + H);                                                                     \
            z0 += w0 * xh, z1 += w1 * xh, z2 += w2 * xh, z3 += w3 * xh;                            \
          }                                                                                        \
        }                                                                                          \
        j--;                                                                                       \
        continue;                                                                                  \
      }                                                                                            \
      const float *xr = x + (size_t)j * xs + c0;                                                   \
      VLOAD(xj, xr);                                                                               \
      if (NV == 2) VLOAD(xh, xr + H);                                                              \
      if (j >= f[0] && j <= e[0]) y0 += w[0][j - f[0]] * xj, z0 += w[0][j - f[0]] * xh;            \
      if (j >= f[1] && j <= e[1]) y1 += w[1][j - f[1]] * xj, z1 += w[1][j - f[1]] * xh;            \
      if (j >= f[2] && j <= e[2]) y2 += w[2][j - f[2]] * xj, z2 += w[2][j - f[2]] * xh;            \
      if (j >= f[3] && j <= e[3]) y3 += w[3][j - f[3]] * xj, z3 += w[3][j - f[3]] * xh;            \
    }                                                                                              \
    T *all[TILE] = {&y0, &y1, &y2, &y3}, *all_z[TILE] = {&z0, &z1, &z2, &z3};                      \
    for (int k = 0; k < nr; k++) {                                                                 \
      memcpy(y[k] + c0, all[k], sizeof y0);                                                        \
      if (NV == 2) memcpy(y[k] + c0 + H, all_z[k], sizeof z0);                                     \
    }                                                                                              \
    c0 += NV * H;                                                                                  \
  } while (0)
  if (path == RT_VECTOR_AVX512) {
    while (c0 + W <= d) WSUM_BLOCK(vfloat, 1);
  } else {
    while (c0 + W <= d) WSUM_BLOCK(vhalf, 2);
  }
  if (c0 + W / 2 <= d) WSUM_BLOCK(vhalf, 1);
#undef WSUM_BLOCK
  if (c0 < d) {
    int cw = d - c0;
    float acc[TILE][W];
    for (int k = 0; k < TILE; k++)
      for (int l = 0; l < cw; l++) acc[k][l] = zero || k >= nr ? 0.0f : y[k][c0 + l];
    for (int j = lo; j <= hi; j++) {
      const float *xj = x + (size_t)j * xs + c0;
      for (int k = 0; k < nr; k++) {
        if (j < f[k] || j > e[k]) continue;
        float wk = w[k][j - f[k]];
        for (int l = 0; l < cw; l++) acc[k][l] += wk * xj[l];
      }
    }
    for (int k = 0; k < nr; k++) memcpy(y[k] + c0, acc[k], (size_t)cw * sizeof(float));
  }
}

// A row's softmax over its n scores s (unscaled dots): p = exp(s * scale - m), m the maximum of
// s * scale, and l = the sum of p over t ascending; returns m. With an attention sink (gpt-oss:
// a learned logit per head in the denominator, sink > -INFINITY) m is the maximum of the scores
// and the sink, and l ends with exp(sink - m): the sink takes its share of the weight and no
// value.
ATTN_INLINE float row_softmax(const float *s, int n, float scale, float sink, float *p, float *l) {
  float m = -INFINITY;
  for (int t = 0; t < n; t++) {
    float v = s[t] * scale;
    m = v > m ? v : m;
  }
  if (sink > -INFINITY) m = sink > m ? sink : m;
  scaled_exps(s, scale, &m, 0, n, p);
  float sum = 0.0f;
  for (int t = 0; t < n; t++) sum += p[t];
  if (sink > -INFINITY) sum += rt_exp(sink - m);
  *l = sum;
  return m;
}

// A tile of query rows: nr rows i0 .. i0 + nr - 1 of sample b, query head h. Row k sees keys
// first[k] .. last[k] = i0 + k; the tile's keys run from first[0] (the smallest) on.
typedef struct QTile {
  int nr, first[TILE], last[TILE];
  const float *q[TILE];   // the rows' query vectors (a repeated last one fills the tile)
} QTile;

static QTile query_tile(const float *q, int b, int i0, int nr, int h, int seq, int qcols, int d, int window) {
  QTile t = {nr};
  for (int k = 0; k < TILE; k++) {
    int i = i0 + (k < nr ? k : nr - 1);
    t.first[k] = first_key(i, window);
    t.last[k] = i;
    t.q[k] = q + (size_t)(b * seq + i) * qcols + (size_t)h * d;
  }
  return t;
}

// The scores of a query tile against its keys: row k's at s + k * ss, from its first key.
ATTN_INLINE void tile_scores(RtVectorPath path, const QTile *t, const float *const a[TILE], const float *xt, int seq, int d, float *s,
                             int ss) {
  int lo = t->first[0], n = t->last[t->nr - 1] - lo + 1;
  dots_tile(path, a, xt + lo, seq, n, d, s, ss);
  for (int k = 1; k < t->nr; k++)   // row k's scores start at its first key
    if (t->first[k] > lo) memmove(s + (size_t)k * ss, s + (size_t)k * ss + (t->first[k] - lo),
                                  (size_t)(t->last[k] - t->first[k] + 1) * sizeof *s);
}

// The outputs of a query tile for one head: kt the key head's columns of the sample, v0 the
// head's value row of the sample's key 0 (stride kcols), o0 the output of row i0 (stride qcols).
RT_VECTOR_BODY void fwd_tile_body(RtVectorPath path, const QTile *t, const float *kt, const float *v0, float *o0, int seq, int d,
                                  int kcols, int qcols, float scale, float sink, float *s, int ss) {
  float *p[TILE], *y[TILE], l[TILE];
  tile_scores(path, t, t->q, kt, seq, d, s, ss);
  for (int k = 0; k < TILE; k++) {
    p[k] = s + (size_t)(k < t->nr ? k : 0) * ss;
    y[k] = o0 + (size_t)(k < t->nr ? k : 0) * qcols;
  }
  for (int k = 0; k < t->nr; k++) row_softmax(p[k], t->last[k] - t->first[k] + 1, scale, sink, p[k], &l[k]);
  wsum_tile(path, (const float *const *)p, t->first, t->last, t->nr, v0, kcols, y, d, true);
  for (int k = 0; k < t->nr; k++) {
    float *yk = y[k], lk = l[k];
RT_SIMD
    for (int c = 0; c < d; c++) yk[c] /= lk;
  }
}
RT_VECTOR_PATHS_P(fwd_tile, (const QTile *t, const float *kt, const float *v0, float *o0, int seq, int d, int kcols,
                           int qcols, float scale, float sink, float *s, int ss),
                (t, kt, v0, o0, seq, d, kcols, qcols, scale, sink, s, ss))

// The tiles of query rows of every sample, TILE rows each (the last of a sample fewer), dealt
// round robin over the threads (the later rows of a sample see more keys).
#define ATTN_TILES(samples, seq) ((samples) * (((seq) + TILE - 1) / TILE))
#ifdef _OPENMP
#define ATTN_PARALLEL_TILES RT_PRAGMA(omp parallel for schedule(static, 1) if ((int64_t)rows * seq * qcols >= 32 * RT_PAR_MIN))
#else
#define ATTN_PARALLEL_TILES
#endif

// sinks: NULL, or one logit per head (attn.sink).
static void attn_fwd(const float *q, const float *k, const float *v, const float *sinks, float *o, int rows, int seq,
                     int heads, int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, per = (seq + TILE - 1) / TILE, ss = seq + W;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *scratch = attn_alloc((size_t)rt_threads() * TILE * ss);
  ATTN_PARALLEL_TILES
  for (int x = 0; x < ATTN_TILES(rows / seq, seq); x++) {
    float *s = scratch + (size_t)rt_thread_id() * TILE * ss;
    int b = x / per, i0 = x % per * TILE, nr = seq - i0 < TILE ? seq - i0 : TILE;
    for (int h = 0; h < heads; h++) {
      int j = h / group;
      QTile t = query_tile(q, b, i0, nr, h, seq, qcols, d, window);
      fwd_tile(&t, kt + ((size_t)b * kv + j) * d * seq, v + (size_t)b * seq * kcols + (size_t)j * d,
               o + (size_t)(b * seq + i0) * qcols + (size_t)h * d, seq, d, kcols, qcols, scale, sinks ? sinks[h] : -INFINITY, s, ss);
    }
  }
  free(kt);
  free(scratch);
}

// --profile's attention time (rt_attn_ns_add): a kernel's whole call, when profiling.
#define ATTN_TIMED(call)                                                                   \
  do {                                                                                     \
    int64_t t0_ = rt_gemm_profiling() ? rt_mono_ns() : 0;                                  \
    call;                                                                                  \
    if (t0_) rt_attn_ns_add(rt_mono_ns() - t0_);                                           \
  } while (0)

void rt_attn_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq, int heads, int kv,
                 int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_fwd(q, k, v, NULL, o, rows, seq, heads, kv, qcols, window, qk_scale));
}

void rt_attn_sink_fwd(const float *q, const float *k, const float *v, const float *sinks, float *o, int rows, int seq,
                      int heads, int kv, int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_fwd(q, k, v, sinks, o, rows, seq, heads, kv, qcols, window, qk_scale));
}

RT_VECTOR_BODY void lse_tile_body(RtVectorPath path, const QTile *t, const float *kt, float *lse, int seq, int d, float scale,
                                  float sink, float *s, int ss, int lse_stride) {
  tile_scores(path, t, t->q, kt, seq, d, s, ss);
  for (int k = 0; k < t->nr; k++) {
    float l, *row = s + (size_t)k * ss;
    float m = row_softmax(row, t->last[k] - t->first[k] + 1, scale, sink, row, &l);
    lse[(size_t)k * lse_stride] = m + logf(l);
  }
}
RT_VECTOR_PATHS_P(lse_tile, (const QTile *t, const float *kt, float *lse, int seq, int d, float scale, float sink, float *s,
                           int ss, int lse_stride),
                (t, kt, lse, seq, d, scale, sink, s, ss, lse_stride))

static void attn_stats(const float *dy, const float *q, const float *k, const float *o, const float *sinks, float *stats,
                       int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, per = (seq + TILE - 1) / TILE, ss = seq + W;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *scratch = attn_alloc((size_t)rt_threads() * TILE * ss);
  ATTN_PARALLEL_TILES
  for (int x = 0; x < ATTN_TILES(rows / seq, seq); x++) {
    float *s = scratch + (size_t)rt_thread_id() * TILE * ss;
    int b = x / per, i0 = x % per * TILE, nr = seq - i0 < TILE ? seq - i0 : TILE;
    for (int h = 0; h < heads; h++) {
      QTile t = query_tile(q, b, i0, nr, h, seq, qcols, d, window);
      lse_tile(&t, kt + ((size_t)b * kv + h / group) * d * seq, stats + (size_t)(b * seq + i0) * 2 * heads + h, seq,
               d, scale, sinks ? sinks[h] : -INFINITY, s, ss, 2 * heads);
      for (int r = b * seq + i0; r < b * seq + i0 + nr; r++) {
        size_t at = (size_t)r * qcols + (size_t)h * d;
        stats[(size_t)r * 2 * heads + heads + h] = dot(dy + at, o + at, d);
      }
    }
  }
  free(kt);
  free(scratch);
}

void rt_attn_stats(const float *dy, const float *q, const float *k, const float *o, float *stats, int rows, int seq,
                   int heads, int kv, int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_stats(dy, q, k, o, NULL, stats, rows, seq, heads, kv, qcols, window, qk_scale));
}

// The statistics with the sinks in each row's logsumexp: the backward kernels then give the
// sink attention's dq, dk and dv (p_ij = exp(s_ij - lse_i) are its weights; the sink has no value).
void rt_attn_sink_stats(const float *dy, const float *q, const float *k, const float *o, const float *sinks, float *stats,
                        int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_stats(dy, q, k, o, sinks, stats, rows, seq, heads, kv, qcols, window, qk_scale));
}

// The sinks' gradient: each sink is a logit of every row's softmax with no value, so
// d sink_h = sum over rows r of p_sink (0 - D_rh) = -sum_r exp(sink_h - lse_rh) D_rh (rows ascending).
void rt_attn_sink_grad(const float *stats, const float *sinks, float *dsinks, int rows, int heads) {
  RT_PARALLEL_FOR((int64_t)rows * heads >= RT_PAR_MIN)
  for (int h = 0; h < heads; h++) {
    float sum = 0.0f;
    for (int r = 0; r < rows; r++)
      sum += rt_exp(sinks[h] - stats[(size_t)r * 2 * heads + h]) * stats[(size_t)r * 2 * heads + heads + h];
    dsinks[h] = -sum;
  }
}

// dq of a query tile for one head: kt, vt its key head's columns of k and v (the sample's),
// k0 the head's key row of the sample's key 0 (stride kcols), dq0 row i0's dq (stride width);
// lse, D the rows' stats (stride 2 heads).
RT_VECTOR_BODY void grad_q_tile_body(RtVectorPath path, const QTile *t, const float *dy0, const float *kt, const float *vt,
                                     const float *k0, const float *lse, const float *D, float *dq0, int seq,
                                     int d, int kcols, int qcols, int width, int stats_stride, float scale,
                                     float *s, float *u, int ss) {
  const float *dy[TILE];
  float *w[TILE], *y[TILE];
  for (int k = 0; k < TILE; k++) {
    int kk = k < t->nr ? k : t->nr - 1;
    dy[k] = dy0 + (size_t)kk * qcols;
    w[k] = s + (size_t)kk * ss;
    y[k] = dq0 + (size_t)kk * width;
  }
  tile_scores(path, t, t->q, kt, seq, d, s, ss);
  tile_scores(path, t, dy, vt, seq, d, u, ss);
  for (int k = 0; k < t->nr; k++) {
    int n = t->last[k] - t->first[k] + 1;
    float *sk = s + (size_t)k * ss, *uk = u + (size_t)k * ss, Dk = D[(size_t)k * stats_stride];
    scaled_exps(sk, scale, lse + (size_t)k * stats_stride, 0, n, sk);   // sk: p
RT_SIMD
    for (int x = 0; x < n; x++) sk[x] = sk[x] * (uk[x] - Dk);
  }
  wsum_tile(path, (const float *const *)w, t->first, t->last, t->nr, k0, kcols, y, d, true);
  for (int k = 0; k < t->nr; k++) {
    float *yk = y[k];
RT_SIMD
    for (int c = 0; c < d; c++) yk[c] *= scale;
  }
}
RT_VECTOR_PATHS_P(grad_q_tile, (const QTile *t, const float *dy0, const float *kt, const float *vt, const float *k0,
                              const float *lse, const float *D, float *dq0, int seq, int d, int kcols, int qcols,
                              int width, int stats_stride, float scale, float *s, float *u, int ss),
                (t, dy0, kt, vt, k0, lse, D, dq0, seq, d, kcols, qcols, width, stats_stride, scale, s, u, ss))

static void attn_grad_q_body(const float *dy, const float *q, const float *k, const float *v, const float *stats,
                             float *dqkv, int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  int per = (seq + TILE - 1) / TILE, ss = seq + W;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  float *kt = transpose_heads(k, rows, seq, kv, d), *vt = transpose_heads(v, rows, seq, kv, d);
  float *scratch = attn_alloc((size_t)rt_threads() * 2 * TILE * ss);
  ATTN_PARALLEL_TILES
  for (int x = 0; x < ATTN_TILES(rows / seq, seq); x++) {
    float *s = scratch + (size_t)rt_thread_id() * 2 * TILE * ss, *u = s + (size_t)TILE * ss;
    int b = x / per, i0 = x % per * TILE, nr = seq - i0 < TILE ? seq - i0 : TILE, r0 = b * seq + i0;
    for (int h = 0; h < heads; h++) {
      int j = h / group;
      size_t col = ((size_t)b * kv + j) * d * seq;
      QTile t = query_tile(q, b, i0, nr, h, seq, qcols, d, window);
      const float *st = stats + (size_t)r0 * 2 * heads;
      grad_q_tile(&t, dy + (size_t)r0 * qcols + (size_t)h * d, kt + col, vt + col,
                  k + (size_t)b * seq * kcols + (size_t)j * d, st + h, st + heads + h,
                  dqkv + (size_t)r0 * width + (size_t)h * d, seq, d, kcols, qcols, width, 2 * heads, scale, s, u, ss);
    }
  }
  free(kt);
  free(vt);
  free(scratch);
}

void rt_attn_grad_q(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                    int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_grad_q_body(dy, q, k, v, stats, dqkv, rows, seq, heads, kv, qcols, window, qk_scale));
}

// dk, dv of a tile of keys t0 .. t0 + nr - 1 (of one sample) from one query head: key k takes
// queries first[k] = t0 + k .. last[k] (its causal, windowed range). kr, vr the keys' rows (of
// the kv head; stride kcols), qt, dyt the query head's columns of q and dO (the sample's), q0,
// dy0 the head's row of the sample's query 0 (stride qcols), lse, D the sample's stats of the
// head (stride stats_stride), dk0, dv0 the tile's first dk, dv (stride width), accumulated.
RT_VECTOR_BODY void grad_kv_tile_body(RtVectorPath path, int nr, const int first[TILE], const int last[TILE], const float *kr,
                                      const float *vr, const float *qt, const float *dyt, const float *q0,
                                      const float *dy0, const float *lse, const float *D, int stats_stride,
                                      float *dk0, float *dv0, int seq, int d, int kcols, int qcols, int width,
                                      float scale, float *s, float *u, int ss) {
  const float *ka[TILE], *va[TILE];
  float *p[TILE], *w[TILE], *dk[TILE], *dv[TILE];
  for (int k = 0; k < TILE; k++) {
    int kk = k < nr ? k : nr - 1;
    ka[k] = kr + (size_t)kk * kcols;
    va[k] = vr + (size_t)kk * kcols;
    p[k] = s + (size_t)kk * ss;
    w[k] = u + (size_t)kk * ss;
    dk[k] = dk0 + (size_t)kk * width;
    dv[k] = dv0 + (size_t)kk * width;
  }
  int lo = first[0], n = last[nr - 1] - lo + 1;
  dots_tile(path, ka, qt + lo, seq, n, d, s, ss);
  dots_tile(path, va, dyt + lo, seq, n, d, u, ss);
  for (int k = 0; k < nr; k++) {
    int off = first[k] - lo, m = last[k] - first[k] + 1;
    float *sk = s + (size_t)k * ss + off, *uk = u + (size_t)k * ss + off;
    const float *lk = lse + (size_t)first[k] * stats_stride, *Dk = D + (size_t)first[k] * stats_stride;
RT_SIMD
    for (int x = 0; x < m; x++) {
      float e = rt_exp(sk[x] * scale - lk[(size_t)x * stats_stride]);
      uk[x] = e * (uk[x] - Dk[(size_t)x * stats_stride]);
      sk[x] = e;
    }
    p[k] += off;   // from the key's first query on
    w[k] += off;
  }
  wsum_tile(path, (const float *const *)w, first, last, nr, q0, qcols, dk, d, false);
  wsum_tile(path, (const float *const *)p, first, last, nr, dy0, qcols, dv, d, false);
}
RT_VECTOR_PATHS_P(grad_kv_tile, (int nr, const int first[TILE], const int last[TILE], const float *kr, const float *vr,
                               const float *qt, const float *dyt, const float *q0, const float *dy0, const float *lse,
                               const float *D, int stats_stride, float *dk0, float *dv0, int seq, int d, int kcols,
                               int qcols, int width, float scale, float *s, float *u, int ss),
                (nr, first, last, kr, vr, qt, dyt, q0, dy0, lse, D, stats_stride, dk0, dv0, seq, d, kcols, qcols,
                 width, scale, s, u, ss))

static void attn_grad_kv_body(const float *dy, const float *q, const float *k, const float *v, const float *stats,
                              float *dqkv, int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  int per = (seq + TILE - 1) / TILE, ss = seq + W;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  float *qt = transpose_heads(q, rows, seq, heads, d), *dyt = transpose_heads(dy, rows, seq, heads, d);
  float *scratch = attn_alloc((size_t)rt_threads() * 2 * TILE * ss);
  ATTN_PARALLEL_TILES
  for (int x = 0; x < ATTN_TILES(rows / seq, seq); x++) {
    float *s = scratch + (size_t)rt_thread_id() * 2 * TILE * ss, *u = s + (size_t)TILE * ss;
    int b = x / per, t0 = x % per * TILE, nr = seq - t0 < TILE ? seq - t0 : TILE, r0 = b * seq + t0;
    int first[TILE], last[TILE];
    for (int k = 0; k < TILE; k++) {   // key t0 + k takes queries t0 + k .. + n - 1
      int t = t0 + (k < nr ? k : nr - 1), n = window > 0 && window < seq - t ? window : seq - t;
      first[k] = t;
      last[k] = t + n - 1;
    }
    for (int j = 0; j < kv; j++) {
      float *dk0 = dqkv + (size_t)r0 * width + qcols + (size_t)j * d, *dv0 = dk0 + kcols;
      for (int kk = 0; kk < nr; kk++) {
        memset(dk0 + (size_t)kk * width, 0, (size_t)d * sizeof *dk0);
        memset(dv0 + (size_t)kk * width, 0, (size_t)d * sizeof *dv0);
      }
      for (int h = j * group; h < (j + 1) * group; h++) {
        size_t col = ((size_t)b * heads + h) * d * seq;
        grad_kv_tile(nr, first, last, k + (size_t)r0 * kcols + (size_t)j * d, v + (size_t)r0 * kcols + (size_t)j * d,
                     qt + col, dyt + col, q + (size_t)b * seq * qcols + (size_t)h * d,
                     dy + (size_t)b * seq * qcols + (size_t)h * d, stats + (size_t)b * seq * 2 * heads + h,
                     stats + (size_t)b * seq * 2 * heads + heads + h, 2 * heads, dk0, dv0, seq, d, kcols, qcols,
                     width, scale, s, u, ss);
      }
      for (int kk = 0; kk < nr; kk++)
        for (int c = 0; c < d; c++) dk0[(size_t)kk * width + c] *= scale;
    }
  }
  free(qt);
  free(dyt);
  free(scratch);
}

void rt_attn_grad_kv(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                     int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  ATTN_TIMED(attn_grad_kv_body(dy, q, k, v, stats, dqkv, rows, seq, heads, kv, qcols, window, qk_scale));
}

void rt_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  for (int r = 0; r < rows; r++)
    memcpy(y + (size_t)r * width, x + (size_t)r * cols + offset, (size_t)width * sizeof *y);
}

// ---- MLA's parts of heads (manual §7.2 `mla`) ----
// Row r of x [rows, heads*d]; each output element is one input element (or 0, or a sum over the
// heads in head order): the same bits on any number of threads.
void rt_heads_slice(const float *x, float *y, int rows, int cols, int heads, int offset, int width) {
  int d = cols / heads;
  RT_PARALLEL_FOR((int64_t)rows * cols >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++)
      memcpy(y + ((size_t)r * heads + h) * width, x + (size_t)r * cols + (size_t)h * d + offset, (size_t)width * sizeof *y);
}

void rt_heads_place(const float *x, float *y, int rows, int heads, int offset, int width, int d) {
  RT_PARALLEL_FOR((int64_t)rows * heads * d >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      float *yh = y + ((size_t)r * heads + h) * d;
      for (int c = 0; c < d; c++)
        yh[c] = c >= offset && c < offset + width ? x[((size_t)r * heads + h) * width + (c - offset)] : 0.0f;
    }
}

void rt_heads_cat(const float *a, const float *b, float *y, int rows, int cols_a, int cols_b, int heads, int a_heads) {
  int wa = cols_a / a_heads, wb = cols_b / heads;
  RT_PARALLEL_FOR((int64_t)rows * (cols_b + (int64_t)heads * wa) >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      float *yh = y + ((size_t)r * heads + h) * (wa + wb);
      memcpy(yh, a + (size_t)r * cols_a + (size_t)(a_heads == 1 ? 0 : h) * wa, (size_t)wa * sizeof *y);
      memcpy(yh + wa, b + (size_t)r * cols_b + (size_t)h * wb, (size_t)wb * sizeof *y);
    }
}

void rt_heads_sum(const float *x, float *y, int rows, int cols, int heads) {
  int w = cols / heads;
  RT_PARALLEL_FOR((int64_t)rows * cols >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < w; c++) {
      float s = 0.0f;
      for (int h = 0; h < heads; h++) s += x[(size_t)r * cols + (size_t)h * w + c];
      y[(size_t)r * w + c] = s;
    }
}
