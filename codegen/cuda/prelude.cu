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
