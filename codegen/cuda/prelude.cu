// The CUDA kernels of moec's CUDA target, one per row of runtime/kernels.def (mk_NAME), in one file
// per kernel family beside this one (elementwise.cu, ffn.cu, norm.cu, embed.cu, attn.cu, loss.cu,
// gate.cu, gate_loss.cu, order.cu, hook.cu, layout.cu, optim.cu), each the sibling of the CPU
// kernels of the same name in runtime/kernels/ (gate.cu <-> runtime/kernels/gate.c). This file is
// their shared prelude of __device__ helpers. Every kernel reproduces the CPU kernel of libmoert it
// stands for: the same formulas, the same order of choices.
//
// The build embeds the files (mk/embed_cuda.awk, in the Makefile's order: this one first); `moec
// build --target cuda` hands NVRTC the prelude and the kernels a module uses. In each file, what
// comes before its first "// ---- " line is its header comment (not embedded); a line
// "// ---- mk_NAME ----" starts kernel mk_NAME, any other "// ---- TITLE ----" line a section of
// the prelude (a family's own __device__ helpers), which runs to the next such line. Every prelude
// section of every file goes before every kernel, in file order, so a helper may use those of
// earlier sections. No #include (NVRTC has no system headers), extern "C" names, no host code.

// ---- prelude: types, grid-stride loops, routing groups, reductions ----
typedef long long i64;
typedef unsigned long long u64;
typedef unsigned int u32;
typedef unsigned short u16;
typedef signed char i8;

#define MK_INF __int_as_float(0x7f800000)
#define MK_BLOCK 256
#define MK_FOR(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)blockDim.x * gridDim.x)
#define MK_FOR_BLOCKS(b, n) for (i64 b = blockIdx.x; b < (i64)(n); b += gridDim.x)
#ifdef __CUDACC__
#define MK_UNROLL _Pragma("unroll")   // NVRTC unrolls the loop (register arrays stay in registers)
#else
#define MK_UNROLL                     // the host C++ builds of the library (fake device, emulation)
#endif
// Rows of an expert GEMM's result or a fused kernel's that nothing reads (codegen/launch.c's
// filled rows): the GPU leaves them as they are; the host builds write NaN there (MK_POISON), so
// that a read of one shows in the tests.
#ifdef __CUDACC__
#define MK_POISON 0
#else
#define MK_POISON 1
#endif
#define MK_NAN __int_as_float(0x7fc00000)
#define MK_NAN_BF16 ((u16)0x7fc0)
#ifndef MK_DYN_SHARED
#define MK_DYN_SHARED(T, name) extern __shared__ T name[]
#endif

__device__ __forceinline__ int mk_group_begin(int s, int g, int gi) { return (int)((i64)s * gi / g); }

// The routing group of token t: the gi with group_begin(gi) <= t < group_begin(gi + 1).
__device__ int mk_group_of(int s, int g, int t) {
  if (g < 1 || s < 1) return 0;
  int gi = (int)((i64)t * g / s);
  while (gi + 1 < g && mk_group_begin(s, g, gi + 1) <= t) gi++;
  while (gi > 0 && mk_group_begin(s, g, gi) > t) gi--;
  return gi;
}

__device__ __forceinline__ bool mk_kept(const int *loc, i64 c, int cap) { return loc[c] >= 0 && loc[c] < cap; }

// Row (in [e, g*cap, ...]) of kept choice c of a token in group gi.
__device__ __forceinline__ i64 mk_slot(const int *idx, const int *loc, i64 c, int gi, int cap, int g) {
  return ((i64)idx[c] * g + gi) * cap + loc[c];
}

// Block-wide reductions for kernels launched with MK_BLOCK threads: a fixed tree, so the
// result does not depend on timing (deterministic run to run). The host builds of the library
// (the fake device, the emulation) add the same tree in the same order on thread 0 between two
// barriers instead of one barrier per level: the same bits, 3 barriers instead of 10 (each a
// switch of every fiber on the fake device).
#ifndef __CUDACC__
__device__ double mk_block_sum(double v) {
  __shared__ double sh[MK_BLOCK];
  sh[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = MK_BLOCK / 2; w > 0; w >>= 1)
      for (int i = 0; i < w; i++) sh[i] += sh[i + w];
  __syncthreads();
  double r = sh[0];
  __syncthreads();
  return r;
}

