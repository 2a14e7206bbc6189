// Causal grouped-query attention, tiled through shared memory, and the column slice of its
// backward; the siblings of runtime/kernels/attn.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: attention tiles (the attention kernels share them) ----
// The tiled kernels below keep every output element's float operations and their order those
// of runtime/kernels/attn.c (a dot product is a sum over c ascending of a[c] * b[c] from 0; a
// weighted sum over keys or queries runs over them ascending; so the host builds agree with the
// CPU to the bit, and a GPU to the roundings of its fused multiply-adds, MK_ATTN_FMA below),
// and spread them over a block as a GEMM's register tiles do:
//   - a block takes a tile of R = blockDim.x / 8 rows of its own (queries of one sample and head,
//     or keys of one kv head), 8 threads a row: thread (r, g) = (threadIdx.x / 8, threadIdx.x % 8);
//   - it steps over the other side (keys, or queries) MK_ATTN_X rows at a time; the R x MK_ATTN_X
//     dot products of a step are staged through shared memory MK_ATTN_C columns at a time and
//     thread (r, g) keeps those of its row against rows 4g .. 4g + 3 of the step in registers;
//   - the weights of a step (the exps, or dS) go to shared memory, and thread (r, g) adds the
//     weighted rows of the step (staged MK_ATTN_C columns at a time) into its columns 4g .. 4g + 3
//     of each chunk of its output row, held in registers: MK_ATTN_D columns a pass, a wider head
//     in several passes (each recomputing its dots).
// Nothing of size seq x seq exists. On an H200, the one-thread-per-row kernels these replace spent
// 88 of a 2-block language model's 118 kernel-milliseconds a step (B16 L256, 16 heads of 128).
// The launch gives 8 threads per (row, head): `threads rows*heads*8` in ir/ops.def. The blocks
// must be a multiple of 8 threads, at most 8 * MK_ATTN_X (MK_BLOCK is 256).
// The dot products and weighted sums add a * b to s with one rounding on the GPU (__fmaf_rn: the
// module builds with --fmad=false, so the kernels ask for it here only) and with two, as the CPU,
// in the host builds of the library (the fake device, the emulation), which therefore give the
// CPU's bits; on a GPU these sums differ from the CPU's by their roundings (ulps, well inside the
// 1e-5 of gpu_check and the 1e-4 of the model checks).
#ifdef __CUDACC__
#define MK_ATTN_FMA(a, b, s) __fmaf_rn((a), (b), (s))
#else
#define MK_ATTN_FMA(a, b, s) ((s) + (a) * (b))
#endif
// Fixed: a step is 32 rows of the other side (4 a thread: x = 4g .. 4g + 3) and a chunk 32 columns
// (4 a thread: 4g .. 4g + 3), so that a thread reads 4 neighbours of shared memory at once.
#define MK_ATTN_X 32        // rows of the other side per step
#define MK_ATTN_C 32        // columns per staged chunk
#define MK_ATTN_U 4         // dot products a thread keeps per step
#define MK_ATTN_J 4         // columns of a chunk per thread
#ifndef MK_ATTN_D
#define MK_ATTN_D 128       // output columns a tile row holds in one pass (a multiple of 32; 8 threads: D / 8 each)
#endif
#define MK_ATTN_PAD (MK_ATTN_C + 4)      // a staged row (16-byte aligned rows)
#define MK_ATTN_BPAD (MK_ATTN_X + 4)     // a staged column of the other side's rows
#define MK_ATTN_WPAD (MK_ATTN_X + 1)     // a row of weights

// Shared memory of a block: the tile's chunk [R][c] and the step's chunk transposed [c][x] for the
// dots, a chunk [x][c] of the rows the weights apply to, two rows of weights per tile row.
#ifdef __CUDACC__
#define MK_ATTN_ALIGN __align__(16)
#else
#define MK_ATTN_ALIGN
#endif
typedef struct MK_ATTN_ALIGN MkAttnShared {
  float a[MK_ATTN_X * MK_ATTN_PAD], b[MK_ATTN_C * MK_ATTN_BPAD], x[MK_ATTN_X * MK_ATTN_PAD];
  float w[MK_ATTN_X * MK_ATTN_WPAD], w2[MK_ATTN_X * MK_ATTN_WPAD], red[8 * MK_ATTN_X];
} MkAttnShared;

// Four floats from 16-byte aligned shared memory: one load on the GPU.
#ifdef __CUDACC__
static __device__ __forceinline__ void mk_attn_ld4(const float *p, float v[4]) {
  float4 q = *(const float4 *)p;
  v[0] = q.x, v[1] = q.y, v[2] = q.z, v[3] = q.w;
}
#else
static __device__ void mk_attn_ld4(const float *p, float v[4]) { v[0] = p[0], v[1] = p[1], v[2] = p[2], v[3] = p[3]; }
#endif

// Where a tile stands: tile w of MK_FOR_BLOCKS is tile `tile` of R rows of head h of sample b;
// this thread's row i = i0 + r (active when i < seq), lane g.
typedef struct MkAttnTile {
  int b, h, i0, i, r, g, R;
  bool active;
} MkAttnTile;

static __device__ MkAttnTile mk_attn_tile(i64 w, int seq, int heads) {
  MkAttnTile t;
  t.R = blockDim.x / 8;
  int tiles = (seq + t.R - 1) / t.R;
  t.i0 = (int)(w % tiles) * t.R;
  t.h = (int)(w / tiles % heads);
  t.b = (int)(w / tiles / heads);
  t.r = threadIdx.x / 8;
  t.g = threadIdx.x % 8;
  t.i = t.i0 + t.r;
  t.active = t.i < seq;
  return t;
}

static __device__ i64 mk_attn_items(int rows, int seq, int heads) {
  int R = blockDim.x / 8;
  return (i64)(rows / seq) * heads * ((seq + R - 1) / R);
}

// The first key query i sees: 0, or i - window + 1 under a window (rt_attn_*'s first_key).
static __device__ int mk_attn_first(int i, int window) { return window > 0 && i >= window ? i - window + 1 : 0; }

