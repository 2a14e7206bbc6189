// The feed-forward kernels of libmoert, dense layers and experts alike: GEMMs through OpenBLAS
// (rt_matmul; rt_expert_matmul over an expert's filled slots only), biases and their gradients,
// and the activations GELU, ReLU, SiLU, squared ReLU and gpt-oss's clamped SwiGLU. The siblings of codegen/cuda/ffn.cu (whose GEMMs go to
// cuBLAS). Conventions of every CPU kernel: runtime/kernels.def.
#include <cblas.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moert.h"
#include "rt_fused.h"
#include "rt_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

// ---- GEMMs and biases ----

static bool gemm_profile;
static _Atomic int64_t gemm_ns, attn_ns;

void rt_gemm_profile(bool on) { gemm_profile = on; }
bool rt_gemm_profiling(void) { return gemm_profile; }

int64_t rt_gemm_ns_take(void) { return atomic_exchange(&gemm_ns, 0); }
int64_t rt_attn_ns_take(void) { return atomic_exchange(&attn_ns, 0); }
void rt_attn_ns_add(int64_t ns) { atomic_fetch_add(&attn_ns, ns); }

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

// GEMMs are split over the pool here (runtime/threads.c says why): pieces of at least SPLIT_MIN
// multiply-accumulates, along c's rows, at multiples of SPLIT_ALIGN rows, one piece per thread.
// With OpenBLAS's Haswell kernels (which Zen runs too) and Prescott's, each row of c then comes
// out with the bits of the whole product: they block c's rows (the columns of their column-major
// view) from the start of the call, 12 and 4 at a time, and compute every element of a block the
// same way whatever follows it, so a cut at a multiple of 12 rows keeps every block (4 or 8 do
// not; 12 and not a coarser multiple, so that 2 threads share a 512-row product 252:260 rather
// than 240:272). Along c's columns they do not: Haswell's rounds the first and
// last 8 columns of a call in another order of k, so a column split would change the bits with
// the number of threads (tests/unit/test_kernels.c, test_matmul_split). SkylakeX's kernels
// choose small-matrix and direct kernels by the size of the call (M N K under 10^6, ...), so
// there a piece can round differently from the whole product; OPENBLAS_NUM_THREADS=1 keeps each
// GEMM whole. A call from inside a parallel region runs whole on its thread.
enum { SPLIT_MIN = 1 << 18, SPLIT_ALIGN = 12 };

// How many pieces a GEMM of m x n x k is split into, outside a parallel region.
static int pieces_of(int m, int n, int k) {
  int pieces = rt_gemm_pieces(), units = (m + SPLIT_ALIGN - 1) / SPLIT_ALIGN;
  int64_t work = (int64_t)m * n * k / SPLIT_MIN;
  if (pieces > work) pieces = (int)work;
  if (pieces > units) pieces = units;
  return pieces < 1 ? 1 : pieces;
}

static int gemm_pieces(int m, int n, int k) {
#ifdef _OPENMP
  if (omp_in_parallel()) return 1;
#endif
  return pieces_of(m, n, k);
}

// Rows [*lo, *hi) of piece p of `pieces` over m rows: at multiples of SPLIT_ALIGN, the last to m.
static void piece_rows(int m, int pieces, int p, int *lo, int *hi) {
  int units = (m + SPLIT_ALIGN - 1) / SPLIT_ALIGN;
  *lo = (int)((int64_t)p * units / pieces) * SPLIT_ALIGN;
  *hi = p + 1 == pieces ? m : (int)((int64_t)(p + 1) * units / pieces) * SPLIT_ALIGN;
}

// One GEMM on the calling thread. OpenBLAS's OpenMP build splits a call made outside a parallel
// region over omp_get_max_threads() threads whatever openblas_set_num_threads said, at points
// of its own (its num_cpu_avail), so a whole GEMM rounded differently on 1 and 2 threads; the
// pool's size is 1 for the call's duration (an ICV of this thread alone).
static void sgemm_here(CBLAS_TRANSPOSE opa, CBLAS_TRANSPOSE opb, int m, int n, int k, const float *a, int lda,
                       const float *b, int ldb, float beta, float *c, int ldc) {
#ifdef _OPENMP
  int pool = omp_in_parallel() ? 1 : omp_get_max_threads();
  if (pool > 1) omp_set_num_threads(1);
#endif
  cblas_sgemm(CblasRowMajor, opa, opb, m, n, k, 1.0f, a, lda, b, ldb, beta, c, ldc);
#ifdef _OPENMP
  if (pool > 1) omp_set_num_threads(pool);
#endif
}

