// The feed-forward CUDA kernels beside cuBLAS's GEMMs: biases (dense and per expert) and the
// activations GELU, ReLU, SiLU, squared ReLU and gpt-oss's clamped SwiGLU; the siblings of
// runtime/kernels/ffn.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: GELU ----
// GELU's s = 1 / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3), as runtime/kernels/ffn.c.
#define MK_GELU_C 0.7978845608028654f
#define MK_GELU_A 0.044715f
__device__ float mk_gelu_s(float v) { return 1.0f / (1.0f + mk_exp(-2.0f * MK_GELU_C * (v + MK_GELU_A * v * v * v))); }

// ---- prelude: activations, one element ----
// One element of each activation and its gradient: what the kernels below compute per element
// and what the fused kernels (ir/scalar.def, codegen/fused.c) call, so both do the same float
// operations. mk_f_gelu: x * s (rt_gelu); mk_f_gelu_grad: +0 where dy is zero (an expert's empty
// slots), without the exp (rt_gelu_grad); mk_f_silu: x * s, s = 1 / (1 + mk_exp(-x)) (rt_silu).
__device__ __forceinline__ float mk_f_gelu(float v) { return v * mk_gelu_s(v); }
__device__ __forceinline__ float mk_f_gelu_grad(float dy, float v) {
  if (dy == 0.0f) return 0.0f;
  float s = mk_gelu_s(v);
  float du = MK_GELU_C * (1.0f + 3.0f * MK_GELU_A * v * v);
  return dy * (s + 2.0f * v * s * (1.0f - s) * du);
}
__device__ __forceinline__ float mk_f_relu(float v) { return v > 0.0f ? v : 0.0f; }
__device__ __forceinline__ float mk_f_relu_grad(float dy, float v) { return v > 0.0f ? dy : 0.0f; }
__device__ __forceinline__ float mk_f_silu(float v) { return v * (1.0f / (1.0f + mk_exp(-v))); }
__device__ __forceinline__ float mk_f_silu_grad(float dy, float v) {
  float sg = 1.0f / (1.0f + mk_exp(-v));
  return dy * sg * (1.0f + v * (1.0f - sg));
}
// gpt-oss's clamped SwiGLU of (gate g, up u), runtime/rt_fused.h's rt_oss_* and rt_fv_oss*: g' =
// min(g, 7), u' = clamp(u, -7, 7), s = 1 / (1 + mk_exp(-1.702 g')); mk_f_oss: (u' + 1) (g' s);
// mk_f_oss_grad_gate: dy (u' + 1) s (1 + 1.702 g' (1 - s)) where g <= 7; mk_f_oss_grad_up:
// dy (g' s) where -7 <= u <= 7; else, and where dy is zero (an expert's empty slots, without the
// exp), +0.
#define MK_OSS_ALPHA 1.702f
#define MK_OSS_LIMIT 7.0f
__device__ __forceinline__ float mk_oss_gate(float g) { return g > MK_OSS_LIMIT ? MK_OSS_LIMIT : g; }
__device__ __forceinline__ float mk_oss_up(float u) {
  return u < -MK_OSS_LIMIT ? -MK_OSS_LIMIT : u > MK_OSS_LIMIT ? MK_OSS_LIMIT : u;
}
__device__ __forceinline__ float mk_oss_s(float g) { return 1.0f / (1.0f + mk_exp(-MK_OSS_ALPHA * mk_oss_gate(g))); }
__device__ __forceinline__ float mk_f_oss(float g, float u) { return (mk_oss_up(u) + 1.0f) * (mk_oss_gate(g) * mk_oss_s(g)); }
__device__ __forceinline__ float mk_f_oss_grad_gate(float dy, float g, float u) {
  if (dy == 0.0f || !(g <= MK_OSS_LIMIT)) return 0.0f;
  float s = mk_oss_s(g);
  return (dy * (mk_oss_up(u) + 1.0f)) * (s * (1.0f + MK_OSS_ALPHA * mk_oss_gate(g) * (1.0f - s)));
}
__device__ __forceinline__ float mk_f_oss_grad_up(float dy, float g, float u) {
  if (dy == 0.0f || !(u >= -MK_OSS_LIMIT && u <= MK_OSS_LIMIT)) return 0.0f;
  return dy * (mk_oss_gate(g) * mk_oss_s(g));
}

// ---- prelude: rows plus a bias ----
// y[r, c] = x[r, c] + b[r / rows_per_bias, c]: rows strided over the blocks, columns over the
// threads (no 64-bit division per element; any grid covers every row).
static __device__ void mk_rows_bias(const float *x, const float *b, float *y, i64 nrows, int rows_per_bias, int n) {
  MK_FOR_BLOCKS(r, nrows) {
    const float *xr = x + r * n, *br = b + (r / rows_per_bias) * n;
    float *yr = y + r * n;
    for (int c = threadIdx.x; c < n; c += blockDim.x) yr[c] = xr[c] + br[c];
  }
}

// ---- mk_bias ----
extern "C" __global__ void mk_bias(const float *x, const float *b, float *y, int rows, int n) {
  mk_rows_bias(x, b, y, rows, rows > 0 ? rows : 1, n);
}

