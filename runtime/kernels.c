// The CPU kernels of libmoert: plain C loops on row-major float32, GEMMs through OpenBLAS.
//
// Each kernel is the exact semantics of DESIGN §2 and nothing more: the generated program
// strings them together, and the CUDA kernels and the numpy reference are checked against
// them. Every kernel writes its whole result (results are SSA values in the IR), except
// rt_matmul with accumulate, which adds into C. Reductions that feed a loss or a parameter
// gradient (softmax sums, dot products, bias gradients, losses) accumulate in double so that
// the result does not depend much on the length of the reduction.
//
// Routing groups: a rank's s tokens are split into g groups in order, group gi holding tokens
// [gi*s/g, (gi+1)*s/g) (equal groups of s/g when g divides s, as the compiler guarantees).
// Capacity, locations and the aux and z losses are per group; dispatch slot gi*cap + loc of an
// expert belongs to group gi.
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moert.h"
#include "rt_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static int group_begin(int s, int g, int gi) { return (int)((int64_t)s * gi / g); }

// ---- dense algebra ----

static bool gemm_profile;
static _Atomic int64_t gemm_ns;

void rt_gemm_profile(bool on) { gemm_profile = on; }

int64_t rt_gemm_ns_take(void) { return atomic_exchange(&gemm_ns, 0); }

static int64_t mono_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

// MOERT_ALL_SLOTS=1: the expert GEMMs and the GELU gradient compute every slot, filled or not
// (the worst-case buffers; bench/cpu.sh compares the two).
static bool all_slots(void) {
  static int all = -1;
  if (all < 0) {
    const char *env = getenv("MOERT_ALL_SLOTS");
    all = env && strcmp(env, "1") == 0;
  }
  return all;
}

void rt_matmul(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb,
               bool accumulate) {
  if (m <= 0 || n <= 0)
    return;
  if (k <= 0) {
    if (!accumulate)
      memset(c, 0, (size_t)m * n * sizeof *c);
    return;
  }
  int lda = ta ? m : k;   // A stored [k,m] when transposed, else [m,k]
  int ldb = tb ? k : n;   // B stored [n,k] when transposed, else [k,n]
  int64_t t0 = gemm_profile ? mono_ns() : 0;
  cblas_sgemm(CblasRowMajor, ta ? CblasTrans : CblasNoTrans, tb ? CblasTrans : CblasNoTrans, m, n,
              k, 1.0f, a, lda, b, ldb, accumulate ? 1.0f : 0.0f, c, n);
  if (gemm_profile)
    atomic_fetch_add(&gemm_ns, mono_ns() - t0);
}

// Expert GEMMs skip the slots nobody filled. An expert's buffer holds rows (slots) of which only
// those the routing filled carry tokens (capacity padding, a dropless layer's worst-case buffer,
// the peers' runs after the EP layouts); the empty ones are zero rows, or after a bias and an
// activation copies of one row (act(b1)). Zero rows contribute exactly zero, and equal rows
// have equal products, so each expert's GEMM runs on segments of the rows that are neither
// (gaps shorter than SEG_GAP rows merged into a segment): MegaBlocks' grouped GEMMs over the
// tokens each expert received, found here from the data. Over the slot dimension:
//   ta = 0 (c[m, n] = a[m, k] b, rows of a are slots): c's rows from one GEMM per segment; a zero
//     row of a outside them gives a zero row (what the GEMM gives), a row equal to the one
//     before it a copy of that row's result;
//   ta = 1 (c[m, n] = a^T b with a [k, m] and b [k, n], the k rows are slots): a slot whose row
//     of a or of b is zero adds nothing; the segments' products are summed, the first written,
//     the rest accumulated (so the sum's rounding follows the segments, not one k loop).
// The result equals the whole-buffer GEMM up to rounding. The CUDA target's fake device runs
// this same function, so the two agree to the bit there (cuBLAS on a GPU multiplies the whole
// buffers). (A zero row against an Inf or NaN
// weight gives 0 here where a whole GEMM gives NaN.)
enum { SEG_GAP = 8, SEG_MAX = 64 };