// s[u] = sum over c ascending of a_r[c] * b_x[c] (from 0) for x = 4g + u: a_r row r of the tile's
// own rows (na of them from a, stride as), b_x row x of the step's (nb from b, stride bs), d
// columns, staged MK_ATTN_C at a time. A chunk's columns past d are staged as zeros on both sides
// and added as the products 0 * 0: a sum of products is never -0, so adding +0 changes nothing.
// Every thread of the block calls it.
static __device__ void mk_attn_dots(float s[MK_ATTN_U], MkAttnShared *sh, const MkAttnTile *T, const float *a, int na,
                                    i64 as, const float *b, int nb, i64 bs, int d) {
  for (int u = 0; u < MK_ATTN_U; u++) s[u] = 0.0f;
  for (int c0 = 0; c0 < d; c0 += MK_ATTN_C) {
    int cn = d - c0 < MK_ATTN_C ? d - c0 : MK_ATTN_C;
    __syncthreads();
    for (int e = threadIdx.x; e < T->R * MK_ATTN_C; e += blockDim.x) {
      int r = e / MK_ATTN_C, c = e % MK_ATTN_C;
      sh->a[r * MK_ATTN_PAD + c] = r < na && c < cn ? a[r * as + c0 + c] : 0.0f;
    }
    for (int e = threadIdx.x; e < MK_ATTN_X * MK_ATTN_C; e += blockDim.x) {
      int x = e / MK_ATTN_C, c = e % MK_ATTN_C;
      sh->b[c * MK_ATTN_BPAD + x] = x < nb && c < cn ? b[x * bs + c0 + c] : 0.0f;
    }
    __syncthreads();
    const float *ar = sh->a + T->r * MK_ATTN_PAD, *bg = sh->b + 4 * T->g;
    for (int c = 0; c < cn; c += 4) {
      float av[4];
      mk_attn_ld4(ar + c, av);
MK_UNROLL
      for (int cc = 0; cc < 4; cc++) {
        float bv[4];
        mk_attn_ld4(bg + (c + cc) * MK_ATTN_BPAD, bv);
MK_UNROLL
        for (int u = 0; u < MK_ATTN_U; u++) s[u] = MK_ATTN_FMA(av[cc], bv[u], s[u]);
      }
    }
  }
}

// acc[ch * J + j] (column col0 + ch * MK_ATTN_C + 4g + j of this thread's row) += w_r[x] * x_x[col]
// for x = xlo .. xhi ascending (w: the row's weights in shared memory; x rows from xs, nx of
// them, stride xst, columns col0 .. col0 + MK_ATTN_D of d), staged MK_ATTN_C columns at a time.
// Every thread of the block calls it.
static __device__ void mk_attn_wsum(float acc[MK_ATTN_D / 8], MkAttnShared *sh, const MkAttnTile *T, const float *w,
                                    const float *xs, int nx, i64 xst, int col0, int d, int xlo, int xhi) {
MK_UNROLL
  for (int ch = 0; ch < MK_ATTN_D / MK_ATTN_C; ch++) {
    int c0 = col0 + ch * MK_ATTN_C;
    if (c0 >= d) break;
    int cn = d - c0 < MK_ATTN_C ? d - c0 : MK_ATTN_C;
    __syncthreads();
    for (int e = threadIdx.x; e < MK_ATTN_X * MK_ATTN_C; e += blockDim.x) {
      int x = e / MK_ATTN_C, c = e % MK_ATTN_C;
      sh->x[x * MK_ATTN_PAD + c] = x < nx && c < cn ? xs[x * xst + c0 + c] : 0.0f;
    }
    __syncthreads();
    for (int x = xlo; x <= xhi; x++) {
      float wx = w[x], xv[4];
      mk_attn_ld4(sh->x + x * MK_ATTN_PAD + 4 * T->g, xv);
MK_UNROLL
      for (int j = 0; j < MK_ATTN_J; j++) acc[ch * MK_ATTN_J + j] = MK_ATTN_FMA(wx, xv[j], acc[ch * MK_ATTN_J + j]);
    }
  }
}

// Writes out[col] = f(acc) for this thread's columns of a pass (f: 0 copy, 1 divide by v, 2
// multiply by v).
static __device__ void mk_attn_store(float *out, const float acc[MK_ATTN_D / 8], const MkAttnTile *T, int col0, int d,
                                     int how, float v) {
MK_UNROLL
  for (int ch = 0; ch < MK_ATTN_D / MK_ATTN_C; ch++)
MK_UNROLL
    for (int j = 0; j < MK_ATTN_J; j++) {
      int c = col0 + ch * MK_ATTN_C + 4 * T->g + j;
      if (c < d) out[c] = how == 1 ? acc[ch * MK_ATTN_J + j] / v : how == 2 ? acc[ch * MK_ATTN_J + j] * v : acc[ch * MK_ATTN_J + j];
    }
}

static __device__ void mk_attn_zero(float acc[MK_ATTN_D / 8]) {
MK_UNROLL
  for (int e = 0; e < MK_ATTN_D / 8; e++) acc[e] = 0.0f;
}

// The largest of v over the 8 threads of each tile row (exact: a maximum does not round).
static __device__ float mk_attn_row_max(MkAttnShared *sh, float v) {
  __syncthreads();
  sh->red[threadIdx.x] = v;
  __syncthreads();
  float m = v;
  for (int g = 0; g < 8; g++) {
    float o = sh->red[threadIdx.x / 8 * 8 + g];
    m = o > m ? o : m;
  }
  return m;
}

// Pass 1 of a query row: m = max of the scaled scores over the keys lo <= t <= i (the tile's keys
// first .. last, MK_ATTN_X a step), as rt_attn's row_softmax: v = s * scale, m = v > m ? v : m.
static __device__ float mk_attn_max(MkAttnShared *sh, const MkAttnTile *T, const float *qt, int na, i64 qs,
                                    const float *k, i64 ks, int first, int last, int lo, int d, float scale) {
  float m = -3.40282347e38f;   // below every finite score (no INFINITY without headers)
  for (int t0 = first; t0 <= last; t0 += MK_ATTN_X) {
    int nt = last + 1 - t0 < MK_ATTN_X ? last + 1 - t0 : MK_ATTN_X;
    float s[MK_ATTN_U];
    mk_attn_dots(s, sh, T, qt, na, qs, k + (i64)t0 * ks, nt, ks, d);
    for (int u = 0; u < MK_ATTN_U; u++) {
      int t = t0 + 4 * T->g + u;
      float v = s[u] * scale;
      if (T->active && t < t0 + nt && t >= lo && t <= T->i) m = v > m ? v : m;
    }
  }
  return mk_attn_row_max(sh, m);
}

// The weights of a step: row r's w[x] for its keys t0 + x (this thread's x = 4g + u; 0 where the
// row does not see the key), between barriers; returns the row's range of x (xlo > xhi: none).
static __device__ void mk_attn_key_range(const MkAttnTile *T, int t0, int nt, int lo, int *xlo, int *xhi) {
  *xlo = lo > t0 ? lo - t0 : 0;
  *xhi = T->i - t0 < nt - 1 ? T->i - t0 : nt - 1;
  if (!T->active) *xlo = 1, *xhi = 0;
}