__device__ float mk_block_max(float v) {
  __shared__ float sh[MK_BLOCK];
  sh[threadIdx.x] = v;
  __syncthreads();
  if (threadIdx.x == 0)
    for (int w = MK_BLOCK / 2; w > 0; w >>= 1)
      for (int i = 0; i < w; i++) sh[i] = fmaxf(sh[i], sh[i + w]);
  __syncthreads();
  float r = sh[0];
  __syncthreads();
  return r;
}
#else
__device__ double mk_block_sum(double v) {
  __shared__ double sh[MK_BLOCK];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = MK_BLOCK / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];
    __syncthreads();
  }
  double r = sh[0];
  __syncthreads();
  return r;
}

__device__ float mk_block_max(float v) {
  __shared__ float sh[MK_BLOCK];
  sh[threadIdx.x] = v;
  __syncthreads();
  for (int w = MK_BLOCK / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + w]);
    __syncthreads();
  }
  float r = sh[0];
  __syncthreads();
  return r;
}
#endif

// ---- counter-based randomness, bit for bit runtime/rng.c ----
__device__ u64 mk_mix(u64 z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}
__device__ u64 mk_key(u64 a, u64 b) { return mk_mix(a ^ mk_mix(b)); }
// runtime/rng.c's normal_pair, the same float operations in the same order (--fmad=false).
__device__ double mk_normal(u64 key, u64 i) {
  u64 h = mk_mix(key + (i >> 1) * 0x9e3779b97f4a7c15ULL);
  float x = (float)(int)(h >> 41) + 0.5f;
  u32 xb = __float_as_uint(x);
  int e = (int)(xb >> 23) - 127;
  float f = __uint_as_float((xb & 0x007fffffu) | 0x3f800000u);
  bool big = f > 1.41421356f;
  f = big ? 0.5f * f : f;
  e = big ? e + 1 : e;
  float s = (f - 1.0f) / (f + 1.0f), s2 = s * s;
  float lf = 2.0f * s * (1.0f + s2 * (0.333333343f + s2 * (0.2f + s2 * (0.142857149f + s2 * 0.111111112f))));
  float ln_u1 = (float)(e - 23) * 0.693147182f + lf;
  float r = sqrtf(-2.0f * ln_u1);
  u32 b = (u32)(h >> 17) & 0xffffffu, q = b >> 22;
  float psi = (((float)(b & 0x3fffffu) + 0.5f) * 2.38418579e-7f - 0.5f) * 1.57079633f, p2 = psi * psi;
  float c = 1.0f + p2 * (-0.5f + p2 * (4.16666679e-2f + p2 * (-1.38888892e-3f + p2 * 2.48015876e-5f)));
  float sn = psi * (1.0f + p2 * (-0.166666672f + p2 * (8.33333377e-3f + p2 * (-1.98412701e-4f + p2 * 2.75573188e-6f))));
  float cq = q == 0 ? c : q == 1 ? -sn : q == 2 ? -c : sn;
  float sq = q == 0 ? sn : q == 1 ? c : q == 2 ? -sn : -c;
  return (i & 1) ? r * sq : r * cq;
}

// exp from +, -, * and the exponent's bits: rt_exp (runtime/rt_internal.h), the same float
// operations in the same order, so with --fmad=false these kernels compute its bits.
__device__ float mk_exp(float x) {
  x = x < -87.0f ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  float t = x * 1.44269504f + 12582912.0f;
  float n = t - 12582912.0f;
  float r = (x - n * 0.693145751953125f) - n * 1.42860682e-6f;
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * __uint_as_float((__float_as_uint(t) - 0x4B400000u + 127u) << 23);
}