static bool row_zero(const float *row, int n) {
  for (int i = 0; i < n; i++)
    if (row[i] != 0.0f) return false;
  return true;
}

// What each slot row is (the kinds of row_kinds): zero, a copy of the row before, or live.
enum { ROW_ZERO, ROW_DUP, ROW_LIVE };

// kind[r] for rows 0..rows-1 of x (width nx), in blocks of `block` rows (an expert's):
// ROW_ZERO, ROW_DUP (equal to row r - 1 of the same block, when dup), else ROW_LIVE; with y
// (width ny), a row whose row of y is zero is ROW_ZERO too. Rows are independent: classified
// in parallel.
static void row_kinds(const float *x, int nx, bool dup, const float *y, int ny, int64_t rows, int block,
                      unsigned char *kind) {
  RT_PARALLEL_FOR(rows * (nx + ny) >= RT_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const float *row = x + r * nx;
    if (row_zero(row, nx) || (y && row_zero(y + r * ny, ny))) kind[r] = ROW_ZERO;
    else if (dup && r % block != 0 && memcmp(row, row - nx, (size_t)nx * sizeof *row) == 0) kind[r] = ROW_DUP;
    else kind[r] = ROW_LIVE;
  }
}

// The segments [seg[2j], seg[2j+1]) of rows 0..rows-1 holding every live row (gaps shorter
// than SEG_GAP rows merged in); returns their number (at most SEG_MAX: past it the last
// segment runs on).
static int live_segments(const unsigned char *kind, int rows, int *seg) {
  int count = 0, gap = 0;
  for (int r = 0; r < rows; r++) {
    if (kind[r] != ROW_LIVE) {
      gap++;
      continue;
    }
    if (count > 0 && (gap < SEG_GAP || count == SEG_MAX)) {
      seg[2 * count - 1] = r + 1;   // extend the last segment over the short gap
    } else {
      seg[2 * count] = r;
      seg[2 * count + 1] = r + 1;
      count++;
    }
    gap = 0;
  }
  return count;
}

void rt_expert_matmul(const float *a, const float *b, float *c, int e, int m, int n, int k,
                      bool ta, bool tb) {
  size_t a_size = (size_t)m * k, b_size = (size_t)k * n, c_size = (size_t)m * n;
  if (all_slots() || (ta && tb)) {   // every slot asked for, or no such expert GEMM: the whole buffers
    for (int i = 0; i < e; i++) rt_matmul(a + i * a_size, b + i * b_size, c + i * c_size, m, n, k, ta, tb, false);
    return;
  }
  int rows = ta ? k : m;   // the slot dimension
  unsigned char *kind = rt_alloc((size_t)e * rows, "the expert GEMMs' row kinds");
  int *src = ta ? NULL : rt_alloc((size_t)e * rows * sizeof *src, "the expert GEMMs' row sources");
  if (!ta) row_kinds(a, k, true, NULL, 0, (int64_t)e * rows, rows, kind);
  else row_kinds(a, m, false, b, n, (int64_t)e * rows, rows, kind);
  int seg[2 * SEG_MAX];
  for (int i = 0; i < e; i++) {
    const float *ai = a + i * a_size, *bi = b + i * b_size;
    float *ci = c + i * c_size;
    const unsigned char *ki = kind + (size_t)i * rows;
    int ns = live_segments(ki, rows, seg);
    if (!ta) {   // rows of a (and c) are slots
      for (int j = 0; j < ns; j++)
        rt_matmul(ai + (size_t)seg[2 * j] * k, bi, ci + (size_t)seg[2 * j] * n, seg[2 * j + 1] - seg[2 * j], n, k,
                  false, tb, false);
      // Each row outside the segments: -1 (zero) or the last computed row before it, which a
      // copied row's chain of equal rows starts from (its first row is live, so computed).
      int *si = src + (size_t)i * rows;
      for (int j = 0, last = -1, r = 0; r < m; r++) {
        while (j < ns && seg[2 * j + 1] <= r) j++;
        if (j < ns && seg[2 * j] <= r) {
          si[r] = r;
          last = r;
        } else {
          si[r] = ki[r] == ROW_ZERO ? -1 : last;
        }
      }
    } else {   // a [k, m], b [k, n]: the k rows of both are slots
      if (ns == 0) memset(ci, 0, c_size * sizeof *ci);
      for (int j = 0; j < ns; j++)
        rt_matmul(ai + (size_t)seg[2 * j] * m, bi + (size_t)seg[2 * j] * n, ci, m, n, seg[2 * j + 1] - seg[2 * j], true,
                  false, j > 0);
    }
  }
  if (!ta) {   // fill the rows outside the segments, all experts' at once
    int64_t all = (int64_t)e * m;
    RT_PARALLEL_FOR(all * n >= RT_PAR_MIN)
    for (int64_t r = 0; r < all; r++) {
      int64_t from = src[r] < 0 ? -1 : (r / m) * m + src[r];
      float *cr = c + r * n;
      if (from == r) continue;
      if (from < 0) memset(cr, 0, (size_t)n * sizeof *cr);
      else memcpy(cr, c + from * n, (size_t)n * sizeof *cr);
    }
  }
  free(kind);
  free(src);
}