// The weights of a step of keys t0 .. t0 + nt - 1 for each query row of the tile: p = exp(q.k *
// scale - m) where the row sees the key, 0 elsewhere, into the row's weights in shared memory
// (returned), after a barrier; *xlo, *xhi the row's range of them.
static __device__ const float *mk_attn_exps(MkAttnShared *sh, const MkAttnTile *T, const float *qt, int na, i64 qs,
                                            const float *k, i64 ks, int t0, int nt, int lo, int d, float scale,
                                            float m, int *xlo, int *xhi) {
  float s[MK_ATTN_U];
  mk_attn_dots(s, sh, T, qt, na, qs, k + (i64)t0 * ks, nt, ks, d);
  mk_attn_key_range(T, t0, nt, lo, xlo, xhi);
  for (int u = 0; u < MK_ATTN_U; u++) {
    int x = 4 * T->g + u;
    sh->w[T->r * MK_ATTN_WPAD + x] = x >= *xlo && x <= *xhi ? mk_exp(s[u] * scale - m) : 0.0f;
  }
  __syncthreads();
  return sh->w + T->r * MK_ATTN_WPAD;
}

// ---- prelude: the forward and statistics bodies (with and without sinks) ----
// mk_attn_fwd_body: causal grouped-query attention, tiled (see the prelude): per query row, m (pass 1), then per
// step of keys p = exp(s * scale - m), l += p in key order, o += p v; o / l at the end. With a
// window W > 0 a row sees keys i - W < t <= i only. With sinks (attn.sink, one logit per head),
// as rt_attn's row_softmax: m is also at least the head's sink, and l ends with exp(sink - m).
static __device__ void mk_attn_fwd_body(MkAttnShared *sh, const float *q, const float *k, const float *v,
                                        const float *sinks, float *o, int rows, int seq, int heads, int kv, int qcols,
                                        int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + T.R < seq ? T.i0 + T.R : seq) - 1, na = last + 1 - T.i0;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq;
    const float *qt = q + (r0 + T.i0) * qcols + (i64)T.h * d, *kh = k + r0 * kcols + (i64)j * d,
                *vh = v + r0 * kcols + (i64)j * d;
    float m = mk_attn_max(sh, &T, qt, na, qcols, kh, kcols, first, last, lo, d, scale);
    if (sinks) m = sinks[T.h] > m ? sinks[T.h] : m;
    for (int col0 = 0; col0 < d; col0 += MK_ATTN_D) {
      float acc[MK_ATTN_D / 8], l = 0.0f;
      mk_attn_zero(acc);
      for (int t0 = first; t0 <= last; t0 += MK_ATTN_X) {
        int nt = last + 1 - t0 < MK_ATTN_X ? last + 1 - t0 : MK_ATTN_X, xlo, xhi;
        const float *wr = mk_attn_exps(sh, &T, qt, na, qcols, kh, kcols, t0, nt, lo, d, scale, m, &xlo, &xhi);
        for (int x = xlo; x <= xhi; x++) l += wr[x];
        mk_attn_wsum(acc, sh, &T, wr, vh + (i64)t0 * kcols, nt, kcols, col0, d, xlo, xhi);
      }
      if (sinks) l += mk_exp(sinks[T.h] - m);
      if (T.active) mk_attn_store(o + (r0 + T.i) * qcols + (i64)T.h * d, acc, &T, col0, d, 1, l);
    }
  }
}

// mk_attn_stats_body: per (row, head): the logsumexp of its scores (and the head's sink, when there are sinks) and
// dy . o, as rt_attn_stats, tiled as mk_attn_fwd.
static __device__ void mk_attn_stats_body(MkAttnShared *sh, const float *dy, const float *q, const float *k,
                                          const float *o, const float *sinks, float *stats, int rows, int seq, int heads,
                                          int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + T.R < seq ? T.i0 + T.R : seq) - 1, na = last + 1 - T.i0;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq;
    const float *qt = q + (r0 + T.i0) * qcols + (i64)T.h * d, *kh = k + r0 * kcols + (i64)j * d;
    float m = mk_attn_max(sh, &T, qt, na, qcols, kh, kcols, first, last, lo, d, scale), l = 0.0f;
    if (sinks) m = sinks[T.h] > m ? sinks[T.h] : m;
    for (int t0 = first; t0 <= last; t0 += MK_ATTN_X) {
      int nt = last + 1 - t0 < MK_ATTN_X ? last + 1 - t0 : MK_ATTN_X, xlo, xhi;
      const float *wr = mk_attn_exps(sh, &T, qt, na, qcols, kh, kcols, t0, nt, lo, d, scale, m, &xlo, &xhi);
      for (int x = xlo; x <= xhi; x++) l += wr[x];
    }
    if (sinks) l += mk_exp(sinks[T.h] - m);
    if (T.active && T.g == 0) {
      i64 at = (r0 + T.i) * qcols + (i64)T.h * d;
      float D = 0.0f;
      for (int c = 0; c < d; c++) D += dy[at + c] * o[at + c];
      stats[(r0 + T.i) * 2 * heads + T.h] = m + logf(l);
      stats[(r0 + T.i) * 2 * heads + heads + T.h] = D;
    }
  }
}

// ---- prelude: attention on tensor cores (dtype bf16) ----
// The attention of a dtype bf16 program whose heads are a multiple of 16 and at most MK_TC_D wide
// (codegen/lower.c's attn_tc): the products on tensor cores, bf16 operands with fp32 sums (PTX's
// mma.sync m16n8k16), the softmax online (one pass over the keys, rescaling the row's sums when
// its maximum grows). They compute what the kernels above compute, to bf16's precision rather
// than to the CPU's bits: q, k, v, dy are rounded to bf16 (nearest even) as they are staged, and
// so are the weights p and dS before their products; the row statistics (m, l, lse, D) and every
// sum stay fp32.
//   - A block of W warps takes 16 W rows of its own (queries of one sample and head, or keys of
//     one kv head), 16 a warp. A warp keeps its rows' operand fragments in registers (q and dy,
//     or k and v: 4 registers of two bf16 per 16 columns) and its output rows' sums (the m16n8
//     accumulators: 4 floats a lane per 8 columns).
//   - It steps over the other side (keys: MK_TC_X a step; queries for dk and dv: MK_TC_XQ),
//     staging the step's rows as bf16 in shared memory (rows MK_TC_LD apart: a warp's reads of a
//     fragment touch 32 banks), and multiplies: s = q k^T, then o += p v (the forward); dq += dS k;
//     dv += p^T dy and dk += dS^T q. The weights go from the accumulators of s straight into the
//     A fragments of the next product (the layouts agree), never through memory.
// The lanes of a fragment (PTX ISA, "matrix fragments for mma.m16n8k16"): lane = 4 g + t; A
// (16 x 16, row major) register e holds row g + 8 (e & 1), columns 2t, 2t + 1 (+ 8 when e >= 2);
// B (16 x 8) register e rows 2t, 2t + 1 (+ 8 e), column g; C (16 x 8) element e row g + 8 (e >> 1),
// column 2t + (e & 1). A row's statistics live in the 4 lanes t of its g; they are combined by
// shuffles. The host builds of the library (the fake device, the emulation) run the same code
// with mk_tc_mma and mk_tc_xor emulated through shared memory and barriers (every thread of the
// block calls them the same number of times), their fp32 sums in k order; so the fake device
// checks the fragment layouts, not the tensor cores' roundings.
#define MK_TC_D 128               // the widest head (a multiple of 16)
#define MK_TC_LD (MK_TC_D + 8)    // a staged bf16 row
#define MK_TC_X 32                // keys a step (forward, statistics, dq)
#define MK_TC_XQ 16               // queries a step (dk, dv)