// ---- prelude: column sums ----
// db[ex, c] = the sum over the rows of dy[ex, :, c] (times x[ex, :, c] when x is not NULL), for e
// blocks of rows x n (rt_bias_grad, rt_expert_bias_grad, rt_scale_cols_grad_w). A block takes a
// tile of mk_colsum_width columns of one block of rows at a time (tiles strided over the grid);
// its blockDim.x / width row lanes each sum every lanes-th row in double, in four running sums so
// that four loads are in flight, and the lanes' sums are added in lane order: the same bits for a
// shape and block size on every run and device, whatever the grid. Tiles are 32 columns wide
// (128-byte rows) when there are at least 1024 of them, else 8 (32-byte sectors, more row lanes,
// four times the tiles): a 2048-wide bias has 256 tiles, not 64 blocks for 132 SMs. (One thread
// per column had 2 to 64 K threads reading a column each: 0.2 to 0.5 TB/s on an H200.)
static __device__ int mk_colsum_width(int e, int n, int block) {
  int w = (i64)e * ((n + 31) / 32) >= 1024 ? 32 : 8;
  return block < w ? block : w;
}
// Tile t of the column sums (of tiles = e * ceil(n / width) in all): every thread of the block
// takes part (it synchronises). dy and x are loaders, dy(i) the element at flat index i of [e,
// rows, n], each element loaded once; with_x: the sum of dy * x, else of dy.
// The fused kernels (codegen/fused.c) run several column sums' tiles, each with its own shape's
// width, in one launch.
// keep(r): whether row r of the e x rows rows is summed (a row it leaves out holds zeros: a fused
// group over expert slots adds only the rows below the counts, codegen/fused.c).
template <class D, class X, class K>
static __device__ void mk_colsum_tile_of(D dy, X x, K keep, bool with_x, float *db, int e, int rows, int n, i64 t) {
  __shared__ double mk_colsum[MK_BLOCK];
  const int cols = mk_colsum_width(e, n, blockDim.x), lanes = blockDim.x / cols;
  const int cl = threadIdx.x % cols, rl = threadIdx.x / cols;
  const i64 per = (n + cols - 1) / cols;
  i64 ex = t / per;
  int c = (int)(t % per) * cols + cl;
  double acc = 0.0;
  if (c < n && rl < lanes) {
    i64 base = ex * rows * n + c;
    double a[4] = {0.0, 0.0, 0.0, 0.0};
    int u = 0;
    if (with_x)
      for (int r = rl; r < rows; r += lanes, u = (u + 1) & 3) {
        if (keep(ex * rows + r)) a[u] += (double)dy(base + (i64)r * n) * x(base + (i64)r * n);
      }
    else
      for (int r = rl; r < rows; r += lanes, u = (u + 1) & 3) {
        if (keep(ex * rows + r)) a[u] += dy(base + (i64)r * n);
      }
    acc = (a[0] + a[1]) + (a[2] + a[3]);
  }
  mk_colsum[threadIdx.x] = acc;
  __syncthreads();
  if (rl == 0 && c < n) {
    double sum = 0.0;
    for (int l = 0; l < lanes; l++) sum += mk_colsum[l * cols + cl];
    db[ex * n + c] = (float)sum;
  }
  __syncthreads();
}
static __device__ void mk_colsum_tile(const float *dy, const float *x, float *db, int e, int rows, int n, i64 t) {
  mk_colsum_tile_of([&](i64 i) { return dy[i]; }, [&](i64 i) { return x ? x[i] : 0.0f; }, [&](i64) { return true; },
                    x != NULL, db, e, rows, n, t);
}
static __device__ void mk_column_sums(const float *dy, const float *x, float *db, int e, int rows, int n) {
  const int cols = mk_colsum_width(e, n, blockDim.x);
  const i64 tiles = (i64)e * ((n + cols - 1) / cols);
  for (i64 t = blockIdx.x; t < tiles; t += gridDim.x) mk_colsum_tile(dy, x, db, e, rows, n, t);
}

// ---- mk_bias_grad ----
// Launched with one block per tile of columns (cg_cuda_column_tiles).
extern "C" __global__ void mk_bias_grad(const float *dy, float *db, int rows, int n) {
  mk_column_sums(dy, NULL, db, 1, rows, n);
}

// ---- mk_expert_bias ----
extern "C" __global__ void mk_expert_bias(const float *x, const float *b, float *y, int e, int rows, int n) {
  if (rows > 0) mk_rows_bias(x, b, y, (i64)e * rows, rows, n);
}

// ---- mk_expert_bias_grad ----
// Launched with one block per tile of an expert's columns (cg_cuda_column_tiles).
extern "C" __global__ void mk_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) {
  mk_column_sums(dy, NULL, db, e, rows, n);
}

// ---- mk_expert_scale ----
extern "C" __global__ void mk_expert_scale(const float *x, const float *w, float *y, int e, int rows, int n) {
  MK_FOR(i, (i64)e * rows * n) y[i] = x[i] * w[i % n];
}

// ---- prelude: the filled rows of an expert GEMM's operand ----
// mk_expert_counts's body, for fp32 operands and for the bf16 copies a dtype bf16 GEMM reads: the
// element is not zero (NaN counts; -0 is zero).
__device__ __forceinline__ bool mk_not_zero(const float *x, i64 j) { return !(x[j] == 0.0f); }
__device__ __forceinline__ bool mk_not_zero(const u16 *x, i64 j) { return (x[j] & 0x7fffu) != 0u; }
template <class T>
__device__ void mk_counts(const T *x, int *counts, float *c, int groups, int rows, int width, int cwidth, int part) {
  int parts = (rows + part - 1) / part;
  int *top = counts + 4 * groups, *done = counts + 5 * groups;   // zeros between launches
  i64 chunk = width >= 4 * MK_BLOCK ? 1 : (4 * MK_BLOCK + width - 1) / width;   // rows a read
  MK_FOR_BLOCKS(w, (i64)groups * parts) {
    int g = (int)(w / parts);
    i64 lo = w % parts * part, hi = lo + part < rows ? lo + part : rows;
    const T *xg = x + g * (i64)rows * width;
    float last = -1.0f;   // a row number (exact in a float below 2^24 rows)
    for (i64 top_row = hi; top_row > lo && last < 0.0f; top_row -= chunk) {
      i64 from = top_row - chunk > lo ? top_row - chunk : lo;
      float mine = -1.0f;
      for (i64 j = from * width + threadIdx.x; j < top_row * width; j += blockDim.x)
        if (mk_not_zero(xg, j)) mine = (float)(j / width);
      last = mk_block_max(mine);   // the same on every thread: the loop ends together
    }
    // cwidth < 0: nothing reads those rows of c (-cwidth wide): left as they are (NaN on the host builds)
    int cw = cwidth < 0 ? -cwidth : cwidth;
    float *cg = c + g * (i64)rows * cw, past = cwidth < 0 ? MK_NAN : 0.0f;
    if (cwidth > 0 || MK_POISON)
      for (i64 j = ((i64)last + 1 > lo ? (i64)last + 1 : lo) * cw + threadIdx.x; j < hi * cw; j += blockDim.x) cg[j] = past;
    if (cwidth < 0 && lo == 0 && last < 0)   // row 0 zeroed all the same (the GEMM writes it when the block is not empty)
      for (i64 j = threadIdx.x; j < cw; j += blockDim.x) cg[j] = 0.0f;
    if (threadIdx.x == 0) {
      atomicMax(&top[g], (int)last + 1);
      __threadfence();
      if (atomicAdd(&done[g], 1) == parts - 1) {   // the group's last part: every part's maximum is in
        __threadfence();
        int count = atomicExch(&top[g], 0), plus = count < rows ? count + 1 : rows;
        atomicExch(&done[g], 0);
        counts[g] = count;
        counts[groups + g] = count > 0 ? count : 1;
        counts[2 * groups + g] = counts[3 * groups + g] = plus;
      }
    }
  }
}