void rt_bias(const float *x, const float *b, float *y, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)rows * n >= RT_PAR_MIN)
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    float *yr = y + (size_t)r * n;
    RT_SIMD
    for (int i = 0; i < n; i++)
      yr[i] = xr[i] + b[i];
  }
}

// Column sums in double, a block of columns at a time so the rows are read contiguously and no
// scratch memory is needed.
void rt_bias_grad(const float *dy, float *db, int rows, int n) {
  enum { BLOCK = 128 };
  int nblocks = (n + BLOCK - 1) / BLOCK;
  RT_PARALLEL_FOR(nblocks > 1 && (int64_t)rows * n >= RT_PAR_MIN)
  for (int bi = 0; bi < nblocks; bi++) {   // a block of columns per iteration: one thread sums a column
    double acc[BLOCK];
    int c0 = bi * BLOCK, width = n - c0 < BLOCK ? n - c0 : BLOCK;
    for (int i = 0; i < width; i++)
      acc[i] = 0.0;
    for (int r = 0; r < rows; r++) {
      const float *dr = dy + (size_t)r * n + c0;
      RT_SIMD
      for (int i = 0; i < width; i++)
        acc[i] += dr[i];
    }
    for (int i = 0; i < width; i++)
      db[c0 + i] = (float)acc[i];
  }
}

void rt_expert_bias(const float *x, const float *b, float *y, int e, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)e * rows * n >= RT_PAR_MIN)
  for (int64_t r = 0; r < (int64_t)e * rows; r++) {   // row r of expert r / rows
    const float *xr = x + r * n, *br = b + (r / rows) * n;
    float *yr = y + r * n;
    RT_SIMD
    for (int i = 0; i < n; i++)
      yr[i] = xr[i] + br[i];
  }
}

void rt_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) {
  size_t block = (size_t)rows * n;
  for (int i = 0; i < e; i++)
    rt_bias_grad(dy + i * block, db + (size_t)i * n, rows, n);
}

void rt_add(const float *a, const float *b, float *y, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    y[i] = a[i] + b[i];
}

// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as the same function
// x * s with s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) with rt_exp (vectorised; no cancellation
// in 1 + tanh(u) where u is very negative).
#define GELU_C 0.7978845608028654f
#define GELU_A 0.044715f