typedef struct MK_ATTN_ALIGN MkAttnTcShared {
  u16 a[MK_TC_X * MK_TC_LD], b[MK_TC_X * MK_TC_LD];   // a step's k and v (dk, dv: q and dy)
  float lse[MK_TC_XQ], dd[MK_TC_XQ];                  // dk, dv: the step's queries' statistics
} MkAttnTcShared;

// The tensor cores' primitives (mk_tc_mma, mk_tc_xor, mk_tc_pack, ...) are the prelude's
// (codegen/cuda/prelude.cu, "tensor cores").
#ifdef __CUDACC__
#define MK_TC_EXP(x) __expf(x)
#define MK_TC_SKIP(c) (c)         // a warp skips a step none of its rows takes (the host builds do not)
#else
#define MK_TC_EXP(x) mk_exp(x)
#define MK_TC_SKIP(c) false
#endif

// This lane's A fragments of 16 rows (n of them from x, stride xs; zeros past them), d columns.
static __device__ void mk_tc_load_a(u32 a[MK_TC_D / 16][4], const float *x, i64 xs, int n, int d) {
  int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
MK_UNROLL
  for (int ks = 0; ks < MK_TC_D / 16; ks++)
MK_UNROLL
    for (int e = 0; e < 4; e++) {
      int row = g + 8 * (e & 1), col = 16 * ks + 2 * t + 8 * (e >> 1);
      bool in = row < n && col < d;
      a[ks][e] = mk_tc_pack(in ? x[row * xs + col] : 0.0f, in ? x[row * xs + col + 1] : 0.0f);
    }
}

// B fragment of columns n0 .. n0 + 7, rows k0 .. k0 + 15 of the product from a staged tile that
// holds B transposed ([n][k]: k to multiply q k^T, the rows are the keys) or as it is ([k][n]: v in
// p v, the rows are the keys again).
static __device__ __forceinline__ void mk_tc_b_nk(u32 b[2], const u16 *tile, int n0, int k0) {
  const u16 *p = tile + (n0 + ((threadIdx.x & 31) >> 2)) * MK_TC_LD + k0 + 2 * (threadIdx.x & 3);
  b[0] = mk_tc_ld32(p), b[1] = mk_tc_ld32(p + 8);
}
static __device__ __forceinline__ void mk_tc_b_kn(u32 b[2], const u16 *tile, int k0, int n0) {
  const u16 *p = tile + (k0 + 2 * (threadIdx.x & 3)) * MK_TC_LD + n0 + ((threadIdx.x & 31) >> 2);
  b[0] = p[0] | (u32)p[MK_TC_LD] << 16, b[1] = p[8 * MK_TC_LD] | (u32)p[9 * MK_TC_LD] << 16;
}

// rows x d of x (stride xs) into a tile as bf16, n of them (zeros past n). Every thread calls it.
static __device__ void mk_tc_stage(u16 *tile, const float *x, i64 xs, int n, int rows, int d) {
  int pairs = d / 2;
  for (int e = threadIdx.x; e < rows * pairs; e += blockDim.x) {
    int r = e / pairs, c = 2 * (e % pairs);
    mk_tc_st32(tile + r * MK_TC_LD + c, r < n ? mk_tc_pack(x[r * xs + c], x[r * xs + c + 1]) : 0u);
  }
}

// s[nb] = a b^T for 8 nb .. 8 nb + 7 of the tile's rows (MK_TC_X / 8 blocks when nblocks says so).
static __device__ __forceinline__ void mk_tc_scores(float s[][4], int nblocks, const u32 a[MK_TC_D / 16][4],
                                                    const u16 *tile, int d) {
MK_UNROLL
  for (int nb = 0; nb < nblocks; nb++) {
    s[nb][0] = s[nb][1] = s[nb][2] = s[nb][3] = 0.0f;
MK_UNROLL
    for (int ks = 0; ks < MK_TC_D / 16; ks++) {
      if (16 * ks >= d) break;
      u32 b[2];
      mk_tc_b_nk(b, tile, 8 * nb, 16 * ks);
      mk_tc_mma(s[nb], a[ks], b);
    }
  }
}

// acc += w x for the 16 x (16 ksteps) weights w (accumulator layout, 8 columns a block) and the
// tile's rows x (16 ksteps of them, [k][n]), d columns.
static __device__ __forceinline__ void mk_tc_weighted(float acc[MK_TC_D / 8][4], const float w[][4], int ksteps,
                                                      const u16 *tile, int d) {
MK_UNROLL
  for (int kk = 0; kk < ksteps; kk++) {
    u32 a[4] = {mk_tc_pack(w[2 * kk][0], w[2 * kk][1]), mk_tc_pack(w[2 * kk][2], w[2 * kk][3]),
                mk_tc_pack(w[2 * kk + 1][0], w[2 * kk + 1][1]), mk_tc_pack(w[2 * kk + 1][2], w[2 * kk + 1][3])};
MK_UNROLL
    for (int nb = 0; nb < MK_TC_D / 8; nb++) {
      if (8 * nb >= d) break;
      u32 b[2];
      mk_tc_b_kn(b, tile, 16 * kk, 8 * nb);
      mk_tc_mma(acc[nb], a, b);
    }
  }
}

static __device__ __forceinline__ void mk_tc_zero(float acc[MK_TC_D / 8][4]) {
MK_UNROLL
  for (int nb = 0; nb < MK_TC_D / 8; nb++) acc[nb][0] = acc[nb][1] = acc[nb][2] = acc[nb][3] = 0.0f;
}