// ---- prelude: the logistic function (the silu kernels and the sigmoid gates) ----
__device__ float mk_sigmoid1(float v) {
  if (v >= 0.0f) return 1.0f / (1.0f + expf(-v));
  float z = expf(v);
  return z / (1.0f + z);
}
// One element of gate.sigmoid and of its gradient (dy, y): what mk_sigmoid, mk_sigmoid_grad and
// the fused kernels (ir/scalar.def) compute.
__device__ __forceinline__ float mk_f_sigmoid(float v) { return mk_sigmoid1(v); }
__device__ __forceinline__ float mk_f_sigmoid_grad(float dy, float y) { return dy * y * (1.0f - y); }

// ---- prelude: tensor cores (mma.sync, ldmatrix, cp.async) ----
// The primitives of the kernels on tensor cores (attention and the grouped expert GEMM of a dtype
// bf16 program): PTX's mma.sync m16n8k16 (bf16 operands, fp32 sums), ldmatrix (a warp's fragments
// from shared memory, transposed or not) and cp.async (global to shared memory without registers).
// The lanes of a fragment (PTX ISA, "matrix fragments for mma.m16n8k16"): lane = 4 g + t; A (16 x 16,
// row major) register e holds row g + 8 (e & 1), columns 2t, 2t + 1 (+ 8 when e >= 2); B (16 x 8)
// register e rows 2t, 2t + 1 (+ 8 e), column g; C (16 x 8) element e row g + 8 (e >> 1), column
// 2t + (e & 1); the lower column (or row) of a pair in the register's low half. The host builds of
// the library (the fake device, the emulation) run the same callers with mma.sync, the shuffles and
// ldmatrix emulated through shared memory and barriers (every thread of the block calls them the
// same number of times: the fake device's fibers switch there), each lane taking from its warp's
// others what the instruction would give it: the lanes' addresses and fragments are checked, not
// the tensor cores' roundings (the emulation's sums are fp32 in k order). cp.async is a plain copy
// there.
#ifdef __CUDACC__
#define MK_ALIGN16 __align__(16)
// d += a b on the tensor cores (a 16 x 16 bf16, b 16 x 8 bf16, d 16 x 8 fp32).
static __device__ __forceinline__ void mk_tc_mma(float d[4], const u32 a[4], const u32 b[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// v of lane ^ m of this warp.
static __device__ __forceinline__ float mk_tc_xor(float v, int m) { return __shfl_xor_sync(0xffffffffu, v, m); }
// lo and hi rounded to bf16 (nearest even), lo in the low half.
static __device__ __forceinline__ u32 mk_tc_pack(float lo, float hi) {
  u32 r;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
  return r;
}
static __device__ __forceinline__ u32 mk_tc_ld32(const u16 *p) { return *(const u32 *)p; }
static __device__ __forceinline__ void mk_tc_st32(u16 *p, u32 w) { *(u32 *)p = w; }
static __device__ __forceinline__ u32 mk_tc_smem(const void *p) {
  u32 s;
  asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(s) : "l"(p));
  return s;
}
// ldmatrix .x4: lanes 8j .. 8j + 7 give the rows (8 bf16, 16 bytes each) of matrix j at row (this
// lane's); r[j] gets this lane's pair of matrix j: row g, columns 2t, 2t + 1 (_t: transposed, rows 2t
// and 2t + 1 of column g).
static __device__ __forceinline__ void mk_tc_ldsm4(u32 r[4], const u16 *row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mk_tc_smem(row)));
}
static __device__ __forceinline__ void mk_tc_ldsm4_t(u32 r[4], const u16 *row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(mk_tc_smem(row)));
}
// 16 bytes from src to dst (shared memory), asynchronously; zeros when !in (src is not read).
static __device__ __forceinline__ void mk_cp16(u16 *dst, const u16 *src, bool in) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(mk_tc_smem(dst)), "l"(src), "r"(in ? 16 : 0));
}
static __device__ __forceinline__ void mk_cp_commit() { asm volatile("cp.async.commit_group;"); }
// Waits until at most n of this thread's committed groups are in flight.
template <int n> static __device__ __forceinline__ void mk_cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(n)); }
// Two floats to p (8-byte aligned) in one store.
static __device__ __forceinline__ void mk_st2(float *p, float a, float b) { *(float2 *)p = make_float2(a, b); }
#else
#define MK_ALIGN16
static __device__ void mk_tc_mma(float d[4], const u32 a[4], const u32 b[2]) {
  __shared__ u32 xa[MK_BLOCK][4], xb[MK_BLOCK][2];
  int x = threadIdx.x, base = x & ~31, g = (x & 31) >> 2, t = x & 3;
  for (int e = 0; e < 4; e++) xa[x][e] = a[e];
  xb[x][0] = b[0], xb[x][1] = b[1];
  __syncthreads();
  for (int e = 0; e < 4; e++) {
    int row = g + 8 * (e >> 1), col = 2 * t + (e & 1);
    float s = d[e];
    for (int k = 0; k < 16; k++) {
      u32 aw = xa[base + (row & 7) * 4 + (k & 7) / 2][(row >> 3) + 2 * (k >> 3)];
      u32 bw = xb[base + col * 4 + (k & 7) / 2][k >> 3];
      s += __uint_as_float((k & 1 ? aw >> 16 : aw & 0xffffu) << 16) * __uint_as_float((k & 1 ? bw >> 16 : bw & 0xffffu) << 16);
    }
    d[e] = s;
  }
  __syncthreads();
}
static __device__ float mk_tc_xor(float v, int m) {
  __shared__ float xv[MK_BLOCK];
  xv[threadIdx.x] = v;
  __syncthreads();
  float r = xv[threadIdx.x ^ m];
  __syncthreads();
  return r;
}
static __device__ u32 mk_tc_bf16(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;   // NaN stays NaN
  return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}