// C = op(A) op(B) (+ C when accumulate) in pieces of c's rows over the pool. With rows (the GEMM
// epilogue of rt_matmul_rows), each piece's thread then runs rows(args, lo, hi) over the rows it
// computed, while they are in its cache; returns whether it did (false when the GEMM ran in one
// piece: a small one, or inside a parallel region). --profile counts the slowest piece's epilogue
// out of the GEMM's time.
static bool matmul(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb, bool accumulate,
                   RtRowsFn rows, const void *const *args) {
  if (m <= 0 || n <= 0)
    return false;
  if (k <= 0) {
    if (!accumulate)
      memset(c, 0, (size_t)m * n * sizeof *c);
    return false;
  }
  int lda = ta ? m : k;   // A stored [k,m] when transposed, else [m,k]
  int ldb = tb ? k : n;   // B stored [n,k] when transposed, else [k,n]
  CBLAS_TRANSPOSE opa = ta ? CblasTrans : CblasNoTrans, opb = tb ? CblasTrans : CblasNoTrans;
  float beta = accumulate ? 1.0f : 0.0f;
  int64_t t0 = gemm_profile ? mono_ns() : 0, rows_ns = 0;
  int pieces = gemm_pieces(m, n, k);
  if (pieces <= 1) {
    sgemm_here(opa, opb, m, n, k, a, lda, b, ldb, beta, c, n);
  } else {
#ifdef _OPENMP
#pragma omp parallel num_threads(pieces) reduction(max : rows_ns)
#endif
    for (int p = rt_thread_id(); p < pieces; p += rt_team_size()) {
      int lo, hi;
      piece_rows(m, pieces, p, &lo, &hi);
      if (hi <= lo) continue;   // rows lo..hi-1 of c and of op(a)
      sgemm_here(opa, opb, hi - lo, n, k, ta ? a + lo : a + (size_t)lo * lda, lda, b, ldb, beta, c + (size_t)lo * n, n);
      if (!rows) continue;
      int64_t r0 = gemm_profile ? mono_ns() : 0;
      rows(args, lo, hi);
      if (gemm_profile && mono_ns() - r0 > rows_ns) rows_ns = mono_ns() - r0;
    }
  }
  if (gemm_profile)
    atomic_fetch_add(&gemm_ns, mono_ns() - t0 - rows_ns);
  return rows && pieces > 1;
}

void rt_matmul(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb,
               bool accumulate) {
  matmul(a, b, c, m, n, k, ta, tb, accumulate, NULL, NULL);
}

