// Causal grouped-query attention, tiled through shared memory, and the column slice of its
// backward; the siblings of runtime/kernels/attn.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: attention tiles (the attention kernels share them) ----
#ifndef MK_ATTN_SH
#define MK_ATTN_SH 8192   // floats of shared memory a block stages keys and values in (32 KB)
#endif
#define MK_ATTN_KEYS(d) (2 * (d) <= MK_ATTN_SH ? MK_ATTN_SH / (2 * (d)) : 0)
// Heads up to MK_ATTN_D wide keep each thread's own rows (its query, its dy, its key and value)
// and its sums over the keys (o, dq, dk, dv) in arrays of its own, local memory, that the threads
// of a warp read and write side by side; a wider head reads and adds into global memory, row by
// row (each thread on a row of its own: 32 transactions for a warp's one access). Either way each
// element sees the same float operations in the same order. On an H200 the global sums made the
// attention of a 2-block language model (B16 L256, 16 heads of 128) 192 of its 230 ms a step.
#ifndef MK_ATTN_D
#define MK_ATTN_D 256
#endif

static __device__ float mk_attn_dot(const float *a, const float *b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

// Rows [t0, t0 + n) of columns [col, col + d) of x (row stride cols, rows from base) into sh, [n, d].
static __device__ void mk_attn_stage(float *sh, const float *x, i64 base, int t0, int n, int cols, int col, int d) {
  for (int e = threadIdx.x; e < n * d; e += blockDim.x) sh[e] = x[(base + t0 + e / d) * cols + col + e % d];
}

// Where the loops of a tiled attention kernel stand: work item w of MK_FOR_BLOCKS is tile `tile`
// of head h (or kv head) of sample b; this thread's row of the tile is i (active when i < seq).
typedef struct MkAttnTile {
  int b, h, i0, i;
  bool active;
} MkAttnTile;

static __device__ MkAttnTile mk_attn_tile(i64 w, int seq, int heads) {
  int tiles = (seq + blockDim.x - 1) / blockDim.x;
  MkAttnTile t;
  t.i0 = (int)(w % tiles) * blockDim.x;
  t.h = (int)(w / tiles % heads);
  t.b = (int)(w / tiles / heads);
  t.i = t.i0 + threadIdx.x;
  t.active = t.i < seq;
  return t;
}

static __device__ i64 mk_attn_items(int rows, int seq, int heads) {
  return (i64)(rows / seq) * heads * ((seq + blockDim.x - 1) / blockDim.x);
}

// The first key query i sees: 0, or i - window + 1 under a window (rt_attn_*'s first_key).
static __device__ int mk_attn_first(int i, int window) { return window > 0 && i >= window ? i - window + 1 : 0; }

// Keys [t0, t0 + n) of kv head j into sh when KT > 0 (the keys, then their values at sh + KT * d
// when v is not NULL), between two barriers: every thread of the block takes part, whether its
// row is active or not. KT == 0: nothing (the kernels read global memory).
static __device__ void mk_attn_stage_keys(float *sh, const float *k, const float *v, i64 r0, int t0, int n, int kcols,
                                          int j, int d, int KT) {
  if (!KT) return;
  __syncthreads();
  mk_attn_stage(sh, k, r0, t0, n, kcols, j * d, d);
  if (v) mk_attn_stage(sh + (i64)KT * d, v, r0, t0, n, kcols, j * d, d);
  __syncthreads();
}

// Key row t of kv head j of x (k, or v with sh + KT * d): staged in sh from key t0 when KT > 0,
// else in global memory.
static __device__ const float *mk_attn_key(const float *sh, const float *x, int KT, i64 r0, int t0, int t, int kcols,
                                           int j, int d) {
  return KT ? sh + (i64)(t - t0) * d : x + (r0 + t) * kcols + (i64)j * d;
}

// Pass 1 of a row: m = max_t s_t over the keys lo <= t <= i, staged KT at a time from the tile's
// first key `first` (every thread of the block takes part in the staging, whether its row is
// active or not).
static __device__ float mk_attn_max(const float *qi, const float *k, float *sh, MkAttnTile T, i64 r0, int first, int last,
                                    int lo, int kcols, int j, int d, float scale) {
  int KT = MK_ATTN_KEYS(d);
  float m = -3.40282347e38f;   // below every finite score (no INFINITY without headers)
  for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
    int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
    mk_attn_stage_keys(sh, k, NULL, r0, t0, n, kcols, j, d, KT);
    for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
      const float *kt = mk_attn_key(sh, k, KT, r0, t0, t, kcols, j, d);
      float s = mk_attn_dot(qi, kt, d) * scale;
      m = s > m ? s : m;
    }
  }
  return m;
}