static __device__ u32 mk_tc_pack(float lo, float hi) { return mk_tc_bf16(lo) | mk_tc_bf16(hi) << 16; }
static __device__ u32 mk_tc_ld32(const u16 *p) { return p[0] | (u32)p[1] << 16; }
static __device__ void mk_tc_st32(u16 *p, u32 w) { p[0] = (u16)(w & 0xffffu), p[1] = (u16)(w >> 16); }
// ldmatrix: every lane's row pointer posted, then each lane takes its pairs from the rows its
// warp's lanes posted.
static __device__ void mk_tc_ldsm(u32 r[4], const u16 *row, bool trans) {
  __shared__ const u16 *xr[MK_BLOCK];
  int x = threadIdx.x, base = x & ~31, g = (x & 31) >> 2, t = x & 3;
  xr[x] = row;
  __syncthreads();
  for (int j = 0; j < 4; j++)
    if (trans) r[j] = xr[base + 8 * j + 2 * t][g] | (u32)xr[base + 8 * j + 2 * t + 1][g] << 16;
    else r[j] = xr[base + 8 * j + g][2 * t] | (u32)xr[base + 8 * j + g][2 * t + 1] << 16;
  __syncthreads();
}
static __device__ void mk_tc_ldsm4(u32 r[4], const u16 *row) { mk_tc_ldsm(r, row, false); }
static __device__ void mk_tc_ldsm4_t(u32 r[4], const u16 *row) { mk_tc_ldsm(r, row, true); }
static __device__ void mk_cp16(u16 *dst, const u16 *src, bool in) {
  for (int i = 0; i < 8; i++) dst[i] = in ? src[i] : (u16)0;
}
static __device__ void mk_cp_commit() {}
template <int n> static __device__ void mk_cp_wait() {}
static __device__ void mk_st2(float *p, float a, float b) { p[0] = a, p[1] = b; }
#endif
// Columns col and col + 1 of a row n wide (p at col) from an accumulator's pair: one store where
// both are in and 8-byte aligned (n even), else those in.
static __device__ __forceinline__ void mk_st_pair(float *p, int col, int n, float v0, float v1) {
  if (!(n & 1) && col + 1 < n) {
    mk_st2(p, v0, v1);
  } else {
    if (col < n) p[0] = v0;
    if (col + 1 < n) p[1] = v1;
  }
}