// The CPU program's GEMM epilogue: a fused group of elementwise and row-wise ops over the product's
// rows (codegen/emit_c.c says which) in matmul's pieces; when it returns false the caller runs the
// group over the whole product, on the team.
bool rt_matmul_rows(const float *a, const float *b, float *c, int m, int n, int k, bool ta, bool tb, RtRowsFn rows,
                    const void *const *args) {
  return matmul(a, b, c, m, n, k, ta, tb, false, rows, args);
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

// The kind of row r of x (width nx) in blocks of `block` rows (an expert's): ROW_ZERO, ROW_DUP
// (equal to row r - 1 of the same block, when dup), else ROW_LIVE; with y (width ny), a row
// whose row of y is zero is ROW_ZERO too.
static unsigned char row_kind(const float *x, int nx, bool dup, const float *y, int ny, int64_t r, int block) {
  const float *row = x + r * nx;
  if (row_zero(row, nx) || (y && row_zero(y + r * ny, ny))) return ROW_ZERO;
  if (dup && r % block != 0 && memcmp(row, row - nx, (size_t)nx * sizeof *row) == 0) return ROW_DUP;
  return ROW_LIVE;
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

// One rt_expert_matmul: its operands, and what its parallel region shares. slots: over the
// live slots (else every row of every expert, as rt_matmul); then the slot rows' kinds, each
// expert's segments and their count, and (ta = 0) the row each row outside them copies.
typedef struct {
  const float *a, *b;
  float *c;
  int e, m, n, k;
  bool ta, tb, slots;
  int rows;   // the slot dimension
  unsigned char *kind;
  int *src, *seg, *ns;
  RtRowsFn then;              // the epilogue over rows of c (its rows numbered over every expert), or NULL
  const void *const *args;
  _Atomic int64_t *then_ns;   // --profile: the epilogues' time, summed over the threads
} ExpertGemm;

// One GEMM call of it: expert `expert`, rows lo..hi-1 of c (every row, or ta = 1 over the live
// slots) or of the slot dimension (ta = 0: rows of a and c in one segment).
typedef struct {
  int expert, lo, hi;
  int64_t work;   // multiply-accumulates, to hand out the largest first
} GemmTask;

static int task_larger(const void *x, const void *y) {
  const GemmTask *p = x, *q = y;
  if (p->work != q->work) return p->work > q->work ? -1 : 1;
  return p->expert != q->expert ? p->expert - q->expert : p->lo - q->lo;
}

// Each product (or each segment, ta = 0 over the slots) in the pieces rt_matmul would cut it
// into outside a parallel region, so every row has the bits of rt_matmul's product (whole:
// called inside a parallel region, every product whole); returns their number.
static int expert_tasks(const ExpertGemm *g, bool whole, GemmTask *task) {
  int count = 0, n = g->n;
  for (int i = 0; i < g->e; i++) {
    const int *si = g->slots ? g->seg + (size_t)i * 2 * SEG_MAX : NULL;
    if (g->slots && !g->ta) {
      for (int j = 0; j < g->ns[i]; j++) {
        int rows = si[2 * j + 1] - si[2 * j], pieces = whole ? 1 : pieces_of(rows, n, g->k);
        for (int p = 0; p < pieces; p++) {
          int lo, hi;
          piece_rows(rows, pieces, p, &lo, &hi);
          if (hi > lo) task[count++] = (GemmTask){i, si[2 * j] + lo, si[2 * j] + hi, (int64_t)(hi - lo) * n * g->k};
        }
      }
      continue;
    }
    int k = g->k;
    if (g->slots) {   // ta = 1: the live slots of the expert are its k
      k = 0;
      for (int j = 0; j < g->ns[i]; j++) k += si[2 * j + 1] - si[2 * j];
      if (k == 0) continue;   // nobody routed to it: zeroed after the GEMMs
    }
    int pieces = whole ? 1 : pieces_of(g->m, n, k);
    for (int p = 0; p < pieces; p++) {
      int lo, hi;
      piece_rows(g->m, pieces, p, &lo, &hi);
      if (hi > lo) task[count++] = (GemmTask){i, lo, hi, (int64_t)(hi - lo) * n * k};
    }
  }
  return count;
}

static void expert_task_run(const ExpertGemm *g, const GemmTask *tk) {
  int i = tk->expert, lo = tk->lo, hi = tk->hi, m = g->m, n = g->n, k = g->k;
  const float *a = g->a + (size_t)i * m * k, *b = g->b + (size_t)i * k * n;
  float *c = g->c + (size_t)i * m * n;
  CBLAS_TRANSPOSE opa = g->ta ? CblasTrans : CblasNoTrans, opb = g->tb ? CblasTrans : CblasNoTrans;
  int lda = g->ta ? m : k, ldb = g->tb ? k : n;
  if (!g->slots || !g->ta) {   // rows lo..hi-1 of c (and of op(a)): of the product, or of one segment
    sgemm_here(opa, opb, hi - lo, n, k, g->ta ? a + lo : a + (size_t)lo * lda, lda, b, ldb, 0.0f, c + (size_t)lo * n, n);
    if (g->then) {
      int64_t r0 = gemm_profile ? mono_ns() : 0;
      g->then(g->args, (int64_t)i * m + lo, (int64_t)i * m + hi);
      if (gemm_profile) atomic_fetch_add(g->then_ns, mono_ns() - r0);
    }
    return;
  }
  // a [k, m], b [k, n]: rows lo..hi-1 of c, the k rows of both (slots) by segments, in order
  const int *si = g->seg + (size_t)i * 2 * SEG_MAX;
  for (int j = 0; j < g->ns[i]; j++)
    sgemm_here(CblasTrans, CblasNoTrans, hi - lo, n, si[2 * j + 1] - si[2 * j], a + (size_t)si[2 * j] * m + lo, m,
               b + (size_t)si[2 * j] * n, n, j > 0 ? 1.0f : 0.0f, c + (size_t)lo * n, n);
}

// The segments (and, ta = 0, the rows the rows outside them copy), from the kinds.
static void expert_segments(ExpertGemm *g) {
  int rows = g->rows;
  for (int i = 0; i < g->e; i++) {
    int *si = g->seg + (size_t)i * 2 * SEG_MAX;
    const unsigned char *ki = g->kind + (size_t)i * rows;
    g->ns[i] = live_segments(ki, rows, si);
    if (g->ta) continue;
    // Each row outside the segments: -1 (zero) or the last computed row before it, which a
    // copied row's chain of equal rows starts from (its first row is live, so computed).
    int *sr = g->src + (size_t)i * rows;
    for (int j = 0, last = -1, r = 0; r < g->m; r++) {
      while (j < g->ns[i] && si[2 * j + 1] <= r) j++;
      if (j < g->ns[i] && si[2 * j] <= r) {
        sr[r] = r;
        last = r;
      } else {
        sr[r] = ki[r] == ROW_ZERO ? -1 : last;
      }
    }
  }
}

// One parallel region: the slot rows' kinds, then every GEMM call (handed out largest first as
// threads free: the experts' products differ in size), then the rows outside the segments. Where
// every slot is asked for (MOERT_ALL_SLOTS=1) or ta and tb (no such expert GEMM), the experts'
// whole products are its tasks. With an epilogue (then, ta = 0), each task's rows of c go through
// it on the task's thread, and each row outside the segments after its copy.
static void expert_matmul(const float *a, const float *b, float *c, int e, int m, int n, int k, bool ta, bool tb,
                          RtRowsFn then, const void *const *args) {
  _Atomic int64_t then_ns = 0;
  ExpertGemm g = {a, b, c, e, m, n, k, ta, tb, !all_slots() && !(ta && tb), ta ? k : m, .then = then, .args = args,
                  .then_ns = &then_ns};
  if (g.slots) {
    g.kind = rt_alloc((size_t)e * g.rows, "the expert GEMMs' row kinds");
    g.src = ta ? NULL : rt_alloc((size_t)e * g.rows * sizeof *g.src, "the expert GEMMs' row sources");
    g.seg = rt_alloc((size_t)e * (2 * SEG_MAX + 1) * sizeof *g.seg, "the expert GEMMs' segments");
    g.ns = g.seg + (size_t)e * 2 * SEG_MAX;
  }
  GemmTask *task = rt_alloc(((size_t)e * (g.slots && !ta ? SEG_MAX : 1) * rt_gemm_pieces() + 1) * sizeof *task,
                            "the expert GEMMs' tasks");
  int tasks = 0;
  int64_t t0 = 0, t1 = 0, all = (int64_t)e * g.rows;
  bool whole = rt_in_team(), team = rt_threads() > 1 && rt_gemm_pieces() > 1 && !whole &&
                                    (int64_t)e * m * n * k >= 2 * (int64_t)SPLIT_MIN;
  RT_PARALLEL(team) {
    if (g.slots) {
      RT_FOR_SHARE
      for (int64_t r = 0; r < all; r++)
        g.kind[r] = ta ? row_kind(a, m, false, b, n, r, g.rows) : row_kind(a, k, true, NULL, 0, r, g.rows);
    }
    RT_BARRIER
    RT_SINGLE_TEAM
    {
      if (g.slots) expert_segments(&g);
      tasks = expert_tasks(&g, whole, task);
      qsort(task, (size_t)tasks, sizeof *task, task_larger);
      t0 = gemm_profile ? mono_ns() : 0;
    }
    RT_FOR_TEAM_DYNAMIC
    for (int t = 0; t < tasks; t++) expert_task_run(&g, &task[t]);
    RT_SINGLE_SHARE
    t1 = gemm_profile ? mono_ns() : 0;
    size_t c_size = (size_t)m * n;
    if (g.slots && ta) {   // an expert nobody routed to: its product is zero
      RT_FOR_SHARE
      for (int i = 0; i < e; i++)
        if (g.ns[i] == 0) memset(c + i * c_size, 0, c_size * sizeof *c);
    } else if (g.slots) {
      RT_FOR_SHARE
      for (int64_t r = 0; r < (int64_t)e * m; r++) {
        int64_t from = g.src[r] < 0 ? -1 : (r / m) * m + g.src[r];
        float *cr = c + r * n;
        if (from == r) continue;
        if (from < 0) memset(cr, 0, (size_t)n * sizeof *cr);
        else memcpy(cr, c + from * n, (size_t)n * sizeof *cr);
        if (then) then(args, r, r + 1);
      }
    }
  }
  if (gemm_profile)   // the epilogues ran on every thread of the team (or on this one)
    atomic_fetch_add(&gemm_ns, t1 - t0 - atomic_load(&then_ns) / (team ? rt_threads() : 1));
  free(g.kind);
  free(g.src);
  free(g.seg);
  free(task);
}

void rt_expert_matmul(const float *a, const float *b, float *c, int e, int m, int n, int k, bool ta, bool tb) {
  if (e <= 0 || m <= 0 || n <= 0) return;
  if (k <= 0) {   // an empty sum
    memset(c, 0, (size_t)e * m * n * sizeof *c);
    return;
  }
  expert_matmul(a, b, c, e, m, n, k, ta, tb, NULL, NULL);
}

bool rt_expert_matmul_rows(const float *a, const float *b, float *c, int e, int m, int n, int k, bool tb, RtRowsFn rows,
                           const void *const *args) {
  if (e <= 0 || m <= 0 || n <= 0 || k <= 0) {
    rt_expert_matmul(a, b, c, e, m, n, k, false, tb);
    return false;
  }
  expert_matmul(a, b, c, e, m, n, k, false, tb, rows, args);
  return true;
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

// Column sums in double of e matrices [rows, n] (dy + i rows n into db + i n), each column's
// rows in order: one (matrix, block of columns) per iteration, the rows streamed through the
// block's accumulators, so every column's sum is that of the one-column loop on any number of
// threads. Narrow blocks where the columns are few (a bias of 96 columns in 6 blocks, not one
// that leaves the other threads waiting).
//
// MOERT_PLANT_ORDER=1 (tests only: tests/threads.sh shows its check failing on it) plants the bug
// this layout avoids: each column summed in float, in one piece of rows per thread, the pieces
// then added, so that the sums' rounding depends on the number of threads.
static bool plant_order(void) {
  static int planted = -1;
  if (planted < 0) planted = getenv("MOERT_PLANT_ORDER") && strcmp(getenv("MOERT_PLANT_ORDER"), "1") == 0;
  return planted;
}

static void column_sums_planted(const float *dy, float *db, int e, int rows, int n) {
  int pieces = rt_threads(), per = (rows + pieces - 1) / pieces;
  for (int i = 0; i < e; i++)
    for (int c = 0; c < n; c++) {
      float total = 0.0f;
      for (int p0 = 0; p0 < rows; p0 += per) {
        float part = 0.0f;
        for (int r = p0; r < rows && r < p0 + per; r++) part += dy[((size_t)i * rows + r) * n + c];
        total += part;
      }
      db[(size_t)i * n + c] = total;
    }
}

void rt_column_sums_share(const float *dy, float *db, int e, int rows, int n) {
  enum { WIDE = 128, NARROW = 16 };
  if (plant_order()) {
    RT_SINGLE_SHARE
    column_sums_planted(dy, db, e, rows, n);
    return;
  }
  int block = n >= 4 * WIDE ? WIDE : NARROW, nblocks = (n + block - 1) / block, items = e * nblocks;
  RT_FOR_SHARE
  for (int it = 0; it < items; it++) {
    double acc[WIDE];
    int i = it / nblocks, c0 = it % nblocks * block, width = n - c0 < block ? n - c0 : block;
    const float *d = dy + (size_t)i * rows * n + c0;
    for (int c = 0; c < width; c++) acc[c] = 0.0;
    for (int r = 0; r < rows; r++) {
      const float *dr = d + (size_t)r * n;
      RT_SIMD
      for (int c = 0; c < width; c++) acc[c] += dr[c];
    }
    for (int c = 0; c < width; c++) db[(size_t)i * n + c0 + c] = (float)acc[c];
  }
}

static void column_sums(const float *dy, float *db, int e, int rows, int n) {
  RT_PARALLEL((int64_t)e * rows * n >= RT_PAR_MIN && (e > 1 || n > 16))
  rt_column_sums_share(dy, db, e, rows, n);
}

void rt_bias_grad(const float *dy, float *db, int rows, int n) { column_sums(dy, db, 1, rows, n); }

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

void rt_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) { column_sums(dy, db, e, rows, n); }

// y = x w, w [n] along every row of every expert (a LoRA adapter's alpha / r).
void rt_expert_scale(const float *x, const float *w, float *y, int e, int rows, int n) {
  RT_PARALLEL_FOR((int64_t)e * rows * n >= RT_PAR_MIN)
  for (int64_t r = 0; r < (int64_t)e * rows; r++) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    RT_SIMD
    for (int i = 0; i < n; i++)
      yr[i] = xr[i] * w[i];
  }
}

// ---- activations ----

// gelu(x) = 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3), computed as the same function
// x * s with s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) with rt_exp (vectorised; no cancellation
// in 1 + tanh(u) where u is very negative).
// (rt_gelu_s, RT_GELU_C and RT_GELU_A: runtime/rt_fused.h, which the fused loops use too.)

// s = gelu_s(x) in one loop and x * s in another, GELU_CHUNK elements at a time: the same bits as
// one loop of x[i] * gelu_s(x[i]), which GCC 12 compiles (its clamps folded into the product
// under masks) to code 6x slower on AVX-512 (6 ns an element against 1).
enum { GELU_CHUNK = RT_FUSED_CHUNK };

static inline __attribute__((always_inline)) void gelu_chunks(const float *x, float *y, int64_t n) {
  for (int64_t i0 = 0; i0 < n; i0 += GELU_CHUNK) rt_fv_gelu(n - i0 < GELU_CHUNK ? n - i0 : GELU_CHUNK, y + i0, x + i0);
}

// Rows (of cols elements) equal to the row before, as an expert's empty slots are after its
// bias (copies of b1), are copied from that row's result instead of computed again: the same
// bits. Each thread takes a contiguous block of rows and copies only from rows of its own block,
// which it has computed already.
RT_VECTOR_BODY void gelu_rows_body(const float *x, float *y, int64_t lo, int64_t hi, int64_t cols) {
  for (int64_t r = lo; r < hi; r++) {
    const float *xr = x + r * cols;
    float *yr = y + r * cols;
    if (r > lo && memcmp(xr, xr - cols, (size_t)cols * sizeof *xr) == 0) {
      memcpy(yr, yr - cols, (size_t)cols * sizeof *yr);
      continue;
    }
    gelu_chunks(xr, yr, cols);
  }
}
RT_VECTOR_PATHS(gelu_rows, (const float *x, float *y, int64_t lo, int64_t hi, int64_t cols),
                (x, y, lo, hi, cols))

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
RT_VECTOR_BODY void gelu_grad_range_body(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi,
                                         bool skip) {
  float sc[GELU_CHUNK];   // gelu_s apart, as in gelu_chunks
  for (int64_t i0 = lo; i0 < hi; i0 += GELU_CHUNK) {
    int64_t m = hi - i0 < GELU_CHUNK ? hi - i0 : GELU_CHUNK;
    const float *xs = x + i0, *dys = dy + i0;
    float *dxs = dx + i0;
RT_SIMD
    for (int64_t i = 0; i < m; i++) sc[i] = rt_gelu_s(xs[i]);
RT_SIMD
    for (int64_t i = 0; i < m; i++) {
      float v = xs[i], s = sc[i];
      float du = RT_GELU_C * (1.0f + 3.0f * RT_GELU_A * v * v);
      float g = dys[i] * (s + 2.0f * v * s * (1.0f - s) * du);
      dxs[i] = skip && dys[i] == 0.0f ? 0.0f : g;
    }
  }
}
RT_VECTOR_PATHS(gelu_grad_range, (const float *dy, const float *x, float *dx, int64_t lo, int64_t hi, bool skip),
                (dy, x, dx, lo, hi, skip))

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

// ---- squared ReLU (Primer) ----
// The float operations of relu2's row in ir/activations.def, which the fused loops compute: y = x x
// where x > 0, else +0 (NaN too); dx = dy (2 x) where x > 0, else +0. mk_relu2 and mk_relu2_grad
// are the same.
void rt_relu2(const float *x, float *y, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] > 0.0f ? x[i] * x[i] : 0.0f;
}

