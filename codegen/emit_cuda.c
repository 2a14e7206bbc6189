// The CUDA target's kernel emitter: the CUDA C translation unit of a module's device kernels,
// compiled by NVRTC (codegen/nvrtc.c) for sm_80 / sm_90 at `moec build` time.
//
// Every op kind of ops.def that is not a GEMM or a collective has one kernel, `mk_<op>`,
// parameterised by its shapes, that reproduces the CPU kernel of libmoert (runtime/kernels*.c,
// runtime/hooks.c) it stands for: the same formulas, the same order of choices, reductions in
// double. A module gets the kernels of the kinds it uses, each once, after a prelude of
// __device__ helpers (routing groups, block reductions, the counter-based RNG of runtime/rng.c,
// the 16-bit conversions of runtime/hooks.c on the bits). The unit is self-contained: no
// #include (NVRTC has no system headers), extern "C" names, no host code.
//
// Fused gate kernels: where a gate's softmax (or sigmoid), top-k and gather are consecutive ops
// of one function, one kernel (mk_gate_softmax_topk_gather / mk_gate_sigmoid_topk_gather) does
// the three per token, launched at the gather's position, and the three separate kernels are
// not needed for them.
//
// GEMMs (matmul, expert.matmul) go to cuBLAS and collectives (comm.*) to NCCL; the unit lists
// them in its header comment. With dtype bf16 (cg_bf16_gemms) the GEMMs take bf16 inputs: the
// unit also holds mk_compress_bf16, which the host program launches on each GEMM operand (a
// rounded copy, nearest even) before cuBLAS multiplies the copies with fp32 accumulation.
// Which kernels an op launches, with which grid and arguments, is data (cg_cuda_launch,
// cg_internal.h): after the kernels, the unit prints it as a comment, the
// launch plan (every op in program order), and the CUDA target's host program
// (emit_cuda_host.c) issues exactly those launches.
//
// Launch conventions: kernels with grid-stride loops (MK_FOR) take any grid; those documented
// "one block of MK_BLOCK threads" or "per row/choice/token ... MK_BLOCK" reduce with
// mk_block_sum / mk_block_max and must be launched with exactly MK_BLOCK (256) threads per
// block (cg_cuda_launch launches every kernel so); mk_aux_loss_grad takes e * sizeof(double)
// bytes of dynamic shared memory.
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "cg_internal.h"

typedef enum KernelId {
  K_ZERO,
  K_COPY,
  K_ADD,
  K_MUL,
  K_BIAS,
  K_BIAS_GRAD,
  K_EXPERT_BIAS,
  K_EXPERT_BIAS_GRAD,
  K_GELU,
  K_GELU_GRAD,
  K_RELU,
  K_RELU_GRAD,
  K_SILU,
  K_SILU_GRAD,
  K_L2NORM,
  K_L2NORM_GRAD,
  K_DIV_SCALAR,
  K_DIV_SCALAR_GRAD_X,
  K_DIV_SCALAR_GRAD_S,
  K_GATE_NOISE,
  K_SOFTMAX,
  K_SOFTMAX_GRAD,
  K_SIGMOID,
  K_SIGMOID_GRAD,
  K_SOFTMAX_TOKENS,
  K_SOFTMAX_TOKENS_GRAD,
  K_TOPK,
  K_GATE_GATHER,
  K_GATE_GATHER_GRAD,
  K_GATE_SOFTMAX_TOPK_GATHER,
  K_GATE_SIGMOID_TOPK_GATHER,
  K_GATE_LOCATIONS,
  K_EXPERT_CHOICE,
  K_IOTA,
  K_AUX_LOSS,
  K_AUX_LOSS_GRAD,
  K_Z_LOSS,
  K_Z_LOSS_GRAD,
  K_ORDER_ENCODE,
  K_ORDER_ENCODE_GRAD,
  K_ORDER_DECODE,
  K_ORDER_DECODE_GRAD_Y,
  K_ORDER_DECODE_GRAD_GATES,
  K_DISPATCH_MASK,
  K_COMBINE_WEIGHTS,
  K_COMBINE_WEIGHTS_GRAD,
  K_COMPRESS_F16,
  K_DECOMPRESS_F16,
  K_COMPRESS_BF16,
  K_DECOMPRESS_BF16,
  K_INT8_SCALES,
  K_COMPRESS_INT8,
  K_DECOMPRESS_INT8,
  K_RECORD_STATS,
  K_EXPERT_MAJOR,
  K_RANK_MAJOR,
  K_LAYOUT_CHUNK,
  K_LAYOUT_CONCAT,
  K_MSE,
  K_MSE_GRAD,
  K_SGD,
  K_ADAMW,
  K_COUNT
} KernelId;

static const char prelude_src[] =
    "// ---- prelude: types, grid-stride loops, routing groups, reductions ----\n"
    "typedef long long i64;\n"
    "typedef unsigned long long u64;\n"
    "typedef unsigned int u32;\n"
    "typedef unsigned short u16;\n"
    "typedef signed char i8;\n"
    "\n"
    "#define MK_INF __int_as_float(0x7f800000)\n"
    "#define MK_BLOCK 256\n"
    "#define MK_FOR(i, n) for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (i64)(n); i += (i64)blockDim.x * gridDim.x)\n"
    "#define MK_FOR_BLOCKS(b, n) for (i64 b = blockIdx.x; b < (i64)(n); b += gridDim.x)\n"
    "#ifndef MK_DYN_SHARED\n"
    "#define MK_DYN_SHARED(T, name) extern __shared__ T name[]\n"
    "#endif\n"
    "\n"
    "__device__ __forceinline__ int mk_group_begin(int s, int g, int gi) { return (int)((i64)s * gi / g); }\n"
    "\n"
    "// The routing group of token t: the gi with group_begin(gi) <= t < group_begin(gi + 1).\n"
    "__device__ int mk_group_of(int s, int g, int t) {\n"
    "  if (g < 1 || s < 1) return 0;\n"
    "  int gi = (int)((i64)t * g / s);\n"
    "  while (gi + 1 < g && mk_group_begin(s, g, gi + 1) <= t) gi++;\n"
    "  while (gi > 0 && mk_group_begin(s, g, gi) > t) gi--;\n"
    "  return gi;\n"
    "}\n"
    "\n"
    "__device__ __forceinline__ bool mk_kept(const int *loc, i64 c, int cap) { return loc[c] >= 0 && loc[c] < cap; }\n"
    "\n"
    "// Row (in [e, g*cap, ...]) of kept choice c of a token in group gi.\n"
    "__device__ __forceinline__ i64 mk_slot(const int *idx, const int *loc, i64 c, int gi, int cap, int g) {\n"
    "  return ((i64)idx[c] * g + gi) * cap + loc[c];\n"
    "}\n"
    "\n"
    "// Block-wide reductions for kernels launched with MK_BLOCK threads: a fixed tree, so the\n"
    "// result does not depend on timing (deterministic run to run).\n"
    "__device__ double mk_block_sum(double v) {\n"
    "  __shared__ double sh[MK_BLOCK];\n"
    "  sh[threadIdx.x] = v;\n"
    "  __syncthreads();\n"
    "  for (int w = MK_BLOCK / 2; w > 0; w >>= 1) {\n"
    "    if (threadIdx.x < w) sh[threadIdx.x] += sh[threadIdx.x + w];\n"
    "    __syncthreads();\n"
    "  }\n"
    "  double r = sh[0];\n"
    "  __syncthreads();\n"
    "  return r;\n"
    "}\n"
    "\n"
    "__device__ float mk_block_max(float v) {\n"
    "  __shared__ float sh[MK_BLOCK];\n"
    "  sh[threadIdx.x] = v;\n"
    "  __syncthreads();\n"
    "  for (int w = MK_BLOCK / 2; w > 0; w >>= 1) {\n"
    "    if (threadIdx.x < w) sh[threadIdx.x] = fmaxf(sh[threadIdx.x], sh[threadIdx.x + w]);\n"
    "    __syncthreads();\n"
    "  }\n"
    "  float r = sh[0];\n"
    "  __syncthreads();\n"
    "  return r;\n"
    "}\n"
    "\n"
    "// ---- counter-based randomness, bit for bit runtime/rng.c ----\n"
    "__device__ u64 mk_mix(u64 z) {\n"
    "  z += 0x9e3779b97f4a7c15ULL;\n"
    "  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;\n"
    "  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;\n"
    "  return z ^ (z >> 31);\n"
    "}\n"
    "__device__ u64 mk_key(u64 a, u64 b) { return mk_mix(a ^ mk_mix(b)); }\n"
    "__device__ double mk_uniform(u64 h) { return ((double)(h >> 40) + 0.5) / 16777216.0; }\n"
    "__device__ double mk_normal(u64 key, u64 i) {\n"
    "  double u1 = mk_uniform(mk_key(key, 2 * i));\n"
    "  double u2 = mk_uniform(mk_key(key, 2 * i + 1));\n"
    "  return sqrt(-2.0 * log(u1)) * cos(2.0 * 3.14159265358979323846 * u2);\n"
    "}\n"
    "\n"
    "// ---- 16-bit formats on the bits, as runtime/hooks.c: round to nearest, ties to even ----\n"
    "__device__ u32 mk_shift_round_even(u32 m, int shift) {\n"
    "  u32 q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);\n"
    "  if (rem > half || (rem == half && (q & 1))) q++;\n"
    "  return q;\n"
    "}\n"
    "__device__ u16 mk_half_from_float(float f) {\n"
    "  u32 u = __float_as_uint(f);\n"
    "  u16 sign = (u16)((u >> 16) & 0x8000);\n"
    "  u32 a = u & 0x7fffffff, ex = a >> 23, mant = a & 0x7fffff;\n"
    "  if (a > 0x7f800000) return sign | 0x7e00 | (u16)(mant >> 13);\n"
    "  if (a >= 0x47800000) return sign | 0x7c00;\n"
    "  if (a >= 0x38800000) {\n"
    "    u32 h = ((ex - 112) << 10) | (mant >> 13);\n"
    "    u32 rem = mant & 0x1fff;\n"
    "    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;\n"
    "    return sign | (u16)h;\n"
    "  }\n"
    "  int shift = 126 - (int)ex;\n"
    "  if (shift > 24) return sign;\n"
    "  return sign | (u16)mk_shift_round_even(mant | 0x800000, shift);\n"
    "}\n"
    "__device__ float mk_float_from_half(u16 h) {\n"
    "  u32 sign = (u32)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, mant = h & 0x3ff;\n"
    "  if (ex == 31) return __uint_as_float(sign | 0x7f800000 | (mant << 13));\n"
    "  if (ex == 0) return __uint_as_float(sign | __float_as_uint((float)mant * 5.9604644775390625e-8f));  // mant * 2^-24, exact\n"
    "  return __uint_as_float(sign | ((ex + 112) << 23) | (mant << 13));\n"
    "}\n"
    "__device__ u16 mk_bf16_from_float(float f) {\n"
    "  u32 u = __float_as_uint(f);\n"
    "  if ((u & 0x7fffffff) > 0x7f800000) return (u16)((u >> 16) | 0x0040);\n"
    "  return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);\n"
    "}\n"
    "__device__ float mk_float_from_bf16(u16 q) { return __uint_as_float((u32)q << 16); }\n"
    "\n"
    "// ---- per-row gate functions (the separate kernels and the fused gate kernels share them) ----\n"
    "__device__ float mk_sigmoid1(float v) {\n"
    "  if (v >= 0.0f) return 1.0f / (1.0f + expf(-v));\n"
    "  float z = expf(v);\n"
    "  return z / (1.0f + z);\n"
    "}\n"
    "__device__ void mk_row_softmax(const float *x, float *y, int e) {\n"
    "  float mx = -MK_INF;\n"
    "  for (int j = 0; j < e; j++)\n"
    "    if (x[j] > mx) mx = x[j];\n"
    "  double sum = 0.0;\n"
    "  for (int j = 0; j < e; j++) {\n"
    "    y[j] = expf(x[j] - mx);\n"
    "    sum += y[j];\n"
    "  }\n"
    "  float inv = (float)(1.0 / sum);\n"
    "  for (int j = 0; j < e; j++) y[j] *= inv;\n"
    "}\n"
    "// Order: score descending, index ascending; NaN ranks as -inf (runtime rt_topk).\n"
    "__device__ void mk_row_topk(const float *row, int *out, int e, int k) {\n"
    "  float prev_v = MK_INF;\n"
    "  int prev_i = -1;\n"
    "  for (int j = 0; j < k; j++) {\n"
    "    int best = -1;\n"
    "    float best_v = -MK_INF;\n"
    "    for (int i = 0; i < e; i++) {\n"
    "      float v = row[i];\n"
    "      if (v != v) v = -MK_INF;\n"
    "      bool after_prev = v < prev_v || (v == prev_v && i > prev_i);\n"
    "      if (after_prev && (best < 0 || v > best_v)) {\n"
    "        best = i;\n"
    "        best_v = v;\n"
    "      }\n"
    "    }\n"
    "    out[j] = best;\n"
    "    prev_v = best_v;\n"
    "    prev_i = best;\n"
    "  }\n"
    "}\n"
    "__device__ void mk_row_gather(const float *row, const int *ir, float *gr, int k, int renorm) {\n"
    "  double sum = 0.0;\n"
    "  for (int j = 0; j < k; j++) {\n"
    "    gr[j] = row[ir[j]];\n"
    "    sum += gr[j];\n"
    "  }\n"
    "  if (renorm && sum > 0.0)\n"
    "    for (int j = 0; j < k; j++) gr[j] = (float)(gr[j] / sum);\n"
    "}\n"
    "__device__ double mk_row_logsumexp(const float *row, int e) {\n"
    "  float mx = -MK_INF;\n"
    "  for (int j = 0; j < e; j++)\n"
    "    if (row[j] > mx) mx = row[j];\n"
    "  double sum = 0.0;\n"
    "  for (int j = 0; j < e; j++) sum += exp((double)row[j] - mx);\n"
    "  return mx + log(sum);\n"
    "}\n"
    "\n"
    "// dispatch_mask / combine_weights: one block per token; the token's row of [s, e*g*cap] is\n"
    "// zeroed, then its kept choices set (to the gate, or 1 when gates is NULL).\n"
    "__device__ void mk_scatter_choices(const int *idx, const int *loc, const float *gates, float *out, int s, int k, int e,\n"
    "                                   int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  i64 width = (i64)e * g * cap;\n"
    "  MK_FOR_BLOCKS(t, s) {\n"
    "    float *row = out + t * width;\n"
    "    for (i64 i = threadIdx.x; i < width; i += blockDim.x) row[i] = 0.0f;\n"
    "    __syncthreads();\n"
    "    if (threadIdx.x == 0) {\n"
    "      int gi = mk_group_of(s, g, (int)t);\n"
    "      for (int j = 0; j < k; j++) {\n"
    "        i64 c = t * k + j;\n"
    "        if (mk_kept(loc, c, cap)) row[mk_slot(idx, loc, c, gi, cap, g)] = gates ? gates[c] : 1.0f;\n"
    "      }\n"
    "    }\n"
    "    __syncthreads();\n"
    "  }\n"
    "}\n";