// ---- mk_attn_fwd ----
// Causal grouped-query attention, tiled: a block takes a tile of blockDim.x consecutive query rows
// of one sample and head (MK_FOR_BLOCKS over samples x heads x tiles), stages the keys and values
// the tile sees through shared memory, MK_ATTN_KEYS(d) rows at a time, and each thread computes
// its row with the float operations of rt_attn_fwd (runtime/kernels/attn.c) in its order, so the
// targets agree to the bit. Nothing of size seq x seq exists anywhere. A head wider than half the
// staging buffer reads its keys from global memory instead. With a window W > 0 a row sees keys
// i - W < t <= i only, and a tile stages the keys from its first row's first one on.
extern "C" __global__ void mk_attn_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq,
                                       int heads, int kv, int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, KT = MK_ATTN_KEYS(d);
  float scale = 1.0f / sqrtf((float)d);
  __shared__ float sh[MK_ATTN_SH];
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + (int)blockDim.x < seq ? T.i0 + (int)blockDim.x : seq) - 1;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq, at = (r0 + T.i) * qcols + (i64)T.h * d;
    const float *qi = q + at;
    float *oi = o + at, qloc[MK_ATTN_D], oloc[MK_ATTN_D];
    if (d <= MK_ATTN_D) {
      for (int c = 0; T.active && c < d; c++) qloc[c] = qi[c];
      qi = qloc, oi = oloc;
    }
    float m = mk_attn_max(qi, k, sh, T, r0, first, last, lo, kcols, j, d, scale), l = 0.0f;
    for (int c = 0; T.active && c < d; c++) oi[c] = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      mk_attn_stage_keys(sh, k, v, r0, t0, n, kcols, j, d, KT);
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = mk_attn_key(sh, k, KT, r0, t0, t, kcols, j, d);
        const float *vt = mk_attn_key(sh + (i64)KT * d, v, KT, r0, t0, t, kcols, j, d);
        float p = mk_exp(mk_attn_dot(qi, kt, d) * scale - m);
        l += p;
        for (int c = 0; c < d; c++) oi[c] += p * vt[c];
      }
    }
    for (int c = 0; T.active && c < d; c++) o[at + c] = oi[c] / l;
  }
}

// ---- mk_attn_stats ----
// Per (row, head): the logsumexp of its scores and dy . o, as rt_attn_stats, tiled as mk_attn_fwd.
extern "C" __global__ void mk_attn_stats(const float *dy, const float *q, const float *k, const float *o,
                                         float *stats, int rows, int seq, int heads, int kv, int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, KT = MK_ATTN_KEYS(d);
  float scale = 1.0f / sqrtf((float)d);
  __shared__ float sh[MK_ATTN_SH];
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + (int)blockDim.x < seq ? T.i0 + (int)blockDim.x : seq) - 1;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq, at = (r0 + T.i) * qcols + (i64)T.h * d;
    const float *qi = q + at;
    float qloc[MK_ATTN_D];
    if (d <= MK_ATTN_D) {
      for (int c = 0; T.active && c < d; c++) qloc[c] = qi[c];
      qi = qloc;
    }
    float m = mk_attn_max(qi, k, sh, T, r0, first, last, lo, kcols, j, d, scale), l = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      mk_attn_stage_keys(sh, k, NULL, r0, t0, n, kcols, j, d, KT);
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = mk_attn_key(sh, k, KT, r0, t0, t, kcols, j, d);
        l += mk_exp(mk_attn_dot(qi, kt, d) * scale - m);
      }
    }
    if (T.active) {
      stats[(r0 + T.i) * 2 * heads + T.h] = m + logf(l);
      stats[(r0 + T.i) * 2 * heads + heads + T.h] = mk_attn_dot(dy + at, o + at, d);
    }
  }
}

// ---- mk_attn_grad_q ----
// dq of one (row, head) per thread, as rt_attn_grad_q, tiled as mk_attn_fwd (keys and values
// staged together).
extern "C" __global__ void mk_attn_grad_q(const float *dy, const float *q, const float *k, const float *v,
                                          const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                          int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols, KT = MK_ATTN_KEYS(d);
  float scale = 1.0f / sqrtf((float)d);
  __shared__ float sh[MK_ATTN_SH];
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + (int)blockDim.x < seq ? T.i0 + (int)blockDim.x : seq) - 1;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq, r = r0 + T.i, at = r * qcols + (i64)T.h * d;
    float lse = T.active ? stats[r * 2 * heads + T.h] : 0.0f, D = T.active ? stats[r * 2 * heads + heads + T.h] : 0.0f;
    float *dq = dqkv + r * width + (i64)T.h * d, *acc = dq, qloc[MK_ATTN_D], yloc[MK_ATTN_D], dloc[MK_ATTN_D];
    const float *qi = q + at, *yi = dy + at;
    if (d <= MK_ATTN_D) {
      for (int c = 0; T.active && c < d; c++) qloc[c] = qi[c], yloc[c] = yi[c];
      qi = qloc, yi = yloc, acc = dloc;
    }
    for (int c = 0; T.active && c < d; c++) acc[c] = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      mk_attn_stage_keys(sh, k, v, r0, t0, n, kcols, j, d, KT);
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = mk_attn_key(sh, k, KT, r0, t0, t, kcols, j, d);
        const float *vt = mk_attn_key(sh + (i64)KT * d, v, KT, r0, t0, t, kcols, j, d);
        float p = mk_exp(mk_attn_dot(qi, kt, d) * scale - lse);
        float ds = p * (mk_attn_dot(yi, vt, d) - D);
        for (int c = 0; c < d; c++) acc[c] += ds * kt[c];
      }
    }
    for (int c = 0; T.active && c < d; c++) dq[c] = acc[c] * scale;
  }
}