static inline float gelu_s(float v) { return 1.0f / (1.0f + rt_exp(-2.0f * GELU_C * (v + GELU_A * v * v * v))); }

// Rows (of cols elements) equal to the row before, as an expert's empty slots are after its
// bias (copies of b1), are copied from that row's result instead of computed again: the same
// bits. Each thread takes a contiguous block of rows and copies only from rows of its own block,
// which it has computed already.
RT_VECTOR_CLONES static void gelu_rows(const float *x, float *y, int64_t lo, int64_t hi, int64_t cols) {
  for (int64_t r = lo; r < hi; r++) {
    const float *xr = x + r * cols;
    float *yr = y + r * cols;
    if (r > lo && memcmp(xr, xr - cols, (size_t)cols * sizeof *xr) == 0) {
      memcpy(yr, yr - cols, (size_t)cols * sizeof *yr);
      continue;
    }
RT_SIMD
    for (int64_t i = 0; i < cols; i++)
      yr[i] = xr[i] * gelu_s(xr[i]);
  }
}

void rt_gelu(const float *x, float *y, int64_t n, int64_t cols) {
  if (cols <= 0 || n % cols != 0) cols = n;   // no row structure: one row
  if (n <= 0) return;
  int64_t rows = n / cols;
#ifdef _OPENMP
  if (n >= RT_PAR_MIN / 8 && rows > 1) {
#pragma omp parallel
    {
      int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      gelu_rows(x, y, rows * t / nt, rows * (t + 1) / nt, cols);
    }
    return;
  }
#endif
  gelu_rows(x, y, 0, rows, cols);
}

// d gelu/dx = s + 2 x s (1 - s) u', u' = sqrt(2/pi) (1 + 3*0.044715 x^2) (the tanh form's
// 0.5 (1 + t) + 0.5 x (1 - t^2) u' with t = 2s - 1). Where dy is zero (an expert's empty slots)
// dx is +0 (the product's sign of zero is not kept: nothing downstream, sums and GEMMs starting
// from +0, can tell).
RT_VECTOR_CLONES static void gelu_grad_range(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi,
                                             bool skip) {
RT_SIMD
  for (int64_t i = lo; i < hi; i++) {
    float v = x[i], s = gelu_s(v);
    float du = GELU_C * (1.0f + 3.0f * GELU_A * v * v);
    float g = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du);
    dx[i] = skip && dy[i] == 0.0f ? 0.0f : g;
  }
}

void rt_gelu_grad(const float *dy, const float *x, float *dx, int64_t n) {
  bool skip = !all_slots();
#ifdef _OPENMP
  if (n >= RT_PAR_MIN / 8) {
#pragma omp parallel
    {
      int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
      gelu_grad_range(dy, x, dx, n * t / nt, n * (t + 1) / nt, skip);
    }
    return;
  }
#endif
  gelu_grad_range(dy, x, dx, 0, n, skip);
}