static const struct { const char *name, *src; } kernel_src[K_COUNT] = {
  [K_ZERO] = {"mk_zero",
    "extern \"C\" __global__ void mk_zero(float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = 0.0f;\n"
    "}\n"},
  [K_COPY] = {"mk_copy",
    "extern \"C\" __global__ void mk_copy(const float *x, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = x[i];\n"
    "}\n"},
  [K_ADD] = {"mk_add",
    "extern \"C\" __global__ void mk_add(const float *a, const float *b, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = a[i] + b[i];\n"
    "}\n"},
  [K_MUL] = {"mk_mul",
    "extern \"C\" __global__ void mk_mul(const float *a, const float *b, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = a[i] * b[i];\n"
    "}\n"},
  [K_BIAS] = {"mk_bias",
    "extern \"C\" __global__ void mk_bias(const float *x, const float *b, float *y, int rows, int n) {\n"
    "  MK_FOR(i, (i64)rows * n) y[i] = x[i] + b[i % n];\n"
    "}\n"},
  [K_BIAS_GRAD] = {"mk_bias_grad",
    "// One thread per column, rows summed in order in double: deterministic, as rt_bias_grad.\n"
    "extern \"C\" __global__ void mk_bias_grad(const float *dy, float *db, int rows, int n) {\n"
    "  MK_FOR(c, n) {\n"
    "    double acc = 0.0;\n"
    "    for (int r = 0; r < rows; r++) acc += dy[(i64)r * n + c];\n"
    "    db[c] = (float)acc;\n"
    "  }\n"
    "}\n"},
  [K_EXPERT_BIAS] = {"mk_expert_bias",
    "extern \"C\" __global__ void mk_expert_bias(const float *x, const float *b, float *y, int e, int rows, int n) {\n"
    "  MK_FOR(i, (i64)e * rows * n) y[i] = x[i] + b[(i / ((i64)rows * n)) * n + i % n];\n"
    "}\n"},
  [K_EXPERT_BIAS_GRAD] = {"mk_expert_bias_grad",
    "extern \"C\" __global__ void mk_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) {\n"
    "  MK_FOR(i, (i64)e * n) {\n"
    "    i64 ex = i / n, c = i % n;\n"
    "    const float *d = dy + ex * rows * n;\n"
    "    double acc = 0.0;\n"
    "    for (int r = 0; r < rows; r++) acc += d[(i64)r * n + c];\n"
    "    db[i] = (float)acc;\n"
    "  }\n"
    "}\n"},
  [K_GELU] = {"mk_gelu",
    "#define MK_GELU_C 0.7978845608028654f\n"
    "#define MK_GELU_A 0.044715f\n"
    "extern \"C\" __global__ void mk_gelu(const float *x, float *y, i64 n) {\n"
    "  MK_FOR(i, n) {\n"
    "    float v = x[i];\n"
    "    float t = tanhf(MK_GELU_C * (v + MK_GELU_A * v * v * v));\n"
    "    y[i] = 0.5f * v * (1.0f + t);\n"
    "  }\n"
    "}\n"},
  [K_GELU_GRAD] = {"mk_gelu_grad",
    "extern \"C\" __global__ void mk_gelu_grad(const float *dy, const float *x, float *dx, i64 n) {\n"
    "  MK_FOR(i, n) {\n"
    "    float v = x[i];\n"
    "    float t = tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v));\n"
    "    float du = 0.7978845608028654f * (1.0f + 3.0f * 0.044715f * v * v);\n"
    "    dx[i] = dy[i] * (0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du);\n"
    "  }\n"
    "}\n"},
  [K_RELU] = {"mk_relu",
    "extern \"C\" __global__ void mk_relu(const float *x, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;\n"
    "}\n"},
  [K_RELU_GRAD] = {"mk_relu_grad",
    "extern \"C\" __global__ void mk_relu_grad(const float *dy, const float *x, float *dx, i64 n) {\n"
    "  MK_FOR(i, n) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;\n"
    "}\n"},
  [K_SILU] = {"mk_silu",
    "extern \"C\" __global__ void mk_silu(const float *x, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = x[i] * mk_sigmoid1(x[i]);\n"
    "}\n"},
  [K_SILU_GRAD] = {"mk_silu_grad",
    "extern \"C\" __global__ void mk_silu_grad(const float *dy, const float *x, float *dx, i64 n) {\n"
    "  MK_FOR(i, n) {\n"
    "    float sg = mk_sigmoid1(x[i]);\n"
    "    dx[i] = dy[i] * sg * (1.0f + x[i] * (1.0f - sg));\n"
    "  }\n"
    "}\n"},
  [K_L2NORM] = {"mk_l2norm",
    "// One block (MK_BLOCK threads) per row.\n"
    "extern \"C\" __global__ void mk_l2norm(const float *x, float *y, int rows, int n) {\n"
    "  MK_FOR_BLOCKS(r, rows) {\n"
    "    const float *xr = x + r * n;\n"
    "    float *yr = y + r * n;\n"
    "    double ss = 0.0;\n"
    "    for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)xr[i] * xr[i];\n"
    "    ss = mk_block_sum(ss);\n"
    "    float inv = (float)(1.0 / sqrt(ss + 1e-12));\n"
    "    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv;\n"
    "  }\n"
    "}\n"},
  [K_L2NORM_GRAD] = {"mk_l2norm_grad",
    "extern \"C\" __global__ void mk_l2norm_grad(const float *dy, const float *x, float *dx, int rows, int n) {\n"
    "  MK_FOR_BLOCKS(r, rows) {\n"
    "    const float *xr = x + r * n, *dr = dy + r * n;\n"
    "    float *out = dx + r * n;\n"
    "    double ss = 0.0, dot = 0.0;\n"
    "    for (int i = threadIdx.x; i < n; i += blockDim.x) {\n"
    "      ss += (double)xr[i] * xr[i];\n"
    "      dot += (double)dr[i] * xr[i];\n"
    "    }\n"
    "    ss = mk_block_sum(ss);\n"
    "    dot = mk_block_sum(dot);\n"
    "    double norm = sqrt(ss + 1e-12);\n"
    "    float inv = (float)(1.0 / norm), proj = (float)(dot / (norm * norm * norm));\n"
    "    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dr[i] * inv - xr[i] * proj;\n"
    "  }\n"
    "}\n"},
  [K_DIV_SCALAR] = {"mk_div_scalar",
    "extern \"C\" __global__ void mk_div_scalar(const float *x, const float *s, float *y, i64 n) {\n"
    "  float d = s[0];\n"
    "  MK_FOR(i, n) y[i] = x[i] / d;\n"
    "}\n"},
  [K_DIV_SCALAR_GRAD_X] = {"mk_div_scalar_grad_x",
    "extern \"C\" __global__ void mk_div_scalar_grad_x(const float *dy, const float *s, float *dx, i64 n) {\n"
    "  float d = s[0];\n"
    "  MK_FOR(i, n) dx[i] = dy[i] / d;\n"
    "}\n"},
  [K_DIV_SCALAR_GRAD_S] = {"mk_div_scalar_grad_s",
    "// One block of MK_BLOCK threads.\n"
    "extern \"C\" __global__ void mk_div_scalar_grad_s(const float *dy, const float *x, const float *s, float *ds, i64 n) {\n"
    "  double acc = 0.0;\n"
    "  for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += (double)dy[i] * x[i];\n"
    "  acc = mk_block_sum(acc);\n"
    "  double d = s[0];\n"
    "  if (threadIdx.x == 0) ds[0] = (float)(-acc / (d * d));\n"
    "}\n"},
  [K_GATE_NOISE] = {"mk_gate_noise",
    "// logits + sigma*N(0,1)/e; the normal of token t, expert j is\n"
    "// mk_normal(key(key(key(seed, 4 = RT_STREAM_NOISE), step), layer), (token0 + t) * e + j).\n"
    "extern \"C\" __global__ void mk_gate_noise(const float *logits, float *out, int s, int e, float sigma, int layer,\n"
    "                                         u64 seed, i64 step, i64 token0) {\n"
    "  u64 key = mk_key(mk_key(mk_key(seed, 4ULL), (u64)step), (u64)(i64)layer);\n"
    "  double scale = (double)sigma / e;\n"
    "  MK_FOR(i, (i64)s * e) {\n"
    "    if (sigma == 0.0f) {\n"
    "      out[i] = logits[i];\n"
    "      continue;\n"
    "    }\n"
    "    i64 t = i / e, j = i % e;\n"
    "    u64 base = (u64)(token0 + t) * (u64)e;\n"
    "    out[i] = logits[i] + (float)(scale * mk_normal(key, base + (u64)j));\n"
    "  }\n"
    "}\n"},
  [K_SOFTMAX] = {"mk_softmax",
    "extern \"C\" __global__ void mk_softmax(const float *x, float *y, int s, int e) {\n"
    "  MK_FOR(t, s) mk_row_softmax(x + t * e, y + t * e, e);\n"
    "}\n"},
  [K_SOFTMAX_GRAD] = {"mk_softmax_grad",
    "extern \"C\" __global__ void mk_softmax_grad(const float *dy, const float *y, float *dx, int s, int e) {\n"
    "  MK_FOR(t, s) {\n"
    "    const float *dr = dy + t * e, *yr = y + t * e;\n"
    "    float *xr = dx + t * e;\n"
    "    double dot = 0.0;\n"
    "    for (int j = 0; j < e; j++) dot += (double)dr[j] * yr[j];\n"
    "    float d = (float)dot;\n"
    "    for (int j = 0; j < e; j++) xr[j] = yr[j] * (dr[j] - d);\n"
    "  }\n"
    "}\n"},
  [K_SIGMOID] = {"mk_sigmoid",
    "extern \"C\" __global__ void mk_sigmoid(const float *x, float *y, i64 n) {\n"
    "  MK_FOR(i, n) y[i] = mk_sigmoid1(x[i]);\n"
    "}\n"},
  [K_SIGMOID_GRAD] = {"mk_sigmoid_grad",
    "extern \"C\" __global__ void mk_sigmoid_grad(const float *dy, const float *y, float *dx, i64 n) {\n"
    "  MK_FOR(i, n) dx[i] = dy[i] * y[i] * (1.0f - y[i]);\n"
    "}\n"},
  [K_SOFTMAX_TOKENS] = {"mk_softmax_tokens",
    "// One thread per (group, column): the column of a group in token order.\n"
    "extern \"C\" __global__ void mk_softmax_tokens(const float *x, float *y, int s, int e, int g) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR(i, (i64)g * e) {\n"
    "    int gi = (int)(i / e), j = (int)(i % e);\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);\n"
    "    float mx = -MK_INF;\n"
    "    for (int t = t0; t < t1; t++)\n"
    "      if (x[(i64)t * e + j] > mx) mx = x[(i64)t * e + j];\n"
    "    double sum = 0.0;\n"
    "    for (int t = t0; t < t1; t++) {\n"
    "      i64 k = (i64)t * e + j;\n"
    "      y[k] = expf(x[k] - mx);\n"
    "      sum += y[k];\n"
    "    }\n"
    "    float inv = (float)(1.0 / sum);\n"
    "    for (int t = t0; t < t1; t++) y[(i64)t * e + j] *= inv;\n"
    "  }\n"
    "}\n"},
  [K_SOFTMAX_TOKENS_GRAD] = {"mk_softmax_tokens_grad",
    "extern \"C\" __global__ void mk_softmax_tokens_grad(const float *dy, const float *y, float *dx, int s, int e, int g) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR(i, (i64)g * e) {\n"
    "    int gi = (int)(i / e), j = (int)(i % e);\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);\n"
    "    double dot = 0.0;\n"
    "    for (int t = t0; t < t1; t++) dot += (double)dy[(i64)t * e + j] * y[(i64)t * e + j];\n"
    "    for (int t = t0; t < t1; t++) {\n"
    "      i64 k = (i64)t * e + j;\n"
    "      dx[k] = y[k] * (dy[k] - (float)dot);\n"
    "    }\n"
    "  }\n"
    "}\n"},
  [K_TOPK] = {"mk_topk",
    "extern \"C\" __global__ void mk_topk(const float *scores, int *idx, int s, int e, int k) {\n"
    "  MK_FOR(t, s) mk_row_topk(scores + t * e, idx + t * k, e, k);\n"
    "}\n"},
  [K_GATE_GATHER] = {"mk_gate_gather",
    "extern \"C\" __global__ void mk_gate_gather(const float *scores, const int *idx, float *gates, int s, int e, int k,\n"
    "                                          int renorm) {\n"
    "  MK_FOR(t, s) mk_row_gather(scores + t * e, idx + t * k, gates + t * k, k, renorm);\n"
    "}\n"},
  [K_GATE_GATHER_GRAD] = {"mk_gate_gather_grad",
    "extern \"C\" __global__ void mk_gate_gather_grad(const float *dgates, const float *scores, const int *idx, float *dscores,\n"
    "                                               int s, int e, int k, int renorm) {\n"
    "  MK_FOR(t, s) {\n"
    "    const float *row = scores + t * e, *dg = dgates + t * k;\n"
    "    const int *ir = idx + t * k;\n"
    "    float *dr = dscores + t * e;\n"
    "    for (int j = 0; j < e; j++) dr[j] = 0.0f;\n"
    "    if (!renorm) {\n"
    "      for (int j = 0; j < k; j++) dr[ir[j]] += dg[j];\n"
    "      continue;\n"
    "    }\n"
    "    double sum = 0.0;\n"
    "    for (int j = 0; j < k; j++) sum += row[ir[j]];\n"
    "    if (!(sum > 0.0)) continue;\n"
    "    double dot = 0.0;\n"
    "    for (int j = 0; j < k; j++) dot += (double)dg[j] * (row[ir[j]] / sum);\n"
    "    for (int j = 0; j < k; j++) dr[ir[j]] += (float)((dg[j] - dot) / sum);\n"
    "  }\n"
    "}\n"},
  [K_GATE_SOFTMAX_TOPK_GATHER] = {"mk_gate_softmax_topk_gather",
    "// The fused gate of `gate gshard` (and xmoe): softmax -> top-k -> gather, one thread per token;\n"
    "// the same results as mk_softmax, mk_topk and mk_gate_gather in sequence.\n"
    "extern \"C\" __global__ void mk_gate_softmax_topk_gather(const float *logits, float *scores, int *idx, float *gates,\n"
    "                                                       int s, int e, int k, int renorm) {\n"
    "  MK_FOR(t, s) {\n"
    "    float *row = scores + t * e;\n"
    "    mk_row_softmax(logits + t * e, row, e);\n"
    "    mk_row_topk(row, idx + t * k, e, k);\n"
    "    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm);\n"
    "  }\n"
    "}\n"},
  [K_GATE_SIGMOID_TOPK_GATHER] = {"mk_gate_sigmoid_topk_gather",
    "// The fused gate of `gate sigmoid`: sigmoid -> top-k -> gather, one thread per token.\n"
    "extern \"C\" __global__ void mk_gate_sigmoid_topk_gather(const float *logits, float *scores, int *idx, float *gates,\n"
    "                                                       int s, int e, int k, int renorm) {\n"
    "  MK_FOR(t, s) {\n"
    "    float *row = scores + t * e;\n"
    "    for (int j = 0; j < e; j++) row[j] = mk_sigmoid1(logits[t * e + j]);\n"
    "    mk_row_topk(row, idx + t * k, e, k);\n"
    "    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm);\n"
    "  }\n"
    "}\n"},
  [K_GATE_LOCATIONS] = {"mk_gate_locations",
    "// One block per (routing group, expert): an expert's locations only depend on its own choices,\n"
    "// numbered in [j, t] order (rt_gate_locations). The block's threads split the group's choice\n"
    "// positions p = j*n + (t - t0) into contiguous runs; each counts the expert's choices in its run,\n"
    "// an exclusive scan over the runs gives each run its first number, and a second pass numbers the\n"
    "// choices: location = number when below cap (cap <= 0: dropless), else -1. Any grid and any block\n"
    "// of at most MK_BLOCK threads give the same result. stats (may be NULL) gets int[g, e, 2]: kept\n"
    "// and wanted choices per group and expert, for the host's drop count, loads and capacity_max.\n"
    "extern \"C\" __global__ void mk_gate_locations(const int *idx, int *loc, int *stats, int s, int k, int e, int g,\n"
    "                                             int cap) {\n"
    "  __shared__ int first[MK_BLOCK];\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(b, (i64)g * e) {\n"
    "    int gi = (int)(b / e), ex = (int)(b % e);\n"
    "    int t0 = mk_group_begin(s, g, gi), n = mk_group_begin(s, g, gi + 1) - t0;\n"
    "    i64 total = (i64)n * k, per = (total + blockDim.x - 1) / blockDim.x;\n"
    "    i64 p0 = (i64)threadIdx.x * per, p1 = p0 + per < total ? p0 + per : total;\n"
    "    int mine = 0;\n"
    "    for (i64 p = p0; p < p1; p++) mine += idx[(i64)(t0 + p % n) * k + p / n] == ex;\n"
    "    first[threadIdx.x] = mine;\n"
    "    __syncthreads();\n"
    "    if (threadIdx.x == 0) {\n"
    "      int wanted = 0;\n"
    "      for (int i = 0; i < (int)blockDim.x; i++) {\n"
    "        int c = first[i];\n"
    "        first[i] = wanted;\n"
    "        wanted += c;\n"
    "      }\n"
    "      if (stats) {\n"
    "        stats[((i64)gi * e + ex) * 2] = cap <= 0 || wanted < cap ? wanted : cap;\n"
    "        stats[((i64)gi * e + ex) * 2 + 1] = wanted;\n"
    "      }\n"
    "    }\n"
    "    __syncthreads();\n"
    "    int number = first[threadIdx.x];\n"
    "    for (i64 p = p0; p < p1; p++) {\n"
    "      i64 c = (i64)(t0 + p % n) * k + p / n;\n"
    "      if (idx[c] != ex) continue;\n"
    "      loc[c] = cap <= 0 || number < cap ? number : -1;\n"
    "      number++;\n"
    "    }\n"
    "    __syncthreads();  // first[] serves the block's next (group, expert)\n"
    "  }\n"
    "}\n"},
  [K_EXPERT_CHOICE] = {"mk_expert_choice",
    "// One block per (group, expert), one thread per token of the group: a token's rank is the\n"
    "// number of tokens before it in (score descending, token ascending) order; the first cap keep\n"
    "// their rank as location, the others get -1 (rt_expert_choice).\n"
    "extern \"C\" __global__ void mk_expert_choice(const float *scores, int *loc, int s, int e, int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(b, (i64)g * e) {\n"
    "    int gi = (int)(b / e), j = (int)(b % e);\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;\n"
    "    int take = cap < n ? cap : n;\n"
    "    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {\n"
    "      float v = scores[(i64)t * e + j];\n"
    "      if (v != v) v = -MK_INF;\n"
    "      int rank = 0;\n"
    "      for (int u = t0; u < t1; u++) {\n"
    "        float w = scores[(i64)u * e + j];\n"
    "        if (w != w) w = -MK_INF;\n"
    "        rank += w > v || (w == v && u < t);\n"
    "      }\n"
    "      loc[(i64)t * e + j] = take > 0 && rank < take ? rank : -1;\n"
    "    }\n"
    "  }\n"
    "}\n"},
  [K_IOTA] = {"mk_iota",
    "extern \"C\" __global__ void mk_iota(int *idx, int s, int e) {\n"
    "  MK_FOR(i, (i64)s * e) idx[i] = (int)(i % e);\n"
    "}\n"},
  [K_AUX_LOSS] = {"mk_aux_loss",
    "// One block of MK_BLOCK threads. Per group: me_i = mean score, ce_i = fraction of first choices;\n"
    "// aux = mean over groups of E * sum_i me_i ce_i; out[0] = aux / share.\n"
    "extern \"C\" __global__ void mk_aux_loss(const float *scores, const int *idx, float *out, int s, int e, int k, int g,\n"
    "                                       float share) {\n"
    "  if (g < 1) g = 1;\n"
    "  double total = 0.0;\n"
    "  for (int gi = 0; gi < g; gi++) {\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;\n"
    "    double part = 0.0;\n"
    "    for (int i = threadIdx.x; i < e; i += blockDim.x) {\n"
    "      double me = 0.0, ce = 0.0;\n"
    "      for (int t = t0; t < t1; t++) {\n"
    "        me += scores[(i64)t * e + i];\n"
    "        ce += idx[(i64)t * k] == i;\n"
    "      }\n"
    "      if (n > 0) {\n"
    "        me /= n;\n"
    "        ce /= n;\n"
    "      }\n"
    "      part += me * ce;\n"
    "    }\n"
    "    total += e * mk_block_sum(part);\n"
    "  }\n"
    "  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;\n"
    "}\n"},
  [K_AUX_LOSS_GRAD] = {"mk_aux_loss_grad",
    "// One block per group; dynamic shared memory e doubles. ce is a constant of the scores:\n"
    "// d/dscores[t, i] = coef * E * ce_i / (n_g * G).\n"
    "extern \"C\" __global__ void mk_aux_loss_grad(const float *scores, const int *idx, float *dscores, int s, int e, int k,\n"
    "                                            int g, float coef) {\n"
    "  MK_DYN_SHARED(double, mk_ce);\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(gi, g) {\n"
    "    int t0 = mk_group_begin(s, g, (int)gi), t1 = mk_group_begin(s, g, (int)gi + 1), n = t1 - t0;\n"
    "    for (int i = threadIdx.x; i < e; i += blockDim.x) {\n"
    "      double ce = 0.0;\n"
    "      for (int t = t0; t < t1; t++) ce += idx[(i64)t * k] == i;\n"
    "      mk_ce[i] = n > 0 ? ce / n : 0.0;\n"
    "    }\n"
    "    __syncthreads();\n"
    "    for (i64 q = threadIdx.x; q < (i64)n * e; q += blockDim.x) {\n"
    "      int i = (int)(q % e);\n"
    "      dscores[(i64)t0 * e + q] = (float)((double)coef * e * mk_ce[i] / ((double)n * g));\n"
    "    }\n"
    "    __syncthreads();\n"
    "  }\n"
    "}\n"},
  [K_Z_LOSS] = {"mk_z_loss",
    "// One block of MK_BLOCK threads: mean over groups of the group's mean of logsumexp^2, / share.\n"
    "extern \"C\" __global__ void mk_z_loss(const float *logits, float *out, int s, int e, int g, float share) {\n"
    "  if (g < 1) g = 1;\n"
    "  double total = 0.0;\n"
    "  for (int gi = 0; gi < g; gi++) {\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);\n"
    "    double acc = 0.0;\n"
    "    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {\n"
    "      double lse = mk_row_logsumexp(logits + (i64)t * e, e);\n"
    "      acc += lse * lse;\n"
    "    }\n"
    "    acc = mk_block_sum(acc);\n"
    "    if (t1 > t0) total += acc / (t1 - t0);\n"
    "  }\n"
    "  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;\n"
    "}\n"},
  [K_Z_LOSS_GRAD] = {"mk_z_loss_grad",
    "extern \"C\" __global__ void mk_z_loss_grad(const float *logits, float *dlogits, int s, int e, int g, float coef) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR(t, s) {\n"
    "    int gi = mk_group_of(s, g, (int)t);\n"
    "    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);\n"
    "    double scale = 2.0 * coef / ((double)(t1 - t0) * g);\n"
    "    const float *row = logits + t * e;\n"
    "    float *dr = dlogits + t * e;\n"
    "    double lse = mk_row_logsumexp(row, e);\n"
    "    for (int j = 0; j < e; j++) dr[j] = (float)(scale * lse * exp((double)row[j] - lse));\n"
    "  }\n"
    "}\n"},
  [K_ORDER_ENCODE] = {"mk_order_encode",
    "// After mk_zero on disp: one block per choice copies the token's row to its slot (slots of kept\n"
    "// choices are distinct, so nothing races).\n"
    "extern \"C\" __global__ void mk_order_encode(const float *x, const int *idx, const int *loc, float *disp, int s, int m,\n"
    "                                           int k, int e, int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(c, (i64)s * k) {\n"
    "    if (!mk_kept(loc, c, cap)) continue;\n"
    "    int t = (int)(c / k);\n"
    "    float *dst = disp + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;\n"
    "    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] = x[(i64)t * m + i];\n"
    "  }\n"
    "}\n"},
  [K_ORDER_ENCODE_GRAD] = {"mk_order_encode_grad",
    "// One block per token: the sum of its kept choices' slot rows, in choice order.\n"
    "extern \"C\" __global__ void mk_order_encode_grad(const float *ddisp, const int *idx, const int *loc, float *dx, int s,\n"
    "                                                int m, int k, int e, int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(t, s) {\n"
    "    int gi = mk_group_of(s, g, (int)t);\n"
    "    for (int i = threadIdx.x; i < m; i += blockDim.x) {\n"
    "      float acc = 0.0f;\n"
    "      for (int j = 0; j < k; j++) {\n"
    "        i64 c = t * k + j;\n"
    "        if (mk_kept(loc, c, cap)) acc += ddisp[mk_slot(idx, loc, c, gi, cap, g) * m + i];\n"
    "      }\n"
    "      dx[t * m + i] = acc;\n"
    "    }\n"
    "  }\n"
    "}\n"},
  [K_ORDER_DECODE] = {"mk_order_decode",
    "// One block per token: sum over kept choices of gate * expert output row, in choice order.\n"
    "extern \"C\" __global__ void mk_order_decode(const float *y, const int *idx, const int *loc, const float *gates,\n"
    "                                           float *out, int s, int m, int k, int e, int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(t, s) {\n"
    "    int gi = mk_group_of(s, g, (int)t);\n"
    "    for (int i = threadIdx.x; i < m; i += blockDim.x) {\n"
    "      float acc = 0.0f;\n"
    "      for (int j = 0; j < k; j++) {\n"
    "        i64 c = t * k + j;\n"
    "        if (mk_kept(loc, c, cap)) acc += gates[c] * y[mk_slot(idx, loc, c, gi, cap, g) * m + i];\n"
    "      }\n"
    "      out[t * m + i] = acc;\n"
    "    }\n"
    "  }\n"
    "}\n"},
  [K_ORDER_DECODE_GRAD_Y] = {"mk_order_decode_grad_y",
    "// After mk_zero on dy: one block per kept choice writes gate * dout row to its slot.\n"
    "extern \"C\" __global__ void mk_order_decode_grad_y(const float *dout, const int *idx, const int *loc,\n"
    "                                                  const float *gates, float *dy, int s, int m, int k, int e, int g,\n"
    "                                                  int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(c, (i64)s * k) {\n"
    "    if (!mk_kept(loc, c, cap)) continue;\n"
    "    int t = (int)(c / k);\n"
    "    float *dst = dy + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;\n"
    "    float w = gates[c];\n"
    "    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] += w * dout[(i64)t * m + i];\n"
    "  }\n"
    "}\n"},
  [K_ORDER_DECODE_GRAD_GATES] = {"mk_order_decode_grad_gates",
    "// One block (MK_BLOCK threads) per choice: <dout row, slot row> in double.\n"
    "extern \"C\" __global__ void mk_order_decode_grad_gates(const float *dout, const float *y, const int *idx,\n"
    "                                                      const int *loc, float *dgates, int s, int m, int k, int e,\n"
    "                                                      int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  MK_FOR_BLOCKS(c, (i64)s * k) {\n"
    "    bool keep = mk_kept(loc, c, cap);   // the same for the whole block\n"
    "    if (!keep) {\n"
    "      if (threadIdx.x == 0) dgates[c] = 0.0f;\n"
    "      continue;\n"
    "    }\n"
    "    int t = (int)(c / k);\n"
    "    const float *src = y + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m, *dr = dout + (i64)t * m;\n"
    "    double dot = 0.0;\n"
    "    for (int i = threadIdx.x; i < m; i += blockDim.x) dot += (double)dr[i] * src[i];\n"
    "    dot = mk_block_sum(dot);\n"
    "    if (threadIdx.x == 0) dgates[c] = (float)dot;\n"
    "  }\n"
    "}\n"},
  [K_DISPATCH_MASK] = {"mk_dispatch_mask",
    "extern \"C\" __global__ void mk_dispatch_mask(const int *idx, const int *loc, float *mask, int s, int k, int e, int g,\n"
    "                                            int cap) {\n"
    "  mk_scatter_choices(idx, loc, 0, mask, s, k, e, g, cap);\n"
    "}\n"},
  [K_COMBINE_WEIGHTS] = {"mk_combine_weights",
    "extern \"C\" __global__ void mk_combine_weights(const int *idx, const int *loc, const float *gates, float *cw, int s,\n"
    "                                              int k, int e, int g, int cap) {\n"
    "  mk_scatter_choices(idx, loc, gates, cw, s, k, e, g, cap);\n"
    "}\n"},
  [K_COMBINE_WEIGHTS_GRAD] = {"mk_combine_weights_grad",
    "extern \"C\" __global__ void mk_combine_weights_grad(const float *dcw, const int *idx, const int *loc, float *dgates,\n"
    "                                                   int s, int k, int e, int g, int cap) {\n"
    "  if (g < 1) g = 1;\n"
    "  i64 width = (i64)e * g * cap;\n"
    "  MK_FOR(c, (i64)s * k) {\n"
    "    i64 t = c / k;\n"
    "    dgates[c] = mk_kept(loc, c, cap) ? dcw[t * width + mk_slot(idx, loc, c, mk_group_of(s, g, (int)t), cap, g)] : 0.0f;\n"
    "  }\n"
    "}\n"},
  [K_COMPRESS_F16] = {"mk_compress_f16",
    "extern \"C\" __global__ void mk_compress_f16(const float *x, u16 *q, i64 n) {\n"
    "  MK_FOR(i, n) q[i] = mk_half_from_float(x[i]);\n"
    "}\n"},
  [K_DECOMPRESS_F16] = {"mk_decompress_f16",
    "extern \"C\" __global__ void mk_decompress_f16(const u16 *q, float *x, i64 n) {\n"
    "  MK_FOR(i, n) x[i] = mk_float_from_half(q[i]);\n"
    "}\n"},
  [K_COMPRESS_BF16] = {"mk_compress_bf16",
    "extern \"C\" __global__ void mk_compress_bf16(const float *x, u16 *q, i64 n) {\n"
    "  MK_FOR(i, n) q[i] = mk_bf16_from_float(x[i]);\n"
    "}\n"},
  [K_DECOMPRESS_BF16] = {"mk_decompress_bf16",
    "extern \"C\" __global__ void mk_decompress_bf16(const u16 *q, float *x, i64 n) {\n"
    "  MK_FOR(i, n) x[i] = mk_float_from_bf16(q[i]);\n"
    "}\n"},
  [K_INT8_SCALES] = {"mk_int8_scales",
    "// One block (MK_BLOCK threads) per row: max|x| / 127 (every NaN ignored: `>` is false for it,\n"
    "// as in runtime/hooks.c), 1 for a zero row.\n"
    "extern \"C\" __global__ void mk_int8_scales(const float *x, float *scale, int rows, int n) {\n"
    "  MK_FOR_BLOCKS(r, rows) {\n"
    "    float mx = 0.0f;\n"
    "    for (int i = threadIdx.x; i < n; i += blockDim.x) {\n"
    "      float a = fabsf(x[r * n + i]);\n"
    "      if (a > mx) mx = a;\n"
    "    }\n"
    "    mx = mk_block_max(mx);\n"
    "    if (threadIdx.x == 0) scale[r] = mx > 0.0f ? mx / 127.0f : 1.0f;\n"
    "  }\n"
    "}\n"},
  [K_COMPRESS_INT8] = {"mk_compress_int8",
    "extern \"C\" __global__ void mk_compress_int8(const float *x, const float *scale, i8 *q, int rows, int n) {\n"
    "  MK_FOR(i, (i64)rows * n) {\n"
    "    float v = roundf(x[i] / scale[i / n]);\n"
    "    if (v != v) v = 0.0f;\n"
    "    q[i] = (i8)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);\n"
    "  }\n"
    "}\n"},
  [K_DECOMPRESS_INT8] = {"mk_decompress_int8",
    "extern \"C\" __global__ void mk_decompress_int8(const i8 *q, const float *scale, float *x, int rows, int n) {\n"
    "  MK_FOR(i, (i64)rows * n) x[i] = (float)q[i] * scale[i / n];\n"
    "}\n"},
  [K_RECORD_STATS] = {"mk_record_stats",
    "// One block of MK_BLOCK threads: out = {sum, max |x| over non-NaN, number of NaNs} for the\n"
    "// host's record line (rt_record).\n"
    "extern \"C\" __global__ void mk_record_stats(const float *x, double *out, i64 n) {\n"
    "  double sum = 0.0, nans = 0.0;\n"
    "  float mx = 0.0f;\n"
    "  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {\n"
    "    sum += x[i];\n"
    "    if (x[i] != x[i]) nans += 1.0;\n"
    "    else mx = fmaxf(mx, fabsf(x[i]));\n"
    "  }\n"
    "  sum = mk_block_sum(sum);\n"
    "  nans = mk_block_sum(nans);\n"
    "  mx = mk_block_max(mx);\n"
    "  if (threadIdx.x == 0) {\n"
    "    out[0] = sum;\n"
    "    out[1] = mx;\n"
    "    out[2] = nans;\n"
    "  }\n"
    "}\n"},
  [K_EXPERT_MAJOR] = {"mk_expert_major",
    "// [blocks*experts, rows, m] seen as [blocks, experts, chunk] -> [experts, blocks, chunk].\n"
    "extern \"C\" __global__ void mk_expert_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {\n"
    "  i64 chunk = rows * m;\n"
    "  MK_FOR(i, (i64)blocks * experts * chunk) {\n"
    "    i64 o = i / chunk, w = i % chunk, ex = o / blocks, r = o % blocks;\n"
    "    y[i] = x[(r * experts + ex) * chunk + w];\n"
    "  }\n"
    "}\n"},
  [K_RANK_MAJOR] = {"mk_rank_major",
    "extern \"C\" __global__ void mk_rank_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {\n"
    "  i64 chunk = rows * m;\n"
    "  MK_FOR(i, (i64)blocks * experts * chunk) {\n"
    "    i64 o = i / chunk, w = i % chunk, r = o / experts, ex = o % experts;\n"
    "    y[i] = x[(ex * blocks + r) * chunk + w];\n"
    "  }\n"
    "}\n"},
  [K_LAYOUT_CHUNK] = {"mk_layout_chunk",
    "// Bytes: x [outer*blocks, rows, inner] -> slots [lo, hi) of every run, lo = index*rows/chunks,\n"
    "// hi = (index+1)*rows/chunks (floor division: any chunks <= rows, sizes differ by at most one).\n"
    "extern \"C\" __global__ void mk_layout_chunk(const unsigned char *x, unsigned char *y, i64 outer, i64 blocks, i64 rows,\n"
    "                                           i64 inner, i64 chunks, i64 index) {\n"
    "  i64 lo = index * rows / chunks, run = ((index + 1) * rows / chunks - lo) * inner;\n"
    "  MK_FOR(i, outer * blocks * run) {\n"
    "    i64 o = i / run, w = i % run;\n"
    "    y[i] = x[(o * rows + lo) * inner + w];\n"
    "  }\n"
    "}\n"},
  [K_LAYOUT_CONCAT] = {"mk_layout_concat",
    "extern \"C\" __global__ void mk_layout_concat(const unsigned char *a, const unsigned char *b, unsigned char *y,\n"
    "                                            i64 outer, i64 blocks, i64 rows_a, i64 rows_b, i64 inner) {\n"
    "  i64 ra = rows_a * inner, rb = rows_b * inner, run = ra + rb;\n"
    "  MK_FOR(i, outer * blocks * run) {\n"
    "    i64 o = i / run, w = i % run;\n"
    "    y[i] = w < ra ? a[o * ra + w] : b[o * rb + (w - ra)];\n"
    "  }\n"
    "}\n"},
  [K_MSE] = {"mk_mse",
    "// One block of MK_BLOCK threads: out[0] = scale * mean((out - target)^2) / 2.\n"
    "extern \"C\" __global__ void mk_mse(const float *out, const float *target, float *loss, i64 n, float scale) {\n"
    "  double acc = 0.0;\n"
    "  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {\n"
    "    double d = (double)out[i] - target[i];\n"
    "    acc += d * d;\n"
    "  }\n"
    "  acc = mk_block_sum(acc);\n"
    "  if (threadIdx.x == 0) loss[0] = scale * (n > 0 ? (float)(acc / (2.0 * n)) : 0.0f);\n"
    "}\n"},
  [K_MSE_GRAD] = {"mk_mse_grad",
    "extern \"C\" __global__ void mk_mse_grad(const float *out, const float *target, float *dout, i64 n, float scale) {\n"
    "  double inv = n > 0 ? 1.0 / n : 0.0;\n"
    "  MK_FOR(i, n) {\n"
    "    float v = (float)(((double)out[i] - target[i]) * inv);\n"
    "    if (scale != 1.0f) v *= scale;\n"
    "    dout[i] = v;\n"
    "  }\n"
    "}\n"},
  [K_SGD] = {"mk_sgd",
    "extern \"C\" __global__ void mk_sgd(float *p, const float *g, i64 n, float lr, float weight_decay) {\n"
    "  MK_FOR(i, n) p[i] -= lr * (g[i] + weight_decay * p[i]);\n"
    "}\n"},
  [K_ADAMW] = {"mk_adamw",
    "extern \"C\" __global__ void mk_adamw(float *p, const float *g, float *m, float *v, i64 n, float lr, float beta1,\n"
    "                                    float beta2, float eps, float weight_decay, i64 step) {\n"
    "  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));\n"
    "  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));\n"
    "  MK_FOR(i, n) {\n"
    "    m[i] = beta1 * m[i] + (1.0f - beta1) * g[i];\n"
    "    v[i] = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];\n"
    "    float mhat = m[i] / bc1, vhat = v[i] / bc2;\n"
    "    p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);\n"
    "  }\n"
    "}\n"},
};