void rt_relu2_grad(const float *dy, const float *x, float *dx, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    dx[i] = x[i] > 0.0f ? dy[i] * (2.0f * x[i]) : 0.0f;
}

// ---- SiLU (SwiGLU experts) ----

// silu(x) = x s, s = sigmoid(x) = 1 / (1 + rt_exp(-x)) (rt_exp never overflows: s runs from
// about 1e-38 to 1), in chunks as GELU's: s in one vectorised loop, then the product; the elements
// split over the threads (rt_team_share). d silu/dx = s (1 + x (1 - s)). mk_silu and
// mk_silu_grad compute the same float operations.

// out = silu(x) over [lo, hi) when dy is NULL, else its gradient dy s (1 + x (1 - s)).
RT_VECTOR_BODY void silu_range_body(const float *dy, const float *x, float *out, int64_t lo, int64_t hi) {
  for (int64_t i0 = lo; i0 < hi; i0 += GELU_CHUNK) {
    int64_t m = hi - i0 < GELU_CHUNK ? hi - i0 : GELU_CHUNK;
    if (!dy) rt_fv_silu(m, out + i0, x + i0);
    else rt_fv_silu_grad(m, out + i0, dy + i0, x + i0);
  }
}
RT_VECTOR_PATHS(silu_range, (const float *dy, const float *x, float *out, int64_t lo, int64_t hi),
                (dy, x, out, lo, hi))