void rt_relu(const float *x, float *y, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void rt_relu_grad(const float *dy, const float *x, float *dx, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// ---- gate chain ----

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
// ties to the lower index. NaN ranks as -inf so a row always yields k distinct experts.
void rt_topk(const float *scores, int32_t *idx, int s, int e, int k) {
  for (int t = 0; t < s; t++) {
    const float *row = scores + (size_t)t * e;
    int32_t *out = idx + (size_t)t * k;
    float prev_v = INFINITY;
    int prev_i = -1;
    for (int j = 0; j < k; j++) {
      int best = -1;
      float best_v = -INFINITY;
      for (int i = 0; i < e; i++) {
        float v = isnan(row[i]) ? -INFINITY : row[i];
        bool after_prev = v < prev_v || (v == prev_v && i > prev_i);
        if (after_prev && (best < 0 || v > best_v)) {
          best = i;
          best_v = v;
        }
      }
      out[j] = best;
      prev_v = best_v;
      prev_i = best;
    }
  }
}

void rt_gate_gather(const float *scores, const int32_t *idx, float *gates, int s, int e, int k,
                    int renorm) {
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
  }
}

// Without renorm: dscores[idx_j] = dgates_j. With renorm, g_j = p_j / P (P = sum of the chosen
// scores): dL/dp_i = (dgates_i - sum_j dgates_j g_j) / P.
void rt_gate_gather_grad(const float *dgates, const float *scores, const int32_t *idx,
                         float *dscores, int s, int e, int k, int renorm) {
  memset(dscores, 0, (size_t)s * e * sizeof *dscores);
  for (int t = 0; t < s; t++) {
    const float *row = scores + (size_t)t * e;
    const int32_t *ir = idx + (size_t)t * k;
    const float *dg = dgates + (size_t)t * k;
    float *dr = dscores + (size_t)t * e;
    if (!renorm) {
      for (int j = 0; j < k; j++)
        dr[ir[j]] += dg[j];
      continue;
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++)
      sum += row[ir[j]];
    if (!(sum > 0.0))
      continue;
    double dot = 0.0;
    for (int j = 0; j < k; j++)
      dot += (double)dg[j] * (row[ir[j]] / sum);
    for (int j = 0; j < k; j++)
      dr[ir[j]] += (float)((dg[j] - dot) / sum);
  }
}

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

void rt_order_encode(const float *x, const int32_t *idx, const int32_t *loc, float *disp, int s,
                     int m, int k, int e, int g, int cap) {
  if (g < 1)
    g = 1;
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
}

void rt_order_encode_grad(const float *ddisp, const int32_t *idx, const int32_t *loc, float *dx,
                          int s, int m, int k, int e, int g, int cap) {
  if (g < 1)
    g = 1;
  memset(dx, 0, (size_t)s * m * sizeof *dx);
  for (int gi = 0; gi < g; gi++) {
    int t0 = group_begin(s, g, gi), t1 = group_begin(s, g, gi + 1);
    RT_PARALLEL_FOR((int64_t)(t1 - t0) * k * m >= RT_PAR_MIN)
    for (int t = t0; t < t1; t++) {
      float *dr = dx + (size_t)t * m;
      for (int j = 0; j < k; j++) {
        size_t c = (size_t)t * k + j;
        if (!kept(loc, c, cap))
          continue;
        const float *src = ddisp + slot_offset(idx, loc, c, gi, cap, g, m);
        RT_SIMD
        for (int i = 0; i < m; i++)
          dr[i] += src[i];
      }
    }
  }
}

void rt_order_decode(const float *y, const int32_t *idx, const int32_t *loc, const float *gates,
                     float *out, int s, int m, int k, int e, int g, int cap) {
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
        const float *src = y + slot_offset(idx, loc, c, gi, cap, g, m);
        float w = gates[c];
        RT_SIMD
        for (int i = 0; i < m; i++)
          dst[i] += w * src[i];
      }
    }
  }
}

void rt_order_decode_grad_y(const float *dout, const int32_t *idx, const int32_t *loc,
                            const float *gates, float *dy, int s, int m, int k, int e, int g,
                            int cap) {
  if (g < 1)
    g = 1;
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
          dst[i] += w * dr[i];
      }
    }
  }
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

// ---- losses ----

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

// ---- optimizers ----

void rt_sgd(float *p, const float *g, int64_t n, float lr, float weight_decay, float lr_scale, float grad_scale) {
  lr *= lr_scale;
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    p[i] -= lr * (g[i] * grad_scale + weight_decay * p[i]);
}

void rt_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
              float beta2, float eps, float weight_decay, int64_t step, float lr_scale, float grad_scale) {
  float bc1 = (float)(1.0 - pow(beta1, (double)step));
  float bc2 = (float)(1.0 - pow(beta2, (double)step));
  lr *= lr_scale;
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * grad_scale;
    m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
    v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);
  }
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