// ---- which kernels an op launches, with every argument ----
// cg_cuda_launch (cg_internal.h) describes an op's launch as data: the kernels in order, each
// with its grid and one CgArg per kernel parameter (operands, the result, the parameter's
// gradient and moments, literal shapes and attributes, the step's seed, step and token0). The
// unit's launch plan comment below and the CUDA host program (emit_cuda_host.c) both print
// from it. Every kernel runs CG_CUDA_BLOCK (= MK_BLOCK) threads per block; the grid is the
// one the kernel's loops are written for: per element (MK_FOR), per row, token, choice or
// group (MK_FOR_BLOCKS), or a single block for the whole-tensor reductions.

static const IrType *arg_type(const IrOp *op, int i) {
  return op->args[i].param ? &op->args[i].param->type : &op->args[i].value->type;
}

static int64_t clamp_grid(int64_t g) { return g < 1 ? 1 : g > 65535 ? 65535 : g; }
static int64_t grid_elems(int64_t n) { return clamp_grid((n + CG_CUDA_BLOCK - 1) / CG_CUDA_BLOCK); }
static int64_t grid_blocks(int64_t n) { return clamp_grid(n); }

// Starts the next kernel call of l.
static CgKernelCall *call(CgLaunch *l, KernelId k, int64_t grid) {
  CgKernelCall *c = &l->call[l->ncalls++];
  c->kernel = k;
  c->grid = grid;
  return c;
}