// ---- mk_expert_counts ----
// The filled rows of each block of slots of an expert GEMM's operand x [groups, rows, width]:
// counts[g] = 1 + the last row of block g holding an element that is not zero, 0 when none does,
// so every row of a block at or past its count is zero; counts[groups + g] = max(counts[g], 1),
// the sums a weight gradient over the filled slots takes (one zero row for an expert nobody was
// routed to: a sum of zero products, not an empty one); counts[2 groups + g] and counts[3 groups +
// g] = min(counts[g] + 1, rows), the rows of a GEMM over act(h + b1) (the forward's second GEMM,
// codegen/launch.c's share_counts: the filled rows and the first empty one, act(b1), whose
// product mk_expert_rows_fill then copies into the rest). counts[4 groups ..] and [5 groups ..]
// are the kernel's own: zeros before a launch (the device memory is zeroed at the start) and
// after it.
//   - The blocks take the parts of `part` rows of every block of slots (one block a part, over
//     the grid): a block reads its part from the last row back, a chunk of rows at a time (at
//     least MK_BLOCK * 4 elements), and stops at the first chunk holding an element that is not
//     zero. So the whole GPU reads, the empty slots and a chunk a part (not the whole buffer).
//   - The rows of c [groups, rows, cwidth] past its part's last such row a block zeroes (cwidth
//     0: none): every row at or past the count, and the zero rows of x below it that end a part,
//     which the GEMM over the filled rows then writes (it writes every row below the count).
//     cwidth < 0 (c is -cwidth wide): nothing reads c's rows past the counts (codegen/launch.c's
//     filled rows: its readers take the counts too), so they are left as they are (MK_POISON:
//     NaN on the host builds), but for row 0 of an empty block, zeroed: a weight gradient of an
//     empty block sums that row (its K is 1), so it holds what the padded program has there.
//   - A block's part's last row goes to the block of slots' maximum (atomicMax, an order-free
//     maximum: the same counts whatever the blocks' order), and the last of its parts to arrive
//     writes the counts from it and sets the maximum and the arrivals back to zero.
extern "C" __global__ void mk_expert_counts(const float *x, int *counts, float *c, int groups, int rows, int width,
                                            int cwidth, int part) {
  mk_counts(x, counts, c, groups, rows, width, cwidth, part);
}

// ---- mk_expert_counts_bf16 ----
// The same from the bf16 copy of the operand (dtype bf16: what the GEMM reads).
extern "C" __global__ void mk_expert_counts_bf16(const u16 *x, int *counts, float *c, int groups, int rows, int width,
                                                 int cwidth, int part) {
  mk_counts(x, counts, c, groups, rows, width, cwidth, part);
}

// ---- mk_expert_counts_route ----
// The same counts from the routing instead of the data (codegen/facts.c, cg_expert_rows: the
// operand is order.encode's or order.decode.grad_y's result over these idx and loc): counts[G] of
// block G = (expert e, routing group gi), G = e*g + gi, is 1 + the largest location of a kept
// choice (idx e, 0 <= loc < rows) of a token of group gi, 0 when none; every row at or past it is
// an empty slot, which the order zeroed, so these counts bound the data's (they pass them where a
// routed token's row is zero). counts[groups + G] .. counts[3 groups + G] as mk_expert_counts.
// The blocks take the parts of `part` rows of every block of slots (one block a part, over the
// grid); each reads its routing group's choices (a few thousand ints, from the cache) for the count,
// zeroes its part's rows of c [groups, rows, cwidth] at or past it (cwidth 0: none; cwidth < 0:
// none, NaN where MK_POISON, but an empty block's row 0), and the first part's block writes the
// counts: no atomics, nothing kept between launches.
extern "C" __global__ void mk_expert_counts_route(const int *idx, int *counts, float *c, int groups, int rows, int s,
                                                  int cwidth, int part, const int *loc, int k, int g) {
  if (g < 1) g = 1;
  int parts = (rows + part - 1) / part;
  MK_FOR_BLOCKS(w, (i64)groups * parts) {
    int G = (int)(w / parts), e = G / g, gi = G % g;
    i64 lo = w % parts * part, hi = lo + part < rows ? lo + part : rows;
    i64 c0 = (i64)mk_group_begin(s, g, gi) * k, c1 = (i64)mk_group_begin(s, g, gi + 1) * k;
    float mine = -1.0f;   // a location (exact in a float below 2^24 rows)
    for (i64 ch = c0 + threadIdx.x; ch < c1; ch += blockDim.x)
      if (idx[ch] == e && loc[ch] >= 0 && loc[ch] < rows && (float)loc[ch] > mine) mine = (float)loc[ch];
    int count = (int)mk_block_max(mine) + 1;
    int cw = cwidth < 0 ? -cwidth : cwidth;
    float *cg = c + (i64)G * rows * cw, past = cwidth < 0 ? MK_NAN : 0.0f;
    if (cwidth > 0 || MK_POISON)
      for (i64 j = (count > lo ? count : lo) * (i64)cw + threadIdx.x; j < hi * cw; j += blockDim.x) cg[j] = past;
    if (cwidth < 0 && lo == 0 && count == 0)   // an empty block's row 0 zeroed all the same (mk_expert_counts)
      for (i64 j = threadIdx.x; j < cw; j += blockDim.x) cg[j] = 0.0f;
    if (lo == 0 && threadIdx.x == 0) {
      counts[G] = count;
      counts[groups + G] = count > 0 ? count : 1;
      counts[2 * groups + G] = counts[3 * groups + G] = count < rows ? count + 1 : rows;
    }
  }
}