// ---- mk_attn_grad_kv ----
// dk and dv of one (key row, kv head) per thread, as rt_attn_grad_kv (no atomics): a block takes a
// tile of blockDim.x keys of one sample and kv head and, for each head of the group in order,
// stages the rows of q and dy (and their lse and D) of the queries i >= its first key (under a
// window W, up to its last key's t + W - 1), MK_ATTN_KEYS(d) rows at a time; each thread adds its
// queries t <= i < t + W in order.
extern "C" __global__ void mk_attn_grad_kv(const float *dy, const float *q, const float *k, const float *v,
                                           const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                           int qcols, int window) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  int KT = MK_ATTN_KEYS(d + 1);   // a staged query row: q, dy and its two statistics
  float scale = 1.0f / sqrtf((float)d);
  __shared__ float sh[MK_ATTN_SH];
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, kv)) {
    MkAttnTile T = mk_attn_tile(w, seq, kv);   // T.h: the kv head, T.i: this thread's key t
    int j = T.h, t = T.i, last = (T.i0 + (int)blockDim.x < seq ? T.i0 + (int)blockDim.x : seq) - 1;
    int end = window > 0 && last + window < seq ? last + window : seq;   // the tile's queries end before
    int stop = window > 0 && t + window < seq ? t + window : seq;        // this key's
    i64 r0 = (i64)T.b * seq, r = r0 + t;
    const float *kt = k + r * kcols + (i64)j * d, *vt = v + r * kcols + (i64)j * d;
    float *dk = dqkv + r * width + qcols + (i64)j * d, *dv = dk + kcols, *ak = dk, *av = dv;
    float kloc[MK_ATTN_D], vloc[MK_ATTN_D], akloc[MK_ATTN_D], avloc[MK_ATTN_D];
    if (d <= MK_ATTN_D) {
      for (int c = 0; T.active && c < d; c++) kloc[c] = kt[c], vloc[c] = vt[c];
      kt = kloc, vt = vloc, ak = akloc, av = avloc;
    }
    for (int c = 0; T.active && c < d; c++) ak[c] = av[c] = 0.0f;
    for (int h = j * group; h < (j + 1) * group; h++)
      for (int i0 = T.i0; i0 < end; i0 += KT ? KT : end) {
        int n = KT && end - i0 > KT ? KT : end - i0;
        float *shq = sh, *shy = sh + (i64)KT * d, *shs = sh + (i64)2 * KT * d;
        if (KT) {
          __syncthreads();
          mk_attn_stage(shq, q, r0, i0, n, qcols, h * d, d);
          mk_attn_stage(shy, dy, r0, i0, n, qcols, h * d, d);
          for (int e = threadIdx.x; e < n; e += blockDim.x) {
            shs[2 * e] = stats[(r0 + i0 + e) * 2 * heads + h];
            shs[2 * e + 1] = stats[(r0 + i0 + e) * 2 * heads + heads + h];
          }
          __syncthreads();
        }
        for (int i = i0 > t ? i0 : t; T.active && i < i0 + n && i < stop; i++) {
          i64 at = (r0 + i) * qcols + (i64)h * d;
          const float *qi = KT ? shq + (i64)(i - i0) * d : q + at, *yi = KT ? shy + (i64)(i - i0) * d : dy + at;
          float lse = KT ? shs[2 * (i - i0)] : stats[(r0 + i) * 2 * heads + h];
          float D = KT ? shs[2 * (i - i0) + 1] : stats[(r0 + i) * 2 * heads + heads + h];
          float p = mk_exp(mk_attn_dot(qi, kt, d) * scale - lse);
          float ds = p * (mk_attn_dot(yi, vt, d) - D);
          for (int c = 0; c < d; c++) {
            ak[c] += ds * qi[c];
            av[c] += p * yi[c];
          }
        }
      }
    for (int c = 0; T.active && c < d; c++) dk[c] = ak[c] * scale, dv[c] = av[c];
  }
}

// ---- mk_cols_slice ----
extern "C" __global__ void mk_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  MK_FOR(p, (i64)rows * width) y[p] = x[p / width * cols + offset + p % width];
}