void rt_silu(const float *x, float *y, int64_t n) {
  RT_PARALLEL(n >= RT_PAR_MIN / 8)
  {
    int64_t lo, hi;
    rt_team_share(n, &lo, &hi);
    silu_range(NULL, x, y, lo, hi);
  }
}

void rt_silu_grad(const float *dy, const float *x, float *dx, int64_t n) {
  RT_PARALLEL(n >= RT_PAR_MIN / 8)
  {
    int64_t lo, hi;
    rt_team_share(n, &lo, &hi);
    silu_range(dy, x, dx, lo, hi);
  }
}

// ---- gpt-oss's clamped SwiGLU (ffn oss) ----

// y = (u' + 1) g' sigmoid(1.702 g'), g' = min(g, 7), u' = clamp(u, -7, 7), and its gradients
// (runtime/rt_fused.h's rt_fv_oss loops, which the fused groups run too; mk_oss, mk_oss_grad_gate
// and mk_oss_grad_up compute the same float operations), in chunks as SiLU's, the elements split
// over the threads. The gradients are +0 where dy is zero (an expert's empty slots, which after
// the biases hold act(b1, b3), not zeros), with MOERT_ALL_SLOTS too: the vector loop computes
// every element either way.
enum { OSS_Y, OSS_GRAD_GATE, OSS_GRAD_UP };