static void arg(CgKernelCall *c, CgArgKind kind, int index) {
  if (c->nargs < CG_MAX_KERNEL_ARGS) c->args[c->nargs++] = (CgArg){.kind = kind, .index = index};
}

static void ints(CgKernelCall *c, const int64_t *v, int n) {
  for (int i = 0; i < n && c->nargs < CG_MAX_KERNEL_ARGS; i++) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_INT, .i = v[i]};
}
#define INTS(c, ...) ints(c, (const int64_t[]){__VA_ARGS__}, (int)(sizeof((const int64_t[]){__VA_ARGS__}) / sizeof(int64_t)))

static void flt(CgKernelCall *c, double f) {
  if (c->nargs < CG_MAX_KERNEL_ARGS) c->args[c->nargs++] = (CgArg){.kind = CG_ARG_FLOAT, .f = f};
}

// The operands 0..n-1, then the result: the pointer parameters of most kernels.
static void operands(CgKernelCall *c, int n, bool result) {
  for (int i = 0; i < n; i++) arg(c, CG_ARG_OPERAND, i);
  if (result) arg(c, CG_ARG_RESULT, 0);
}

// Routing shape shared by encode/decode: s m k e g cap, as emit_c's route_dims.
static void route(CgKernelCall *c, const IrOp *op, int64_t s, int64_t m, int64_t k) {
  INTS(c, s, m, k, ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
}

// A kernel over the op's operands and result with the given literal arguments after them.
static CgKernelCall *simple(CgLaunch *l, const IrOp *op, KernelId k, int64_t grid) {
  CgKernelCall *c = call(l, k, grid);
  operands(c, op->nargs, op->result != NULL);
  return c;
}

// Fills l for the single op; false when the op has no CUDA lowering.
static bool op_launch(const IrOp *op, CgLaunch *l) {
  const IrType *t0 = op->nargs ? arg_type(op, 0) : NULL;
  const IrType *rt = op->result ? &op->result->type : NULL;
  int64_t n = rt ? ir_type_numel(rt) : 0;
  CgKernelCall *c;
  switch (op->kind) {
  case IR_OP_MATMUL:
  case IR_OP_EXPERT_MATMUL:
    l->lib = "cuBLAS";
    return true;
  case IR_OP_COMM_ALLGATHER:
  case IR_OP_COMM_REDUCESCATTER:
  case IR_OP_COMM_ALLTOALL:
  case IR_OP_COMM_ALLREDUCE:
  case IR_OP_COMM_ALLREDUCE_GRAD:
    l->lib = "NCCL";
    return true;
  case IR_OP_COMM_SPLIT:  // this rank's slice: a device-to-device copy at the rank's offset
    l->lib = "copy";
    return true;
  case IR_OP_BIAS: INTS(simple(l, op, K_BIAS, grid_elems(n)), rt->dim[0], rt->dim[1]); return true;
  case IR_OP_BIAS_GRAD: INTS(simple(l, op, K_BIAS_GRAD, grid_elems(n)), t0->dim[0], t0->dim[1]); return true;
  case IR_OP_EXPERT_BIAS:
    INTS(simple(l, op, K_EXPERT_BIAS, grid_elems(n)), rt->dim[0], rt->dim[1], rt->dim[2]);
    return true;
  case IR_OP_EXPERT_BIAS_GRAD:
    INTS(simple(l, op, K_EXPERT_BIAS_GRAD, grid_elems(n)), t0->dim[0], t0->dim[1], t0->dim[2]);
    return true;
  case IR_OP_ADD: INTS(simple(l, op, K_ADD, grid_elems(n)), n); return true;
  case IR_OP_MUL: INTS(simple(l, op, K_MUL, grid_elems(n)), n); return true;
  case IR_OP_ACT_GELU: INTS(simple(l, op, K_GELU, grid_elems(n)), n); return true;
  case IR_OP_ACT_GELU_GRAD: INTS(simple(l, op, K_GELU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_ACT_RELU: INTS(simple(l, op, K_RELU, grid_elems(n)), n); return true;
  case IR_OP_ACT_RELU_GRAD: INTS(simple(l, op, K_RELU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_ACT_SILU: INTS(simple(l, op, K_SILU, grid_elems(n)), n); return true;
  case IR_OP_ACT_SILU_GRAD: INTS(simple(l, op, K_SILU_GRAD, grid_elems(n)), n); return true;
  case IR_OP_RESHAPE: INTS(simple(l, op, K_COPY, grid_elems(n)), n); return true;
  case IR_OP_L2NORM:
  case IR_OP_L2NORM_GRAD: {
    int64_t cols = rt->dim[rt->rank - 1];
    c = simple(l, op, op->kind == IR_OP_L2NORM ? K_L2NORM : K_L2NORM_GRAD, grid_blocks(n / cols));
    INTS(c, n / cols, cols);
    return true;
  }
  case IR_OP_DIV_SCALAR: INTS(simple(l, op, K_DIV_SCALAR, grid_elems(n)), n); return true;
  case IR_OP_DIV_SCALAR_GRAD_X: INTS(simple(l, op, K_DIV_SCALAR_GRAD_X, grid_elems(n)), n); return true;
  case IR_OP_DIV_SCALAR_GRAD_S: INTS(simple(l, op, K_DIV_SCALAR_GRAD_S, 1), ir_type_numel(t0)); return true;
  case IR_OP_GATE_NOISE:
    c = simple(l, op, K_GATE_NOISE, grid_elems(n));
    INTS(c, rt->dim[0], rt->dim[1]);
    flt(c, ir_op_float(op, "sigma", 0));
    INTS(c, ir_op_int(op, "layer", 0));
    arg(c, CG_ARG_SEED, 0);
    arg(c, CG_ARG_STEP, 0);
    arg(c, CG_ARG_TOKEN0, 0);
    return true;
  case IR_OP_GATE_SOFTMAX: INTS(simple(l, op, K_SOFTMAX, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1]); return true;
  case IR_OP_GATE_SOFTMAX_GRAD:
    INTS(simple(l, op, K_SOFTMAX_GRAD, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_SIGMOID: INTS(simple(l, op, K_SIGMOID, grid_elems(n)), n); return true;
  case IR_OP_GATE_SIGMOID_GRAD: INTS(simple(l, op, K_SIGMOID_GRAD, grid_elems(n)), n); return true;
  case IR_OP_GATE_SOFTMAX_TOKENS:
  case IR_OP_GATE_SOFTMAX_TOKENS_GRAD: {
    int64_t g = ir_op_int(op, "groups", 1);
    c = simple(l, op, op->kind == IR_OP_GATE_SOFTMAX_TOKENS ? K_SOFTMAX_TOKENS : K_SOFTMAX_TOKENS_GRAD,
               grid_elems(g * rt->dim[1]));
    INTS(c, rt->dim[0], rt->dim[1], g);
    return true;
  }
  case IR_OP_GATE_TOPK: INTS(simple(l, op, K_TOPK, grid_elems(t0->dim[0])), t0->dim[0], t0->dim[1], rt->dim[1]); return true;
  case IR_OP_GATE_GATHER:
    INTS(simple(l, op, K_GATE_GATHER, grid_elems(t0->dim[0])), t0->dim[0], t0->dim[1], rt->dim[1],
         ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_GATHER_GRAD:
    INTS(simple(l, op, K_GATE_GATHER_GRAD, grid_elems(rt->dim[0])), rt->dim[0], rt->dim[1], t0->dim[1],
         ir_op_int(op, "renorm", 0));
    return true;
  case IR_OP_GATE_LOCATIONS:  // dropless: capacity 0 to the kernel, as on the CPU
    c = call(l, K_GATE_LOCATIONS, grid_blocks(ir_op_int(op, "groups", 1) * ir_op_int(op, "experts", 1)));
    operands(c, 1, true);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
         ir_op_int(op, "dropless", 0) ? 0 : ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_EXPERT_CHOICE:
    c = simple(l, op, K_EXPERT_CHOICE, grid_blocks(ir_op_int(op, "groups", 1) * t0->dim[1]));
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1), ir_op_int(op, "capacity", 0));
    return true;
  case IR_OP_GATE_IOTA:  // the scores operand only gives the shape
    c = call(l, K_IOTA, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, rt->dim[0], rt->dim[1]);
    return true;
  case IR_OP_GATE_AUX_LOSS:
    c = simple(l, op, K_AUX_LOSS, 1);
    INTS(c, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1));
    flt(c, (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_AUX_LOSS_GRAD:
    c = simple(l, op, K_AUX_LOSS_GRAD, grid_blocks(ir_op_int(op, "groups", 1)));
    c->shared_bytes = (unsigned)(t0->dim[1] * (int64_t)sizeof(double));
    INTS(c, t0->dim[0], t0->dim[1], arg_type(op, 1)->dim[1], ir_op_int(op, "groups", 1));
    flt(c, ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS:
    c = simple(l, op, K_Z_LOSS, 1);
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1));
    flt(c, (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_GATE_Z_LOSS_GRAD:
    c = simple(l, op, K_Z_LOSS_GRAD, grid_elems(t0->dim[0]));
    INTS(c, t0->dim[0], t0->dim[1], ir_op_int(op, "groups", 1));
    flt(c, ir_op_float(op, "coef", 0) / (double)ir_op_int(op, "share", 1));
    return true;
  case IR_OP_ORDER_ENCODE:  // empty slots are zero: the dispatch buffer is cleared first
    c = call(l, K_ZERO, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, n);
    route(simple(l, op, K_ORDER_ENCODE, grid_blocks(t0->dim[0] * arg_type(op, 1)->dim[1])), op, t0->dim[0],
          t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_ENCODE_GRAD:
    route(simple(l, op, K_ORDER_ENCODE_GRAD, grid_blocks(rt->dim[0])), op, rt->dim[0], rt->dim[1],
          arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE:
    route(simple(l, op, K_ORDER_DECODE, grid_blocks(rt->dim[0])), op, rt->dim[0], rt->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_Y:
    c = call(l, K_ZERO, grid_elems(n));
    arg(c, CG_ARG_RESULT, 0);
    INTS(c, n);
    route(simple(l, op, K_ORDER_DECODE_GRAD_Y, grid_blocks(t0->dim[0] * arg_type(op, 1)->dim[1])), op, t0->dim[0],
          t0->dim[1], arg_type(op, 1)->dim[1]);
    return true;
  case IR_OP_ORDER_DECODE_GRAD_G:
    route(simple(l, op, K_ORDER_DECODE_GRAD_GATES, grid_blocks(t0->dim[0] * arg_type(op, 2)->dim[1])), op,
          t0->dim[0], t0->dim[1], arg_type(op, 2)->dim[1]);
    return true;
  case IR_OP_ORDER_DISPATCH_MASK:
  case IR_OP_ORDER_COMBINE_WEIGHTS:
  case IR_OP_ORDER_COMBINE_WEIGHTS_GRAD: {
    const IrType *idx = arg_type(op, op->kind == IR_OP_ORDER_COMBINE_WEIGHTS_GRAD ? 1 : 0);
    if (op->kind == IR_OP_ORDER_COMBINE_WEIGHTS_GRAD)
      c = simple(l, op, K_COMBINE_WEIGHTS_GRAD, grid_elems(idx->dim[0] * idx->dim[1]));
    else
      c = simple(l, op, op->kind == IR_OP_ORDER_DISPATCH_MASK ? K_DISPATCH_MASK : K_COMBINE_WEIGHTS,
                 grid_blocks(idx->dim[0]));
    INTS(c, idx->dim[0], idx->dim[1], ir_op_int(op, "experts", 0), ir_op_int(op, "groups", 1),
         ir_op_int(op, "capacity", 0));
    return true;
  }
  case IR_OP_HOOK_COMPRESS:
    INTS(simple(l, op, rt->dtype == IR_BF16 ? K_COMPRESS_BF16 : K_COMPRESS_F16, grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_DECOMPRESS:
    INTS(simple(l, op, t0->dtype == IR_BF16 ? K_DECOMPRESS_BF16 : K_DECOMPRESS_F16, grid_elems(n)), n);
    return true;
  case IR_OP_HOOK_SCALES:
  case IR_OP_HOOK_COMPRESS_INT8:
  case IR_OP_HOOK_DECOMPRESS_INT8: {
    int64_t cols = t0->dim[t0->rank - 1], rows = ir_type_numel(t0) / cols;
    if (op->kind == IR_OP_HOOK_SCALES) c = simple(l, op, K_INT8_SCALES, grid_blocks(rows));
    else c = simple(l, op, op->kind == IR_OP_HOOK_COMPRESS_INT8 ? K_COMPRESS_INT8 : K_DECOMPRESS_INT8, grid_elems(rows * cols));
    INTS(c, rows, cols);
    return true;
  }
  case IR_OP_HOOK_RECORD:  // statistics on the device; the host writes the record line
    c = call(l, K_RECORD_STATS, 1);
    operands(c, 1, false);
    arg(c, CG_ARG_STATS, 0);
    INTS(c, ir_type_numel(t0));
    snprintf(l->note, sizeof l->note, "point %s, layer %" PRId64, ir_op_str(op, "point", "?"), ir_op_int(op, "layer", 0));
    return true;
  case IR_OP_LAYOUT_EXPERT_MAJOR:
  case IR_OP_LAYOUT_RANK_MAJOR: {
    bool em = op->kind == IR_OP_LAYOUT_EXPERT_MAJOR;
    c = simple(l, op, em ? K_EXPERT_MAJOR : K_RANK_MAJOR, grid_elems(n));
    INTS(c, ir_op_int(op, "blocks", 1), em ? rt->dim[0] : t0->dim[0], em ? t0->dim[1] : rt->dim[1], rt->dim[2]);
    return true;
  }
  case IR_OP_LAYOUT_CHUNK:
  case IR_OP_LAYOUT_CONCAT: {  // bytes
    int64_t blocks = ir_op_int(op, "blocks", 1);
    int64_t inner = ir_type_bytes(rt) / (rt->dim[0] * rt->dim[1]);
    if (op->kind == IR_OP_LAYOUT_CHUNK) {
      c = simple(l, op, K_LAYOUT_CHUNK, grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, inner, ir_op_int(op, "chunks", 1), ir_op_int(op, "index", 0));
    } else {
      c = simple(l, op, K_LAYOUT_CONCAT, grid_elems(ir_type_bytes(rt)));
      INTS(c, t0->dim[0], blocks, t0->dim[1] / blocks, arg_type(op, 1)->dim[1] / blocks, inner);
    }
    return true;
  }
  case IR_OP_LOSS_MSE:
    c = simple(l, op, K_MSE, 1);
    INTS(c, ir_type_numel(t0));
    flt(c, ir_op_float(op, "scale", 1));
    return true;
  case IR_OP_LOSS_MSE_GRAD:
    c = simple(l, op, K_MSE_GRAD, grid_elems(n));
    INTS(c, n);
    flt(c, ir_op_float(op, "scale", 1));
    return true;
  case IR_OP_PARAM_GRAD: {  // value -> the parameter's gradient; the host skips it when computed in place
    int64_t count = ir_type_numel(&op->args[0].param->type);
    c = call(l, K_COPY, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 1);
    arg(c, CG_ARG_GRAD, 0);
    INTS(c, count);
    snprintf(l->note, sizeof l->note, "nothing when computed in place");
    return true;
  }
  case IR_OP_OPT_SGD: {
    int64_t count = ir_type_numel(t0);
    c = call(l, K_SGD, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 0);
    arg(c, CG_ARG_GRAD, 0);
    INTS(c, count);
    flt(c, ir_op_float(op, "lr", 0));
    flt(c, ir_op_float(op, "weight_decay", 0));
    return true;
  }
  case IR_OP_OPT_ADAMW: {
    int64_t count = ir_type_numel(t0);
    c = call(l, K_ADAMW, grid_elems(count));
    arg(c, CG_ARG_OPERAND, 0);
    arg(c, CG_ARG_GRAD, 0);
    arg(c, CG_ARG_MOMENT_M, 0);
    arg(c, CG_ARG_MOMENT_V, 0);
    INTS(c, count);
    flt(c, ir_op_float(op, "lr", 0));
    flt(c, ir_op_float(op, "beta1", 0.9));
    flt(c, ir_op_float(op, "beta2", 0.999));
    flt(c, ir_op_float(op, "eps", 1e-8));
    flt(c, ir_op_float(op, "weight_decay", 0));
    arg(c, CG_ARG_STEP, 0);
    return true;
  }
  default:
    return false;
  }
}

// ---- fused gates ----

// Arena byte range of value v, or false when it is not in the arena.
static bool arena_range(const PassMemPlan *plan, const IrValue *v, int64_t *lo, int64_t *hi) {
  const PassMemSlot *s = &plan->slot[v->func->index][v->id];
  if (s->kind != PASS_MEM_ARENA) return false;
  *lo = s->offset;
  *hi = s->offset + ir_type_bytes(&v->type);
  return true;
}

static bool overlap(const PassMemPlan *plan, const IrValue *a, const IrValue *b) {
  int64_t a0, a1, b0, b1;
  if (!arena_range(plan, a, &a0, &a1) || !arena_range(plan, b, &b0, &b1)) return false;
  return a0 < b1 && b0 < a1;
}

// Ops i, i+1, i+2 of f are `scores = gate.softmax|gate.sigmoid x`, `idx = gate.topk scores`,
// `gates = gate.gather scores, idx` with no buffer of the four shared (one thread writes a
// token's scores, idx and gates while others read logits), on one stream with no event
// recorded or waited for between them: one fused kernel does them.
static bool fused_gate_at(const PassMemPlan *plan, const IrFunc *f, int i) {
  if (i + 2 >= f->nops) return false;
  const IrOp *a = f->ops[i], *b = f->ops[i + 1], *c = f->ops[i + 2];
  if ((a->kind != IR_OP_GATE_SOFTMAX && a->kind != IR_OP_GATE_SIGMOID) || b->kind != IR_OP_GATE_TOPK ||
      c->kind != IR_OP_GATE_GATHER)
    return false;
  if (!a->args[0].value || b->args[0].value != a->result || c->args[0].value != a->result ||
      c->args[1].value != b->result)
    return false;
  if (a->result->type.rank != 2 || a->result->type.dtype != IR_F32) return false;
  if (b->stream != a->stream || c->stream != a->stream || a->event >= 0 || b->event >= 0 || b->nwaits > 0 ||
      c->nwaits > 0)
    return false;
  const IrValue *v[4] = {a->args[0].value, a->result, b->result, c->result};
  for (int p = 0; p < 4; p++)
    for (int q = p + 1; q < 4; q++)
      if (overlap(plan, v[p], v[q])) return false;
  return true;
}

bool cg_cuda_launch(const PassMemPlan *plan, const IrFunc *f, int i, CgLaunch *l) {
  memset(l, 0, sizeof *l);
  l->nops = 1;
  if (!fused_gate_at(plan, f, i)) return op_launch(f->ops[i], l);
  // logits (op i's operand), then scores, idx and gates (the results of ops i, i+1, i+2).
  const IrOp *a = f->ops[i], *g = f->ops[i + 2];
  const IrType *st = &a->result->type;
  CgKernelCall *c = call(l, a->kind == IR_OP_GATE_SOFTMAX ? K_GATE_SOFTMAX_TOPK_GATHER : K_GATE_SIGMOID_TOPK_GATHER,
                         grid_elems(st->dim[0]));
  arg(c, CG_ARG_OPERAND, 0);
  for (int r = 0; r < 3; r++) arg(c, CG_ARG_RESULT, r);
  INTS(c, st->dim[0], st->dim[1], g->result->type.dim[1], ir_op_int(g, "renorm", 0));
  l->nops = 3;
  return true;
}

#undef INTS

int cg_cuda_kernel_count(void) { return K_COUNT; }

const char *cg_cuda_kernel_name(int k) { return k >= 0 && k < K_COUNT ? kernel_src[k].name : "?"; }

int cg_cuda_kernel_params(int k, CgParamType *types, int max) {
  char signature[96];   // "void mk_add(": where the parameter list starts
  snprintf(signature, sizeof signature, "void %s(", kernel_src[k].name);
  const char *p = strstr(kernel_src[k].src, signature);
  if (!p) UNREACHABLE();
  p += strlen(signature) - 1;
  int n = 0;
  for (p++; *p && *p != ')';) {
    const char *end = p + strcspn(p, ",)");
    if (n == max) return -1;
    // The parameter's declaration: "const float *x", "int s", "i64 n", "u64 seed", "float lr".
    while (*p == ' ' || *p == '\n') p++;
    if (memchr(p, '*', (size_t)(end - p))) types[n] = CG_PARAM_POINTER;
    else if (strncmp(p, "int ", 4) == 0) types[n] = CG_PARAM_INT;
    else if (strncmp(p, "i64 ", 4) == 0) types[n] = CG_PARAM_I64;
    else if (strncmp(p, "u64 ", 4) == 0) types[n] = CG_PARAM_U64;
    else if (strncmp(p, "float ", 6) == 0) types[n] = CG_PARAM_FLOAT;
    else UNREACHABLE();
    n++;
    p = *end == ',' ? end + 1 : end;
  }
  return n;
}

bool cg_bf16_gemms(const IrModule *m) { return strcmp(ir_mod_str(m, "dtype", "fp32"), "bf16") == 0; }

int cg_cuda_bf16_cast_kernel(void) { return K_COMPRESS_BF16; }

int64_t cg_cuda_grid_elems(int64_t n) { return grid_elems(n); }

void cg_cuda_kernels_used(const IrModule *m, const PassMemPlan *plan, bool *used) {
  memset(used, 0, K_COUNT * sizeof *used);
  bool bf16 = cg_bf16_gemms(m);
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    for (int i = 0; i < f->nops;) {
      CgLaunch l;
      if (cg_cuda_launch(plan, f, i, &l)) {
        for (int k = 0; k < l.ncalls; k++) used[l.call[k].kernel] = true;
        if (bf16 && l.lib && strcmp(l.lib, "cuBLAS") == 0) used[K_COMPRESS_BF16] = true;   // the operands' cast
      }
      i += l.nops;
    }
  }
}

// ---- the translation units ----

void cg_emit_cuda_library(FILE *out) {
  fprintf(out, "// Generated by moec: every CUDA kernel of the CUDA target (%d), for NVRTC (sm_80, sm_90).\n\n%s\n",
          (int)K_COUNT, prelude_src);
  for (int k = 0; k < K_COUNT; k++) fprintf(out, "// ---- %s ----\n%s\n", kernel_src[k].name, kernel_src[k].src);
}

// Whether text calls __syncthreads, directly or through a prelude function that does (the
// prelude's functions come before their callers, so one pass in order finds them all).
static bool calls_syncthreads(const char *text, const char *const *syncing, int nsyncing) {
  if (strstr(text, "__syncthreads")) return true;
  for (int i = 0; i < nsyncing; i++) {
    char callee[80];
    snprintf(callee, sizeof callee, "%s(", syncing[i]);
    if (strstr(text, callee)) return true;
  }
  return false;
}

void cg_emit_cuda_kernel_list(FILE *out) {
  // The prelude's __device__ functions that synchronise: their names, found in source order.
  const char *syncing[32];
  char names[32][64];
  int nsyncing = 0;
  const char *mark = "__device__ ";
  for (const char *p = strstr(prelude_src, mark); p; p = strstr(p + 1, mark)) {
    const char *open = strchr(p, '('), *body = open ? strchr(open, '{') : NULL, *end = body;
    if (!body) UNREACHABLE();
    for (int depth = 0; *end; end++) {   // the body: to the brace that closes the first one
      depth += (*end == '{') - (*end == '}');
      if (depth == 0) break;
    }
    const char *name = open;
    while (name > p && name[-1] != ' ' && name[-1] != '*') name--;
    char *text = strndup(body, (size_t)(end - body));
    if (!text) UNREACHABLE();
    if (nsyncing < 32 && calls_syncthreads(text, syncing, nsyncing)) {
      snprintf(names[nsyncing], sizeof names[nsyncing], "%.*s", (int)(open - name), name);
      syncing[nsyncing] = names[nsyncing];
      nsyncing++;
    }
    free(text);
  }
  for (int k = 0; k < K_COUNT; k++)
    fprintf(out, "MK_KERNEL(%s, %d)\n", kernel_src[k].name, calls_syncthreads(kernel_src[k].src, syncing, nsyncing));
}

// "%x", "@p": an operand of op as the launch plan names it.
static void operand_name(char *buf, size_t n, const IrOperand *a) {
  if (a->param) snprintf(buf, n, "@%s", a->param->name);
  else snprintf(buf, n, "%%%s", a->value->name);
}

// One argument of a kernel call of op (the first of the launch's ops) as the plan prints it.
static void plan_arg(char *buf, size_t n, const IrFunc *f, int i, const CgArg *a) {
  const IrOp *op = f->ops[i];
  switch (a->kind) {
  case CG_ARG_OPERAND: operand_name(buf, n, &op->args[a->index]); return;
  case CG_ARG_RESULT: snprintf(buf, n, "%%%s", f->ops[i + a->index]->result->name); return;
  case CG_ARG_GRAD: snprintf(buf, n, "grad(@%s)", op->args[0].param->name); return;
  case CG_ARG_MOMENT_M: snprintf(buf, n, "m(@%s)", op->args[0].param->name); return;
  case CG_ARG_MOMENT_V: snprintf(buf, n, "v(@%s)", op->args[0].param->name); return;
  case CG_ARG_STATS: snprintf(buf, n, "stats"); return;
  case CG_ARG_INT: snprintf(buf, n, "%" PRId64, a->i); return;
  case CG_ARG_FLOAT: snprintf(buf, n, "%.9g", a->f); return;
  case CG_ARG_SEED: snprintf(buf, n, "seed"); return;
  case CG_ARG_STEP: snprintf(buf, n, "step"); return;
  case CG_ARG_TOKEN0: snprintf(buf, n, "token0"); return;
  }
  UNREACHABLE();
}

// The pointer arguments of a library op (cuBLAS, NCCL, copy): operands, then the result.
static void pointer_list(char *buf, size_t n, const IrOp *op) {
  size_t used = 0;
  buf[0] = 0;
  for (int i = 0; i < op->nargs && used < n; i++) {
    char name[128];
    operand_name(name, sizeof name, &op->args[i]);
    used += (size_t)snprintf(buf + used, n - used, "%s%s", i ? ", " : "", name);
  }
  if (op->result && used < n) snprintf(buf + used, n - used, "%s%%%s", op->nargs ? ", " : "", op->result->name);
}

bool cg_emit_cuda(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan) {
  bool ok = true;
  // Which kernels, and what goes to cuBLAS / NCCL.
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    for (int i = 0; i < f->nops;) {
      CgLaunch l;
      if (!cg_cuda_launch(plan, f, i, &l)) {
        const IrOp *op = f->ops[i];
        ok = ir_error_at(d, op->loc, "the CUDA target cannot emit op '%s'",
                         op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?");
      }
      i += l.nops;
    }
  }
  if (!ok) return false;
  bool used[K_COUNT];
  cg_cuda_kernels_used(m, plan, used);
  int nkernels = 0;
  for (int k = 0; k < K_COUNT; k++) nkernels += used[k];

  bool bf16 = cg_bf16_gemms(m);
  fprintf(out, "// Generated by moec: the CUDA kernels of model '%s' (%d kernels), for NVRTC\n"
               "// (sm_80, sm_90). Do not edit; change the .moe file and rebuild.\n//\n",
          m->name, nkernels);
  if (bf16)
    fprintf(out, "// dtype bf16: every GEMM below takes bf16 inputs, each fp32 operand rounded to bf16 (nearest\n"
                 "// even) by mk_compress_bf16 into a scratch copy first, and accumulates in fp32 into its fp32\n"
                 "// result; every other tensor and kernel is fp32.\n//\n");
  fprintf(out, "// Not in this unit (the host runtime issues them):\n");
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    for (int i = 0; i < f->nops; i++) {
      const IrOp *op = f->ops[i];
      CgLaunch l;
      memset(&l, 0, sizeof l);
      if (!op_launch(op, &l) || !l.lib) continue;
      char ptrs[512];
      pointer_list(ptrs, sizeof ptrs, op);
      fprintf(out, "//   %-8s @%s: %s %s", l.lib, f->name, ir_op_info[op->kind].name, ptrs);
      if (op->kind == IR_OP_MATMUL || op->kind == IR_OP_EXPERT_MATMUL) {
        fprintf(out, " [");
        for (int k = 0; k < op->result->type.rank; k++) fprintf(out, "%s%" PRId64, k ? ", " : "", op->result->type.dim[k]);
        fprintf(out, "]%s%s%s", ir_op_int(op, "ta", 0) ? " ta" : "", ir_op_int(op, "tb", 0) ? " tb" : "",
                bf16 ? " bf16 inputs" : "");
      } else {
        fprintf(out, " (group %s, size %" PRId64 ")", ir_op_str(op, "group", "world"), ir_op_int(op, "size", 1));
      }
      fprintf(out, "\n");
    }
  }
  fprintf(out, "\n%s\n", prelude_src);
  for (int k = 0; k < K_COUNT; k++)
    if (used[k]) fprintf(out, "// ---- %s ----\n%s\n", kernel_src[k].name, kernel_src[k].src);

  // The launch plan, in program order.
  fprintf(out, "// Launch plan (program order): op -> kernel<<<grid>>>(arguments...); every block has %d threads.\n",
          CG_CUDA_BLOCK);
  for (int fi = 0; fi < m->nfuncs; fi++) {
    const IrFunc *f = m->funcs[fi];
    fprintf(out, "// @%s\n", f->name);
    for (int i = 0; i < f->nops;) {
      const IrOp *op = f->ops[i];
      CgLaunch l;
      cg_cuda_launch(plan, f, i, &l);
      fprintf(out, "//   %s", ir_op_info[op->kind].name);
      for (int j = 1; j < l.nops; j++) fprintf(out, " + %s", ir_op_info[f->ops[i + j]->kind].name);
      if (l.lib) {
        char ptrs[512];
        pointer_list(ptrs, sizeof ptrs, op);
        bool cast = bf16 && strcmp(l.lib, "cuBLAS") == 0;
        fprintf(out, " %s -> %s%s\n", ptrs, cast ? "mk_compress_bf16 of each operand, " : "", l.lib);
        i += l.nops;
        continue;
      }
      fprintf(out, " ->");
      for (int k = 0; k < l.ncalls; k++) {
        const CgKernelCall *c = &l.call[k];
        fprintf(out, "%s %s<<<%" PRId64 ">>>(", k ? "," : "", kernel_src[c->kernel].name, c->grid);
        for (int a = 0; a < c->nargs; a++) {
          char buf[160];
          plan_arg(buf, sizeof buf, f, i, &c->args[a]);
          fprintf(out, "%s%s", a ? ", " : "", buf);
        }
        fprintf(out, ")");
      }
      fprintf(out, "%s%s\n", l.note[0] ? "  -- " : "", l.note);
      i += l.nops;
    }
  }
  return true;
}