// ---- mk_expert_rows_fill ----
// After a GEMM over the rows plus[g] of each block of c [groups, rows, cwidth] (mk_expert_counts'
// counts plus one: the filled rows and the first empty one), each block's rows past them become
// copies of its row plus[g] - 1: the product of act(b1), which every empty slot holds, as the CPU
// program's GEMM over the segments copies a repeated row's product (runtime/kernels/ffn.c). A
// block of threads a row (over the grid): the rows below the count cost a read of it.
extern "C" __global__ void mk_expert_rows_fill(const int *plus, float *c, int groups, int rows, int cwidth) {
  MK_FOR_BLOCKS(w, (i64)groups * rows) {
    i64 g = w / rows;
    int n = plus[g];
    if (w % rows < n) continue;
    const float *src = c + (g * rows + n - 1) * cwidth;
    for (int j = threadIdx.x; j < cwidth; j += blockDim.x) c[w * cwidth + j] = src[j];
  }
}

// ---- mk_expert_rows_zero ----
// After a GEMM over the rows counts[g] of each block of c [groups, rows, cwidth] that another
// GEMM's mk_expert_counts counted (the same operand: SwiGLU's x W1 and x W3), the rows past them
// zeroed, as that count kernel zeroes its own GEMM's. A block of threads a row, as
// mk_expert_rows_fill. cwidth < 0 (c is -cwidth wide; a block of threads a block of slots): nothing
// reads the rows past the counts (codegen/launch.c), so only an empty block's row 0 is zeroed (a
// weight gradient of an empty block sums that row), as mk_expert_counts does.
extern "C" __global__ void mk_expert_rows_zero(const int *counts, float *c, int groups, int rows, int cwidth) {
  if (cwidth < 0) {
    MK_FOR_BLOCKS(g, groups)
    if (counts[g] == 0)
      for (int j = threadIdx.x; j < -cwidth; j += blockDim.x) c[g * rows * (i64)-cwidth + j] = 0.0f;
    return;
  }
  MK_FOR_BLOCKS(w, (i64)groups * rows) {
    if (w % rows < counts[w / rows]) continue;
    for (int j = threadIdx.x; j < cwidth; j += blockDim.x) c[w * cwidth + j] = 0.0f;
  }
}

// ---- mk_expert_gemm_tc ----
// rt_cuda_expert_gemm_rows on the tensor cores (moec's grouped GEMM: runtime/cuda/rt_cuda.c runs it
// for a dtype bf16 program where the cuBLASLt loaded has no grouped GEMM): c [e, m, n] = op(a)
// [e, m, k] op(b) [e, k, n] with a and b the GEMM's bf16 copies and fp32 sums (ta: a is stored
// [e, k, m]; tb: b [e, n, k]), over the rows mk_expert_counts counted, which it reads here: no
// synchronisation with the host, the same launch inside a CUDA graph. !ta: an expert's m rows are
// `blocks` blocks of slots, and of block g (of e * blocks) only the first rows[g] are multiplied
// and written (mk_expert_counts zeroed the others). ta (a weight gradient: blocks 1, !tb): expert
// x's sum over its first rows[x] slots (its k), every element of c written (zeros for an expert
// with none).
//   - A block of 128 threads takes a 128 x 128 tile of c, one warp 64 x 64 of it (4 x 8 mma.sync
//     m16n8k16 a k step of 16), and steps over k 32 at a time: both operands' 128 x 32 pieces go
//     to shared memory by cp.async, two stages (the next step's copies in flight while this one
//     multiplies), and into fragments by ldmatrix (transposed where the operand's tile rows are
//     its contiguous dimension: a when ta, b when !tb; rows 8 bf16 apart in padding, so that a
//     fragment's 8 rows fall on distinct banks).
//   - Tiles past their block's count return at once (the grid covers every slot; the tiles of the
//     empty slots cost a read of the count); what is copied past the count or the edges is zeros.
//   - The launch (rt_cuda.c) asks 16-byte aligned a and b and each operand's contiguous dimension a
//     multiple of 8 (k for a when !ta, m when ta; n for b when !tb, k when tb): a 16-byte copy is
//     then in or out whole.
#define MK_GT 128                         // a tile's rows and columns
#define MK_GT_K 32                        // k a step
#define MK_GT_LD (MK_GT_K + 8)            // a staged tile row whose k is contiguous
#define MK_GT_LDT (MK_GT + 8)             // a staged k row (the tile's rows contiguous)
#define MK_GT_STAGE (MK_GT * MK_GT_LD)    // bf16 an operand a stage (>= MK_GT_K * MK_GT_LDT)

// One operand's tile at x (its element (row 0, k 0)), rows r < rows and k < ks of it, as bf16
// into s: [row][k] (rows MK_GT_LD apart) when its k is contiguous in memory (row r at x + r ld),
// else [k][row] (MK_GT_LDT apart; k row j at x + j ld). Zeros elsewhere. Every thread calls it.
static __device__ __forceinline__ void mk_gt_stage(u16 *s, const u16 *x, i64 ld, bool kcont, int rows, int ks) {
MK_UNROLL
  for (int i = 0; i < MK_GT * MK_GT_K / 8 / 128; i++) {
    int c = (int)threadIdx.x + 128 * i;
    if (kcont) {
      int r = c >> 2, j = (c & 3) * 8;
      bool in = r < rows && j < ks;
      mk_cp16(s + r * MK_GT_LD + j, in ? x + r * ld + j : x, in);
    } else {
      int j = c >> 4, r = (c & 15) * 8;
      bool in = j < ks && r < rows;
      mk_cp16(s + j * MK_GT_LDT + r, in ? x + j * ld + r : x, in);
    }
  }
}