// out row r (rows g, g + 8 of the warp's, those below n) = acc * f[r] at columns d.
static __device__ void mk_tc_store(float *out, i64 os, int n, const float acc[MK_TC_D / 8][4], const float f[2], int d) {
  int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3;
MK_UNROLL
  for (int nb = 0; nb < MK_TC_D / 8; nb++)
MK_UNROLL
    for (int e = 0; e < 4; e++) {
      int row = g + 8 * (e >> 1), col = 8 * nb + 2 * t + (e & 1);
      if (row < n && col < d) out[row * os + col] = acc[nb][e] * f[e >> 1];
    }
}

// The forward (o != NULL) or the statistics (stats: lse, and D = dy . o from o, dy) of the blocks'
// query tiles, the softmax online. With sinks, m starts at the head's sink and l ends with
// exp(sink - m).
static __device__ void mk_attn_tc_fwd_body(MkAttnTcShared *sh, const float *q, const float *k, const float *v,
                                           const float *sinks, float *o, const float *dy, const float *oin, float *stats,
                                           int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, R = blockDim.x / 2;   // 16 rows a warp
  int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, wq = (threadIdx.x >> 5) * 16, tiles = (seq + R - 1) / R;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  MK_FOR_BLOCKS(w, (i64)(rows / seq) * heads * tiles) {
    int i0 = (int)(w % tiles) * R, h = (int)(w / tiles % heads), b = (int)(w / tiles / heads), j = h / group;
    int last = (i0 + R < seq ? i0 + R : seq) - 1, first = mk_attn_first(i0, window), qa = i0 + wq;
    i64 r0 = (i64)b * seq;
    u32 qf[MK_TC_D / 16][4];
    mk_tc_load_a(qf, q + (r0 + qa) * qcols + (i64)h * d, qcols, seq - qa, d);
    float acc[MK_TC_D / 8][4], m[2], l[2] = {0.0f, 0.0f};
    mk_tc_zero(acc);
    m[0] = m[1] = sinks ? sinks[h] : -3.40282347e38f;   // below every finite score
    const float *kh = k + r0 * kcols + (i64)j * d, *vh = v + r0 * kcols + (i64)j * d;
    for (int t0 = first; t0 <= last; t0 += MK_TC_X) {
      int nt = last + 1 - t0 < MK_TC_X ? last + 1 - t0 : MK_TC_X;
      __syncthreads();
      mk_tc_stage(sh->a, kh + (i64)t0 * kcols, kcols, nt, MK_TC_X, d);
      if (o) mk_tc_stage(sh->b, vh + (i64)t0 * kcols, kcols, nt, MK_TC_X, d);
      __syncthreads();
      if (MK_TC_SKIP(t0 > qa + 15 || (window > 0 && t0 + MK_TC_X <= qa - window + 1))) continue;
      float s[MK_TC_X / 8][4], mx[2] = {m[0], m[1]};
      mk_tc_scores(s, MK_TC_X / 8, qf, sh->a, d);
MK_UNROLL
      for (int nb = 0; nb < MK_TC_X / 8; nb++)
MK_UNROLL
        for (int e = 0; e < 4; e++) {
          int i = qa + g + 8 * (e >> 1), key = t0 + 8 * nb + 2 * t + (e & 1);
          bool on = key < t0 + nt && key <= i && key >= mk_attn_first(i, window);
          s[nb][e] = on ? s[nb][e] * scale : -MK_INF;
          mx[e >> 1] = s[nb][e] > mx[e >> 1] ? s[nb][e] : mx[e >> 1];
        }
      for (int r = 0; r < 2; r++) {
        mx[r] = fmaxf(mx[r], mk_tc_xor(mx[r], 1));
        mx[r] = fmaxf(mx[r], mk_tc_xor(mx[r], 2));
      }
      float alpha[2] = {MK_TC_EXP(m[0] - mx[0]), MK_TC_EXP(m[1] - mx[1])};
      m[0] = mx[0], m[1] = mx[1], l[0] *= alpha[0], l[1] *= alpha[1];
MK_UNROLL
      for (int nb = 0; nb < MK_TC_D / 8; nb++)
MK_UNROLL
        for (int e = 0; e < 4; e++) acc[nb][e] *= alpha[e >> 1];
MK_UNROLL
      for (int nb = 0; nb < MK_TC_X / 8; nb++)
MK_UNROLL
        for (int e = 0; e < 4; e++) {
          float p = s[nb][e] == -MK_INF ? 0.0f : MK_TC_EXP(s[nb][e] - m[e >> 1]);
          s[nb][e] = p;
          l[e >> 1] += p;
        }
      if (o) mk_tc_weighted(acc, s, MK_TC_X / 16, sh->b, d);
    }
    for (int r = 0; r < 2; r++) {
      l[r] += mk_tc_xor(l[r], 1);
      l[r] += mk_tc_xor(l[r], 2);
      if (sinks) l[r] += MK_TC_EXP(sinks[h] - m[r]);
    }
    if (o) {
      float f[2] = {1.0f / l[0], 1.0f / l[1]};
      mk_tc_store(o + (r0 + qa) * qcols + (i64)h * d, qcols, seq - qa, acc, f, d);
    } else if (t < 2 && qa + g + 8 * t < seq) {   // lane t = 0 row g, t = 1 row g + 8
      i64 r = r0 + qa + g + 8 * t, at = r * qcols + (i64)h * d;
      float D = 0.0f;
      for (int c = 0; c < d; c++) D += dy[at + c] * oin[at + c];
      stats[r * 2 * heads + h] = (t ? m[1] : m[0]) + logf(t ? l[1] : l[0]);
      stats[r * 2 * heads + heads + h] = D;
    }
  }
}