// out over [lo, hi): what `which` names, of gate g and up u (and dy for the gradients).
RT_VECTOR_BODY void oss_range_body(int which, const float *dy, const float *g, const float *u, float *out, int64_t lo,
                                   int64_t hi) {
  for (int64_t i0 = lo; i0 < hi; i0 += GELU_CHUNK) {
    int64_t m = hi - i0 < GELU_CHUNK ? hi - i0 : GELU_CHUNK;
    if (which == OSS_Y) rt_fv_oss(m, out + i0, g + i0, u + i0);
    else if (which == OSS_GRAD_GATE) rt_fv_oss_grad_gate(m, out + i0, dy + i0, g + i0, u + i0);
    else rt_fv_oss_grad_up(m, out + i0, dy + i0, g + i0, u + i0);
  }
}
RT_VECTOR_PATHS(oss_range, (int which, const float *dy, const float *g, const float *u, float *out, int64_t lo, int64_t hi),
                (which, dy, g, u, out, lo, hi))

static void oss_kernel(int which, const float *dy, const float *g, const float *u, float *out, int64_t n) {
  RT_PARALLEL(n >= RT_PAR_MIN / 8)
  {
    int64_t lo, hi;
    rt_team_share(n, &lo, &hi);
    oss_range(which, dy, g, u, out, lo, hi);
  }
}

void rt_oss(const float *g, const float *u, float *y, int64_t n) { oss_kernel(OSS_Y, NULL, g, u, y, n); }

void rt_oss_grad_gate(const float *dy, const float *g, const float *u, float *dg, int64_t n) {
  oss_kernel(OSS_GRAD_GATE, dy, g, u, dg, n);
}

void rt_oss_grad_up(const float *dy, const float *g, const float *u, float *du, int64_t n) {
  oss_kernel(OSS_GRAD_UP, dy, g, u, du, n);
}