extern "C" __global__ void mk_expert_gemm_tc(const u16 *a, const u16 *b, float *c, const int *rows, int e, int m,
                                             int n, int k, int ta, int tb, int blocks) {
  __shared__ MK_ALIGN16 u16 sa[2][MK_GT_STAGE];
  __shared__ MK_ALIGN16 u16 sb[2][MK_GT_STAGE];
  int groups = ta ? e : e * blocks, per = ta ? m : m / blocks;   // per: the rows of c of a group
  int mt = (per + MK_GT - 1) / MK_GT, nt = (n + MK_GT - 1) / MK_GT;
  int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = threadIdx.x >> 5;
  int wm = (warp & 1) * 64, wn = (warp >> 1) * 64;
  int li = lane & 7, l1 = (lane >> 3) & 1, l2 = lane >> 4;   // ldmatrix: a lane's row of matrix 2 l2 + l1
  int bm = (ta ? 1 : blocks) * mt;   // an expert's row tiles
  for (i64 tile = blockIdx.x; tile < (i64)groups * mt * nt; tile += gridDim.x) {
    // An expert's row tiles next to each other, then its column tiles: the blocks running together
    // share b's columns (an expert's weights, the larger operand, read from memory about once).
    int rt = (int)(tile % bm), n0 = (int)(tile / bm % nt) * MK_GT, x = (int)(tile / ((i64)bm * nt));
    int grp = ta ? x : x * blocks + rt / mt, r0 = rt % mt * MK_GT, count = rows[grp];
    int rlim = ta ? m : count < per ? count : per;   // c's rows to compute
    int klim = ta ? (count < k ? count : k) : k;     // and the k to sum over
    if (r0 >= rlim) continue;                        // the same on every thread
    // The tiles at k 0: a's rows r0.. (of the group), b's columns n0...
    const u16 *pa = ta ? a + ((i64)x * k) * m + r0 : a + ((i64)grp * per + r0) * k;
    const u16 *pb = tb ? b + ((i64)x * n + n0) * k : b + ((i64)x * k) * n + n0;
    i64 lda = ta ? m : k, ldb = tb ? k : n;
    float acc[4][8][4];
MK_UNROLL
    for (int i = 0; i < 4; i++)
MK_UNROLL
      for (int j = 0; j < 8; j++) acc[i][j][0] = acc[i][j][1] = acc[i][j][2] = acc[i][j][3] = 0.0f;
    int steps = (klim + MK_GT_K - 1) / MK_GT_K;
    if (steps > 0) {
      mk_gt_stage(sa[0], pa, lda, !ta, rlim - r0, klim);
      mk_gt_stage(sb[0], pb, ldb, tb, n - n0, klim);
    }
    mk_cp_commit();
    for (int st = 0; st < steps; st++) {
      if (st + 1 < steps) {   // the next step's copies
        int k0 = (st + 1) * MK_GT_K;
        mk_gt_stage(sa[(st + 1) & 1], pa + (ta ? k0 * lda : k0), lda, !ta, rlim - r0, klim - k0);
        mk_gt_stage(sb[(st + 1) & 1], pb + (tb ? k0 : k0 * ldb), ldb, tb, n - n0, klim - k0);
      }
      mk_cp_commit();
      mk_cp_wait<1>();   // this step's copies are in
      __syncthreads();
      const u16 *xa = sa[st & 1], *xb = sb[st & 1];
MK_UNROLL
      for (int kk = 0; kk < MK_GT_K; kk += 16) {
        u32 fa[4][4], fb[8][2];
MK_UNROLL
        for (int i = 0; i < 4; i++) {
          int r = wm + 16 * i;
          if (!ta) mk_tc_ldsm4(fa[i], xa + (r + li + 8 * l1) * MK_GT_LD + kk + 8 * l2);
          else mk_tc_ldsm4_t(fa[i], xa + (kk + li + 8 * l2) * MK_GT_LDT + r + 8 * l1);
        }
MK_UNROLL
        for (int j = 0; j < 4; j++) {   // columns wn + 16 j .. + 15: two n8 blocks
          int q = wn + 16 * j;
          u32 f[4];
          if (tb) mk_tc_ldsm4(f, xb + (q + li + 8 * l2) * MK_GT_LD + kk + 8 * l1);
          else mk_tc_ldsm4_t(f, xb + (kk + li + 8 * l1) * MK_GT_LDT + q + 8 * l2);
          fb[2 * j][0] = f[0], fb[2 * j][1] = f[1], fb[2 * j + 1][0] = f[2], fb[2 * j + 1][1] = f[3];
        }
MK_UNROLL
        for (int i = 0; i < 4; i++)
MK_UNROLL
          for (int j = 0; j < 8; j++) mk_tc_mma(acc[i][j], fa[i], fb[j]);
      }
      __syncthreads();   // before the next copies overwrite this stage
    }
    float *cg = c + ((i64)grp * per + r0) * n;
MK_UNROLL
    for (int i = 0; i < 4; i++)
MK_UNROLL
      for (int h = 0; h < 2; h++) {
        int r = wm + 16 * i + g + 8 * h;
        if (r0 + r >= rlim) continue;
MK_UNROLL
        for (int j = 0; j < 8; j++) {
          int col = n0 + wn + 8 * j + 2 * t;
          mk_st_pair(cg + (i64)r * n + col, col, n, acc[i][j][2 * h], acc[i][j][2 * h + 1]);
        }
      }
  }
}

// ---- prelude: moec's grouped GEMM on wgmma ----
// mk_expert_gemm_tc's GEMM (the same parameters, forms and rows; see there) on Hopper's warpgroup
// MMA, in mk_expert_gemm_wg (tiles of 128 x 128) and mk_expert_gemm_wg256 (128 x 256): wgmma.mma_async
// m64nNk16 (bf16 operands from shared memory, fp32 sums in registers), compute capability 9.0
// only. They are compiled apart from a program's other kernels, for sm_90a (the architecture-
// specific target wgmma needs: codegen/target_cuda.c), and the runtime runs one in
// mk_expert_gemm_tc's place where it loaded and agreed with it at the program's start
// (runtime/cuda/session.c, rt_cuda_wg_start). Elsewhere (sm_80, sm_90's portable module) what
// follows is compiled out, their bodies are empty and nothing launches them.
//   - A block of 256 threads (two warpgroups) takes a 128 x N tile of c, a warpgroup 64 rows of
//     it (N / 2 accumulators a thread); k goes 64 a step through MK_WG_STAGES buffers of shared
//     memory, filled by cp.async two steps ahead while the tensor cores multiply the step before
//     (each buffer is rewritten only after every warpgroup's MMAs on it completed: the barrier of
//     the step after).
//   - Shared memory holds each operand in the tensor cores' 128-byte swizzled layouts (PTX ISA,
//     "shared memory matrix layout"), described to them by a 64-bit matrix descriptor: an operand
//     whose k is contiguous in memory (a when !ta, b when tb) K-major, row r's 16-byte chunk j at
//     byte 128 r + 16 (j ^ (r & 7)) of the tile; the others (a when ta, b when !tb) MN-major,
//     blocks of 64 rows (an atom, 8192 bytes apart: the descriptor's leading offset) by 8 k (1024
//     bytes apart: its stride offset), k row j's chunk x at byte 128 j + 16 (x ^ j) of the block.
//     The buffers start on 1024-byte boundaries (the swizzle's period), so the descriptors' base
//     offset is 0; a k step of 16 moves a K-major descriptor 32 bytes, an MN-major one 2048.
//   - cp.async writes shared memory through the generic proxy and wgmma reads it through the async
//     proxy: fence.proxy.async between them, before the barrier.
//   - The host builds (fake device, emulation) run the same code with the MMA computed at once by
//     each thread for its own accumulators, reading shared memory through the descriptors it is
//     given with the layouts above (address, strides, swizzle), so the descriptors and the copies'
//     swizzle are checked there; the MMAs' asynchrony and the tensor cores' roundings are not.
#define MK_WG_M 128                                   // a tile's rows (mk_expert_gemm_tc's)
#define MK_WG_K 64                                    // k a step
#define MK_WG_STAGES 4                                // buffers (copies two steps ahead)
#define MK_WG_ABYTES (MK_WG_M * MK_WG_K * 2)          // bytes of a's buffer (16384); b's: N / 128 of that
// The launch's dynamic shared memory for tiles N wide (128: mk_expert_gemm_wg, 256: _wg256).
#define MK_WG_SHARED(N) (MK_WG_STAGES * (MK_WG_ABYTES + (N) * MK_WG_K * 2) + 1024)