// ---- mk_attn_fwd ----
extern "C" __global__ void mk_attn_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq,
                                       int heads, int kv, int qcols, int window, float qk_scale) {
  __shared__ MkAttnShared sh;
  mk_attn_fwd_body(&sh, q, k, v, 0, o, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_sink_fwd ----
extern "C" __global__ void mk_attn_sink_fwd(const float *q, const float *k, const float *v, const float *sinks, float *o,
                                            int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  __shared__ MkAttnShared sh;
  mk_attn_fwd_body(&sh, q, k, v, sinks, o, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_stats ----
extern "C" __global__ void mk_attn_stats(const float *dy, const float *q, const float *k, const float *o,
                                         float *stats, int rows, int seq, int heads, int kv, int qcols, int window, float qk_scale) {
  __shared__ MkAttnShared sh;
  mk_attn_stats_body(&sh, dy, q, k, o, 0, stats, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_sink_stats ----
extern "C" __global__ void mk_attn_sink_stats(const float *dy, const float *q, const float *k, const float *o,
                                              const float *sinks, float *stats, int rows, int seq, int heads, int kv,
                                              int qcols, int window, float qk_scale) {
  __shared__ MkAttnShared sh;
  mk_attn_stats_body(&sh, dy, q, k, o, sinks, stats, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_sink_grad ----
// The sinks' gradient, as rt_attn_sink_grad: a thread per head, -sum over rows ascending of
// exp(sink - lse) * D.
extern "C" __global__ void mk_attn_sink_grad(const float *stats, const float *sinks, float *dsinks, int rows, int heads) {
  MK_FOR(h, heads) {
    float sum = 0.0f;
    for (int r = 0; r < rows; r++)
      sum += mk_exp(sinks[h] - stats[(i64)r * 2 * heads + h]) * stats[(i64)r * 2 * heads + heads + h];
    dsinks[h] = -sum;
  }
}

// ---- mk_attn_grad_q ----
// dq of a tile of query rows, as rt_attn_grad_q: per step of keys p = exp(q.k * scale - lse),
// dS = p (dy.v - D), dq += dS k in key order; dq * scale at the end.
extern "C" __global__ void mk_attn_grad_q(const float *dy, const float *q, const float *k, const float *v,
                                          const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                          int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  __shared__ MkAttnShared sh;
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, heads)) {
    MkAttnTile T = mk_attn_tile(w, seq, heads);
    int j = T.h / group, last = (T.i0 + T.R < seq ? T.i0 + T.R : seq) - 1, na = last + 1 - T.i0;
    int first = mk_attn_first(T.i0, window), lo = mk_attn_first(T.i, window);
    i64 r0 = (i64)T.b * seq, r = r0 + T.i;
    float lse = T.active ? stats[r * 2 * heads + T.h] : 0.0f, D = T.active ? stats[r * 2 * heads + heads + T.h] : 0.0f;
    const float *qt = q + (r0 + T.i0) * qcols + (i64)T.h * d, *yt = dy + (r0 + T.i0) * qcols + (i64)T.h * d;
    const float *kh = k + r0 * kcols + (i64)j * d, *vh = v + r0 * kcols + (i64)j * d;
    for (int col0 = 0; col0 < d; col0 += MK_ATTN_D) {
      float acc[MK_ATTN_D / 8];
      mk_attn_zero(acc);
      for (int t0 = first; t0 <= last; t0 += MK_ATTN_X) {
        int nt = last + 1 - t0 < MK_ATTN_X ? last + 1 - t0 : MK_ATTN_X, xlo, xhi;
        float s[MK_ATTN_U], u2[MK_ATTN_U];
        mk_attn_dots(s, &sh, &T, qt, na, qcols, kh + (i64)t0 * kcols, nt, kcols, d);
        mk_attn_dots(u2, &sh, &T, yt, na, qcols, vh + (i64)t0 * kcols, nt, kcols, d);
        mk_attn_key_range(&T, t0, nt, lo, &xlo, &xhi);
        for (int u = 0; u < MK_ATTN_U; u++) {
          int x = 4 * T.g + u;
          float p = mk_exp(s[u] * scale - lse);
          sh.w[T.r * MK_ATTN_WPAD + x] = x >= xlo && x <= xhi ? p * (u2[u] - D) : 0.0f;
        }
        __syncthreads();
        mk_attn_wsum(acc, &sh, &T, sh.w + T.r * MK_ATTN_WPAD, kh + (i64)t0 * kcols, nt, kcols, col0, d, xlo, xhi);
      }
      if (T.active) mk_attn_store(dqkv + r * width + (i64)T.h * d, acc, &T, col0, d, 2, scale);
    }
  }
}

// ---- mk_attn_grad_kv ----
// dk and dv of a tile of keys of one kv head, as rt_attn_grad_kv (no atomics): for each head of
// the group in order, steps over the queries i >= the tile's first key (under a window W, up to
// its last key's t + W - 1); key t takes the queries t <= i < t + W: p = exp(q.k * scale - lse),
// dS = p (dy.v - D), dk += dS q, dv += p dy in query order; dk * scale at the end.
extern "C" __global__ void mk_attn_grad_kv(const float *dy, const float *q, const float *k, const float *v,
                                           const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                           int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  __shared__ MkAttnShared sh;
  MK_FOR_BLOCKS(w, mk_attn_items(rows, seq, kv)) {
    MkAttnTile T = mk_attn_tile(w, seq, kv);   // T.h: the kv head, T.i: this thread's key t
    int j = T.h, t = T.i, last = (T.i0 + T.R < seq ? T.i0 + T.R : seq) - 1, na = last + 1 - T.i0;
    int end = window > 0 && last + window < seq ? last + window : seq;   // the tile's queries end before
    int stop = window > 0 && t + window < seq ? t + window : seq;        // this key's
    i64 r0 = (i64)T.b * seq, r = r0 + t;
    const float *kt = k + (r0 + T.i0) * kcols + (i64)j * d, *vt = v + (r0 + T.i0) * kcols + (i64)j * d;
    for (int col0 = 0; col0 < d; col0 += MK_ATTN_D) {
      float ak[MK_ATTN_D / 8], av[MK_ATTN_D / 8];
      mk_attn_zero(ak);
      mk_attn_zero(av);
      for (int h = j * group; h < (j + 1) * group; h++) {
        const float *qh = q + r0 * qcols + (i64)h * d, *yh = dy + r0 * qcols + (i64)h * d;
        for (int i0 = T.i0; i0 < end; i0 += MK_ATTN_X) {
          int ni = end - i0 < MK_ATTN_X ? end - i0 : MK_ATTN_X;
          float s[MK_ATTN_U], u2[MK_ATTN_U];
          mk_attn_dots(s, &sh, &T, kt, na, kcols, qh + (i64)i0 * qcols, ni, qcols, d);
          mk_attn_dots(u2, &sh, &T, vt, na, kcols, yh + (i64)i0 * qcols, ni, qcols, d);
          int xlo = t > i0 ? t - i0 : 0, xhi = stop - 1 - i0 < ni - 1 ? stop - 1 - i0 : ni - 1;
          if (!T.active) xlo = 1, xhi = 0;
          for (int u = 0; u < MK_ATTN_U; u++) {
            int x = 4 * T.g + u;
            bool on = x >= xlo && x <= xhi;
            float p = 0.0f, ds = 0.0f;
            if (on) {
              i64 ri = r0 + i0 + x;
              p = mk_exp(s[u] * scale - stats[ri * 2 * heads + h]);
              ds = p * (u2[u] - stats[ri * 2 * heads + heads + h]);
            }
            sh.w[T.r * MK_ATTN_WPAD + x] = ds;
            sh.w2[T.r * MK_ATTN_WPAD + x] = p;
          }
          __syncthreads();
          mk_attn_wsum(ak, &sh, &T, sh.w + T.r * MK_ATTN_WPAD, qh + (i64)i0 * qcols, ni, qcols, col0, d, xlo, xhi);
          mk_attn_wsum(av, &sh, &T, sh.w2 + T.r * MK_ATTN_WPAD, yh + (i64)i0 * qcols, ni, qcols, col0, d, xlo, xhi);
        }
      }
      if (T.active) {
        mk_attn_store(dqkv + r * width + qcols + (i64)j * d, ak, &T, col0, d, 2, scale);
        mk_attn_store(dqkv + r * width + qcols + kcols + (i64)j * d, av, &T, col0, d, 0, 0.0f);
      }
    }
  }
}

// ---- mk_attn_tc_fwd ----
// attn.causal on tensor cores (dtype bf16): see the prelude's "attention on tensor cores".
extern "C" __global__ void mk_attn_tc_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq,
                                          int heads, int kv, int qcols, int window, float qk_scale) {
  __shared__ MkAttnTcShared sh;
  mk_attn_tc_fwd_body(&sh, q, k, v, 0, o, 0, 0, 0, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_tc_sink_fwd ----
extern "C" __global__ void mk_attn_tc_sink_fwd(const float *q, const float *k, const float *v, const float *sinks,
                                               float *o, int rows, int seq, int heads, int kv, int qcols, int window,
                                               float qk_scale) {
  __shared__ MkAttnTcShared sh;
  mk_attn_tc_fwd_body(&sh, q, k, v, sinks, o, 0, 0, 0, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_tc_stats ----
extern "C" __global__ void mk_attn_tc_stats(const float *dy, const float *q, const float *k, const float *o,
                                            float *stats, int rows, int seq, int heads, int kv, int qcols, int window,
                                            float qk_scale) {
  __shared__ MkAttnTcShared sh;
  mk_attn_tc_fwd_body(&sh, q, k, 0, 0, 0, dy, o, stats, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_tc_sink_stats ----
extern "C" __global__ void mk_attn_tc_sink_stats(const float *dy, const float *q, const float *k, const float *o,
                                                 const float *sinks, float *stats, int rows, int seq, int heads, int kv,
                                                 int qcols, int window, float qk_scale) {
  __shared__ MkAttnTcShared sh;
  mk_attn_tc_fwd_body(&sh, q, k, 0, sinks, 0, dy, o, stats, rows, seq, heads, kv, qcols, window, qk_scale);
}

// ---- mk_attn_tc_grad_q ----
// dq on tensor cores: a warp's 16 query rows against steps of MK_TC_X keys: s = q k^T, u = dy v^T,
// dS = exp(s * scale - lse) (u - D), dq += dS k; dq * scale at the end.
extern "C" __global__ void mk_attn_tc_grad_q(const float *dy, const float *q, const float *k, const float *v,
                                             const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                             int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols, R = blockDim.x / 2;
  int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, wq = (threadIdx.x >> 5) * 16, tiles = (seq + R - 1) / R;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  __shared__ MkAttnTcShared sh;
  MK_FOR_BLOCKS(w, (i64)(rows / seq) * heads * tiles) {
    int i0 = (int)(w % tiles) * R, h = (int)(w / tiles % heads), b = (int)(w / tiles / heads), j = h / group;
    int last = (i0 + R < seq ? i0 + R : seq) - 1, first = mk_attn_first(i0, window), qa = i0 + wq;
    i64 r0 = (i64)b * seq;
    float lse[2], D[2];
    for (int r = 0; r < 2; r++) {
      int i = qa + g + 8 * r;
      lse[r] = i < seq ? stats[(r0 + i) * 2 * heads + h] : 0.0f;
      D[r] = i < seq ? stats[(r0 + i) * 2 * heads + heads + h] : 0.0f;
    }
    u32 qf[MK_TC_D / 16][4], yf[MK_TC_D / 16][4];
    mk_tc_load_a(qf, q + (r0 + qa) * qcols + (i64)h * d, qcols, seq - qa, d);
    mk_tc_load_a(yf, dy + (r0 + qa) * qcols + (i64)h * d, qcols, seq - qa, d);
    float acc[MK_TC_D / 8][4];
    mk_tc_zero(acc);
    const float *kh = k + r0 * kcols + (i64)j * d, *vh = v + r0 * kcols + (i64)j * d;
    for (int t0 = first; t0 <= last; t0 += MK_TC_X) {
      int nt = last + 1 - t0 < MK_TC_X ? last + 1 - t0 : MK_TC_X;
      __syncthreads();
      mk_tc_stage(sh.a, kh + (i64)t0 * kcols, kcols, nt, MK_TC_X, d);
      mk_tc_stage(sh.b, vh + (i64)t0 * kcols, kcols, nt, MK_TC_X, d);
      __syncthreads();
      if (MK_TC_SKIP(t0 > qa + 15 || (window > 0 && t0 + MK_TC_X <= qa - window + 1))) continue;
      float s[MK_TC_X / 8][4], u[MK_TC_X / 8][4];
      mk_tc_scores(s, MK_TC_X / 8, qf, sh.a, d);
      mk_tc_scores(u, MK_TC_X / 8, yf, sh.b, d);
MK_UNROLL
      for (int nb = 0; nb < MK_TC_X / 8; nb++)
MK_UNROLL
        for (int e = 0; e < 4; e++) {
          int r = e >> 1, i = qa + g + 8 * r, key = t0 + 8 * nb + 2 * t + (e & 1);
          bool on = key < t0 + nt && key <= i && key >= mk_attn_first(i, window);
          s[nb][e] = on ? MK_TC_EXP(s[nb][e] * scale - lse[r]) * (u[nb][e] - D[r]) : 0.0f;
        }
      mk_tc_weighted(acc, s, MK_TC_X / 16, sh.a, d);
    }
    float f[2] = {scale, scale};
    mk_tc_store(dqkv + (r0 + qa) * width + (i64)h * d, width, seq - qa, acc, f, d);
  }
}

// ---- mk_attn_tc_grad_kv ----
// dk and dv on tensor cores: a warp's 16 keys of one kv head, for each head of the group in order,
// against steps of MK_TC_XQ queries i >= the block's first key (under a window W, below its last
// key + W): s^T = k q^T, u^T = v dy^T, p = exp(s * scale - lse_i), dS = p (u - D_i); dv += p^T dy,
// dk += dS^T q; dk * scale at the end.
extern "C" __global__ void mk_attn_tc_grad_kv(const float *dy, const float *q, const float *k, const float *v,
                                              const float *stats, float *dqkv, int rows, int seq, int heads, int kv,
                                              int qcols, int window, float qk_scale) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols, R = blockDim.x / 2;
  int g = (threadIdx.x & 31) >> 2, t = threadIdx.x & 3, wk = (threadIdx.x >> 5) * 16, tiles = (seq + R - 1) / R;
  float scale = qk_scale > 0 ? qk_scale : 1.0f / sqrtf((float)d);
  __shared__ MkAttnTcShared sh;
  MK_FOR_BLOCKS(w, (i64)(rows / seq) * kv * tiles) {
    int i0 = (int)(w % tiles) * R, j = (int)(w / tiles % kv), b = (int)(w / tiles / kv), ka = i0 + wk;
    int last = (i0 + R < seq ? i0 + R : seq) - 1;
    int end = window > 0 && last + window < seq ? last + window : seq;   // the block's queries end before
    i64 r0 = (i64)b * seq;
    u32 kf[MK_TC_D / 16][4], vf[MK_TC_D / 16][4];
    mk_tc_load_a(kf, k + (r0 + ka) * kcols + (i64)j * d, kcols, seq - ka, d);
    mk_tc_load_a(vf, v + (r0 + ka) * kcols + (i64)j * d, kcols, seq - ka, d);
    float dk[MK_TC_D / 8][4], dv[MK_TC_D / 8][4];
    mk_tc_zero(dk);
    mk_tc_zero(dv);
    for (int h = j * group; h < (j + 1) * group; h++) {
      const float *qh = q + r0 * qcols + (i64)h * d, *yh = dy + r0 * qcols + (i64)h * d;
      for (int q0 = i0; q0 < end; q0 += MK_TC_XQ) {
        int nq = end - q0 < MK_TC_XQ ? end - q0 : MK_TC_XQ;
        __syncthreads();
        mk_tc_stage(sh.a, qh + (i64)q0 * qcols, qcols, nq, MK_TC_XQ, d);
        mk_tc_stage(sh.b, yh + (i64)q0 * qcols, qcols, nq, MK_TC_XQ, d);
        if (threadIdx.x < MK_TC_XQ) {
          i64 ri = r0 + q0 + threadIdx.x;
          sh.lse[threadIdx.x] = (int)threadIdx.x < nq ? stats[ri * 2 * heads + h] : 0.0f;
          sh.dd[threadIdx.x] = (int)threadIdx.x < nq ? stats[ri * 2 * heads + heads + h] : 0.0f;
        }
        __syncthreads();
        if (MK_TC_SKIP(q0 + MK_TC_XQ <= ka || (window > 0 && q0 >= ka + 15 + window))) continue;
        float s[MK_TC_XQ / 8][4], u[MK_TC_XQ / 8][4];
        mk_tc_scores(s, MK_TC_XQ / 8, kf, sh.a, d);
        mk_tc_scores(u, MK_TC_XQ / 8, vf, sh.b, d);
MK_UNROLL
        for (int nb = 0; nb < MK_TC_XQ / 8; nb++)
MK_UNROLL
          for (int e = 0; e < 4; e++) {
            int key = ka + g + 8 * (e >> 1), x = 8 * nb + 2 * t + (e & 1), i = q0 + x;
            bool on = x < nq && key < seq && i >= key && (window <= 0 || i < key + window);
            float p = on ? MK_TC_EXP(s[nb][e] * scale - sh.lse[x]) : 0.0f;
            s[nb][e] = p * (u[nb][e] - sh.dd[x]);
            u[nb][e] = p;
          }
        mk_tc_weighted(dv, u, MK_TC_XQ / 16, sh.b, d);
        mk_tc_weighted(dk, s, MK_TC_XQ / 16, sh.a, d);
      }
    }
    float fk[2] = {scale, scale}, fv[2] = {1.0f, 1.0f};
    mk_tc_store(dqkv + (r0 + ka) * width + qcols + (i64)j * d, width, seq - ka, dk, fk, d);
    mk_tc_store(dqkv + (r0 + ka) * width + qcols + kcols + (i64)j * d, width, seq - ka, dv, fv, d);
  }
}

// ---- mk_cols_slice ----
extern "C" __global__ void mk_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  MK_FOR(p, (i64)rows * width) y[p] = x[p / width * cols + offset + p % width];
}

// ---- mk_heads_slice ----
// MLA's parts of heads, one thread per output element, as runtime/kernels/attn.c.
extern "C" __global__ void mk_heads_slice(const float *x, float *y, int rows, int cols, int heads, int offset, int width) {
  int d = cols / heads;
  MK_FOR(p, (i64)rows * heads * width) {
    i64 rh = p / width;   // row * heads + head
    y[p] = x[rh / heads * cols + rh % heads * d + offset + p % width];
  }
}

// ---- mk_heads_place ----
extern "C" __global__ void mk_heads_place(const float *x, float *y, int rows, int heads, int offset, int width, int d) {
  MK_FOR(p, (i64)rows * heads * d) {
    int c = (int)(p % d);
    y[p] = c >= offset && c < offset + width ? x[p / d * width + (c - offset)] : 0.0f;
  }
}

// ---- mk_heads_cat ----
extern "C" __global__ void mk_heads_cat(const float *a, const float *b, float *y, int rows, int cols_a, int cols_b, int heads,
                                        int a_heads) {
  int wa = cols_a / a_heads, wb = cols_b / heads, w = wa + wb;
  MK_FOR(p, (i64)rows * heads * w) {
    int c = (int)(p % w);
    i64 rh = p / w, r = rh / heads;
    int h = (int)(rh % heads);
    y[p] = c < wa ? a[r * cols_a + (i64)(a_heads == 1 ? 0 : h) * wa + c] : b[r * cols_b + (i64)h * wb + (c - wa)];
  }
}

// ---- mk_heads_sum ----
extern "C" __global__ void mk_heads_sum(const float *x, float *y, int rows, int cols, int heads) {
  int w = cols / heads;
  MK_FOR(p, (i64)rows * w) {
    i64 r = p / w;
    int c = (int)(p % w);
    float s = 0.0f;
    for (int h = 0; h < heads; h++) s += x[r * cols + (i64)h * w + c];
    y[p] = s;
  }
}