// The matrix descriptor of shared memory at byte addr (of the shared window): 128-byte swizzle,
// leading and stride byte offsets lbo, sbo.
static __device__ __forceinline__ u64 mk_wg_desc(u32 addr, u32 lbo, u32 sbo) {
  return (u64)((addr & 0x3ffff) >> 4) | (u64)((lbo & 0x3ffff) >> 4) << 16 | (u64)((sbo & 0x3ffff) >> 4) << 32 |
         (u64)1 << 62;
}

#if defined(__CUDACC__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MK_WG 1
// d (this thread's N / 2 accumulators of the warpgroup's 64 x N) += a b over k 16, a and b
// described by da, db; TA, TB: a (b) MN-major. sm: unused here (the host builds' shared memory).
template <int TA, int TB, int N> struct MkWgMma;
// The accumulators' operands: MK_WG_D8(i) d[i .. i + 7], MK_WG_D64(i) d[i .. i + 63]; the register
// lists of the first 64 and the next 64 (one line each: the embedding keeps no line continuation).
#define MK_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define MK_WG_D64(i) MK_WG_D8(i), MK_WG_D8(i + 8), MK_WG_D8(i + 16), MK_WG_D8(i + 24), MK_WG_D8(i + 32), MK_WG_D8(i + 40), MK_WG_D8(i + 48), MK_WG_D8(i + 56)
#define MK_WG_R0 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define MK_WG_R64 "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
template <int TA, int TB> struct MkWgMma<TA, TB, 128> {
  static __device__ __forceinline__ void run(float *d, u64 da, u64 db) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %68, 0; "
                 "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {" MK_WG_R0 "}, %64, %65, p, 1, 1, %66, %67; }"
                 : MK_WG_D64(0)
                 : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));
  }
};
template <int TA, int TB> struct MkWgMma<TA, TB, 256> {
  static __device__ __forceinline__ void run(float *d, u64 da, u64 db) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %132, 0; "
                 "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16 {" MK_WG_R0 ", " MK_WG_R64
                 "}, %128, %129, p, 1, 1, %130, %131; }"
                 : MK_WG_D64(0), MK_WG_D64(64)
                 : "l"(da), "l"(db), "n"(TA), "n"(TB), "r"(1));
  }
};
template <int TA, int TB, int N>
static __device__ __forceinline__ void mk_wg_mma(float *d, u64 da, u64 db, const unsigned char *sm) {
  (void)sm;
  MkWgMma<TA, TB, N>::run(d, da, db);
}
static __device__ __forceinline__ void mk_wg_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
static __device__ __forceinline__ void mk_wg_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int n> static __device__ __forceinline__ void mk_wg_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(n) : "memory");
}
static __device__ __forceinline__ void mk_wg_proxy_fence() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// Keeps the compiler from moving the accumulators' reads and writes across the MMAs in flight.
template <int N> static __device__ __forceinline__ void mk_wg_pin(float *d) {
MK_UNROLL
  for (int i = 0; i < N / 2; i++) asm volatile("" : "+f"(d[i])::"memory");
}
#elif !defined(__CUDACC__)
#define MK_WG 1
// The host builds: element (r, q) of an operand (r its row of the MMA's m or n, q its k, 0..15)
// read through descriptor desc from shared memory sm (addresses relative to it), MN-major when
// mn: the canonical layouts' addresses, then the 128-byte swizzle on the address's bits 4-6
// (xor bits 7-9).
static float mk_wg_elem(u64 desc, bool mn, int r, int q, const unsigned char *sm) {
  u32 start = (u32)(desc & 0x3fff) << 4, lbo = (u32)(desc >> 16 & 0x3fff) << 4, sbo = (u32)(desc >> 32 & 0x3fff) << 4;
  u32 off = mn ? start + (u32)(r % 64) * 2 + (u32)(r / 64) * lbo + (u32)(q % 8) * 128 + (u32)(q / 8) * sbo
               : start + (u32)(r % 8) * 128 + (u32)(r / 8) * sbo + (u32)q * 2;
  off ^= (off >> 7 & 7) << 4;
  u16 v;
  memcpy(&v, sm + off, 2);
  return __uint_as_float((u32)v << 16);
}
template <int TA, int TB, int N>
static __device__ void mk_wg_mma(float *d, u64 da, u64 db, const unsigned char *sm) {
  int x = threadIdx.x & 127, warp = x >> 5, g = (x & 31) >> 2, t = x & 3;
  for (int i = 0; i < N / 2; i++) {
    int row = 16 * warp + g + 8 * ((i >> 1) & 1), col = 8 * (i >> 2) + 2 * t + (i & 1);
    float s = d[i];
    for (int q = 0; q < 16; q++) s += mk_wg_elem(da, TA, row, q, sm) * mk_wg_elem(db, TB, col, q, sm);
    d[i] = s;
  }
}
static __device__ void mk_wg_fence() {}
static __device__ void mk_wg_commit() {}
template <int n> static __device__ void mk_wg_wait() {}
static __device__ void mk_wg_proxy_fence() {}
template <int N> static __device__ void mk_wg_pin(float *d) { (void)d; }
#endif

#ifdef MK_WG
// One operand's R x MK_WG_K piece at x (its element (row 0, k 0); rows < rows, k < ks of it, zeros
// elsewhere) into the buffer s in its layout: K-major when its k is contiguous in memory (row r at
// x + r ld), else MN-major (k row j at x + j ld). Every thread calls it.
template <int R>
static __device__ __forceinline__ void mk_wg_stage(unsigned char *s, const u16 *x, i64 ld, bool kcont, int rows, int ks) {
MK_UNROLL
  for (int i = 0; i < R * MK_WG_K / 8 / 256; i++) {
    int c = (int)threadIdx.x + 256 * i;
    if (kcont) {
      int r = c >> 3, j = c & 7;
      bool in = r < rows && 8 * j < ks;
      mk_cp16((u16 *)(s + r * 128 + ((j ^ (r & 7)) << 4)), in ? x + r * ld + 8 * j : x, in);
    } else {
      int j = c / (R / 8), xc = c % (R / 8);   // k row j, 16-byte chunk xc of it (rows 8 xc ..)
      bool in = j < ks && 8 * xc < rows;
      mk_cp16((u16 *)(s + (xc >> 3) * 8192 + (j >> 3) * 1024 + (j & 7) * 128 + (((xc & 7) ^ (j & 7)) << 4)),
              in ? x + j * ld + 8 * xc : x, in);
    }
  }
}

// The MMAs of one k step of MK_WG_K: this warpgroup's rows of a's buffer sa, b's sb (shared-window
// addresses ua, ub), 4 k steps of 16.
template <int TA, int TB, int N>
static __device__ __forceinline__ void mk_wg_step(float *d, u32 ua, u32 ub, int wg, const unsigned char *sm) {
MK_UNROLL
  for (int kk = 0; kk < MK_WG_K / 16; kk++) {
    u64 da = TA ? mk_wg_desc(ua + wg * 8192 + kk * 2048, 8192, 1024) : mk_wg_desc(ua + wg * 8192 + kk * 32, 16, 1024);
    u64 db = TB ? mk_wg_desc(ub + kk * 2048, 8192, 1024) : mk_wg_desc(ub + kk * 32, 16, 1024);
    mk_wg_mma<TA, TB, N>(d, da, db, sm);
  }
}
#endif

#ifdef MK_WG
// The kernel's tiles (128 x N) with ta = TA, tb = !TB || TA (TA, TB: a, b MN-major in shared
// memory); sm: the buffers (a's MK_WG_STAGES, then b's), base its shared-window address.
template <int TA, int TB, int N>
static __device__ __forceinline__ void mk_wg_tiles(const u16 *a, const u16 *b, float *c, const int *rows, int e, int m,
                                                   int n, int k, int blocks, unsigned char *sm, u32 base) {
  const bool ta = TA, tb = !TB;
  const int bbytes = N * MK_WG_K * 2, boff = MK_WG_STAGES * MK_WG_ABYTES;
  int groups = ta ? e : e * blocks, per = ta ? m : m / blocks;
  int mt = (per + MK_WG_M - 1) / MK_WG_M, nt = (n + N - 1) / N;
  int wg = threadIdx.x >> 7, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3, warp = (threadIdx.x >> 5) & 3;
  int bm = (ta ? 1 : blocks) * mt;
  for (i64 tile = blockIdx.x; tile < (i64)groups * mt * nt; tile += gridDim.x) {
    int rt = (int)(tile % bm), n0 = (int)(tile / bm % nt) * N, x = (int)(tile / ((i64)bm * nt));
    int grp = ta ? x : x * blocks + rt / mt, r0 = rt % mt * MK_WG_M, count = rows[grp];
    int rlim = ta ? m : count < per ? count : per;
    int klim = ta ? (count < k ? count : k) : k;
    if (r0 >= rlim) continue;   // the same on every thread
    const u16 *pa = ta ? a + ((i64)x * k) * m + r0 : a + ((i64)grp * per + r0) * k;
    const u16 *pb = tb ? b + ((i64)x * n + n0) * k : b + ((i64)x * k) * n + n0;
    i64 lda = ta ? m : k, ldb = tb ? k : n;
    float d[N / 2];
MK_UNROLL
    for (int i = 0; i < N / 2; i++) d[i] = 0.0f;
    int steps = (klim + MK_WG_K - 1) / MK_WG_K;
    // Copies of steps 0 .. MK_WG_STAGES - 3 (one group each, empty past the last step).
MK_UNROLL
    for (int s = 0; s < MK_WG_STAGES - 2; s++) {
      if (s < steps) {
        int k0 = s * MK_WG_K;
        mk_wg_stage<MK_WG_M>(sm + s * MK_WG_ABYTES, pa + (ta ? k0 * lda : k0), lda, !ta, rlim - r0, klim - k0);
        mk_wg_stage<N>(sm + boff + s * bbytes, pb + (tb ? k0 : k0 * ldb), ldb, tb, n - n0, klim - k0);
      }
      mk_cp_commit();
    }
    for (int st = 0; st < steps; st++) {
      mk_cp_wait<MK_WG_STAGES - 3>();   // this thread's copies of step st are in
      mk_wg_proxy_fence();             // ... visible to the tensor cores
      __syncthreads();                 // every thread's; and every warpgroup's MMAs of step st - 2 done
      int nx = st + MK_WG_STAGES - 2;  // the copies of step nx go to the buffer step st - 2 used
      if (nx < steps) {
        int k0 = nx * MK_WG_K, sb = nx % MK_WG_STAGES;
        mk_wg_stage<MK_WG_M>(sm + sb * MK_WG_ABYTES, pa + (ta ? k0 * lda : k0), lda, !ta, rlim - r0, klim - k0);
        mk_wg_stage<N>(sm + boff + sb * bbytes, pb + (tb ? k0 : k0 * ldb), ldb, tb, n - n0, klim - k0);
      }
      mk_cp_commit();
      int sb = st % MK_WG_STAGES;
      mk_wg_pin<N>(d);
      mk_wg_fence();
      mk_wg_step<TA, TB, N>(d, base + sb * MK_WG_ABYTES, base + boff + sb * bbytes, wg, sm);
      mk_wg_commit();
      mk_wg_wait<1>();                 // step st - 1's MMAs are done (st's may run on)
      mk_wg_pin<N>(d);
    }
    mk_wg_wait<0>();
    mk_wg_pin<N>(d);
    // This warpgroup's 64 rows: register i of lane 4 g + t of warp w holds row 16 w + g + 8 (i >> 1 & 1),
    // column 8 (i >> 2) + 2 t + (i & 1).
    float *cg = c + ((i64)grp * per + r0 + 64 * wg) * n;
MK_UNROLL
    for (int h = 0; h < 2; h++) {
      int r = 16 * warp + g + 8 * h;
      if (r0 + 64 * wg + r >= rlim) continue;
MK_UNROLL
      for (int j = 0; j < N / 8; j++) {
        int col = n0 + 8 * j + 2 * t;
        mk_st_pair(cg + (i64)r * n + col, col, n, d[4 * j + 2 * h], d[4 * j + 2 * h + 1]);
      }
    }
    __syncthreads();   // every warpgroup's MMAs done before the next tile's copies
  }
}

// The kernel of tiles N wide: the buffers from the first 1024-byte boundary of the shared window on.
template <int N>
static __device__ __forceinline__ void mk_wg_gemm(const u16 *a, const u16 *b, float *c, const int *rows, int e, int m,
                                                  int n, int k, int ta, int tb, int blocks) {
  MK_DYN_SHARED(unsigned char, mk_wg_dyn);
#ifdef __CUDACC__
  u32 base = mk_tc_smem(mk_wg_dyn), pad = (1024 - (base & 1023)) & 1023;
  unsigned char *sm = mk_wg_dyn + pad;
  base += pad;
#else
  unsigned char *sm = (unsigned char *)(((uintptr_t)mk_wg_dyn + 1023) & ~(uintptr_t)1023);
  u32 base = 0;   // the emulation's addresses are relative to sm
#endif
  if (ta) mk_wg_tiles<1, 1, N>(a, b, c, rows, e, m, n, k, blocks, sm, base);
  else if (tb) mk_wg_tiles<0, 0, N>(a, b, c, rows, e, m, n, k, blocks, sm, base);
  else mk_wg_tiles<0, 1, N>(a, b, c, rows, e, m, n, k, blocks, sm, base);
}
#endif

// ---- mk_expert_gemm_wg ----
// The grouped GEMM on wgmma over tiles of 128 x 128 (the prelude's "moec's grouped GEMM on wgmma").
extern "C" __global__ void mk_expert_gemm_wg(const u16 *a, const u16 *b, float *c, const int *rows, int e, int m,
                                             int n, int k, int ta, int tb, int blocks) {
#ifdef MK_WG
  mk_wg_gemm<128>(a, b, c, rows, e, m, n, k, ta, tb, blocks);
#else
  (void)a, (void)b, (void)c, (void)rows, (void)e, (void)m, (void)n, (void)k, (void)ta, (void)tb, (void)blocks;
#endif
}

// ---- mk_expert_gemm_wg256 ----
// mk_expert_gemm_wg on tiles of 128 x 256 (each warpgroup's MMAs m64n256k16, 128 accumulators a
// thread; b's buffers twice as large: MK_WG_SHARED(256) of shared memory): a's tile read from L2
// once for twice the columns of c, which a GPU session's timing lines set against the 128-wide tiles
// (tests/cuda/gpu_check.cpp; MOERT_CUDA_WG_N=256 runs it in programs).
extern "C" __global__ void mk_expert_gemm_wg256(const u16 *a, const u16 *b, float *c, const int *rows, int e, int m,
                                                int n, int k, int ta, int tb, int blocks) {
#ifdef MK_WG
  mk_wg_gemm<256>(a, b, c, rows, e, m, n, k, ta, tb, blocks);
#else
  (void)a, (void)b, (void)c, (void)rows, (void)e, (void)m, (void)n, (void)k, (void)ta, (void)tb, (void)blocks;
#endif
}

// ---- mk_gelu ----
// The tanh GELU as x * s, s = 1 / (1 + exp(-2u)) = 0.5 (1 + tanh(u)), as rt_gelu computes it
// (cols, the row width, lets the CPU kernel copy repeated rows; every element is computed here).
extern "C" __global__ void mk_gelu(const float *x, float *y, i64 n, i64 cols) {
  MK_FOR(i, n) y[i] = mk_f_gelu(x[i]);
}

// ---- mk_gelu_grad ----
extern "C" __global__ void mk_gelu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = mk_f_gelu_grad(dy[i], x[i]);
}

// ---- mk_relu ----
extern "C" __global__ void mk_relu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = mk_f_relu(x[i]);
}

// ---- mk_relu_grad ----
extern "C" __global__ void mk_relu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = mk_f_relu_grad(dy[i], x[i]);
}

// ---- mk_silu ----
extern "C" __global__ void mk_silu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = mk_f_silu(x[i]);
}

// ---- mk_silu_grad ----
extern "C" __global__ void mk_silu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = mk_f_silu_grad(dy[i], x[i]);
}

// ---- mk_relu2 ----
// Squared ReLU, relu2's row in ir/activations.def as rt_relu2 computes it: x x where x > 0, else +0.
extern "C" __global__ void mk_relu2(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i] > 0.0f ? x[i] * x[i] : 0.0f;
}

// ---- mk_relu2_grad ----
// dy (2 x) where x > 0, else +0, as rt_relu2_grad.
extern "C" __global__ void mk_relu2_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = x[i] > 0.0f ? dy[i] * (2.0f * x[i]) : 0.0f;
}

// ---- mk_oss ----
extern "C" __global__ void mk_oss(const float *g, const float *u, float *y, i64 n) {
  MK_FOR(i, n) y[i] = mk_f_oss(g[i], u[i]);
}

// ---- mk_oss_grad_gate ----
extern "C" __global__ void mk_oss_grad_gate(const float *dy, const float *g, const float *u, float *dg, i64 n) {
  MK_FOR(i, n) dg[i] = mk_f_oss_grad_gate(dy[i], g[i], u[i]);
}

// ---- mk_oss_grad_up ----
extern "C" __global__ void mk_oss_grad_up(const float *dy, const float *g, const float *u, float *du, i64 n) {
  MK_FOR(i, n) du[i] = mk_f_oss_grad_up(dy[i], g[i], u[i]);
}
