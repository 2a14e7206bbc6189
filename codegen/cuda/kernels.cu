// The CUDA kernels of moec's CUDA target, one per row of codegen/kernels.def (mk_NAME), after a
// prelude of __device__ helpers. The build embeds this file (mk/embed_cuda.awk); `moec build
// --target cuda` hands NVRTC the prelude and the kernels a module uses. Each kernel starts at a
// line "// ---- mk_NAME ----"; what comes before the first one is the prelude. No #include
// (NVRTC has no system headers), extern "C" names, no host code. Every kernel reproduces the CPU
// kernel of libmoert it stands for: the same formulas, the same order of choices.

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
// result does not depend on timing (deterministic run to run).
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

// A row's sum of squares and, when dy is not NULL, its dot product with dy, reduced by the
// block in double (the l2norm and rmsnorm kernels).
__device__ void mk_row_ss_dot(const float *x, const float *dy, int n, double *ss, double *dot) {
  double a = 0.0, b = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    a += (double)x[i] * x[i];
    if (dy) b += (double)dy[i] * x[i];
  }
  *ss = mk_block_sum(a);
  if (dy) *dot = mk_block_sum(b);
}

// A row's mean and 1 / sqrt(variance + eps) (biased), reduced by the block in double (the
// layernorm kernels).
__device__ void mk_row_moments(const float *x, int n, float eps, double *mean, double *inv) {
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += x[i];
  *mean = mk_block_sum(s) / n;
  double ss = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    double d = x[i] - *mean;
    ss += d * d;
  }
  *inv = 1.0 / sqrt(mk_block_sum(ss) / n + (double)eps);
}

// logsumexp of a row reduced by the block: the max, then the sum of exponentials in double (the
// cross-entropy kernels).
__device__ double mk_block_logsumexp(const float *row, int v) {
  float mx = -MK_INF;
  for (int j = threadIdx.x; j < v; j += blockDim.x) mx = row[j] > mx ? row[j] : mx;
  mx = mk_block_max(mx);
  double s = 0.0;
  for (int j = threadIdx.x; j < v; j += blockDim.x) s += exp((double)row[j] - mx);
  return mx + log(mk_block_sum(s));
}

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

// ---- 16-bit formats on the bits, as runtime/hooks.c: round to nearest, ties to even ----
__device__ u32 mk_shift_round_even(u32 m, int shift) {
  u32 q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  return q;
}
__device__ u16 mk_half_from_float(float f) {
  u32 u = __float_as_uint(f);
  u16 sign = (u16)((u >> 16) & 0x8000);
  u32 a = u & 0x7fffffff, ex = a >> 23, mant = a & 0x7fffff;
  if (a > 0x7f800000) return sign | 0x7e00 | (u16)(mant >> 13);
  if (a >= 0x47800000) return sign | 0x7c00;
  if (a >= 0x38800000) {
    u32 h = ((ex - 112) << 10) | (mant >> 13);
    u32 rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return sign | (u16)h;
  }
  int shift = 126 - (int)ex;
  if (shift > 24) return sign;
  return sign | (u16)mk_shift_round_even(mant | 0x800000, shift);
}
__device__ float mk_float_from_half(u16 h) {
  u32 sign = (u32)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (ex == 31) return __uint_as_float(sign | 0x7f800000 | (mant << 13));
  if (ex == 0) return __uint_as_float(sign | __float_as_uint((float)mant * 5.9604644775390625e-8f));  // mant * 2^-24, exact
  return __uint_as_float(sign | ((ex + 112) << 23) | (mant << 13));
}
__device__ u16 mk_bf16_from_float(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffff) > 0x7f800000) return (u16)((u >> 16) | 0x0040);
  return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
__device__ float mk_float_from_bf16(u16 q) { return __uint_as_float((u32)q << 16); }

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

// GELU's s = 1 / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3), as runtime/kernels.c.
#define MK_GELU_C 0.7978845608028654f
#define MK_GELU_A 0.044715f
__device__ float mk_gelu_s(float v) { return 1.0f / (1.0f + mk_exp(-2.0f * MK_GELU_C * (v + MK_GELU_A * v * v * v))); }

// ---- per-row gate functions (the separate kernels and the fused gate kernels share them) ----
__device__ float mk_sigmoid1(float v) {
  if (v >= 0.0f) return 1.0f / (1.0f + expf(-v));
  float z = expf(v);
  return z / (1.0f + z);
}
__device__ void mk_row_softmax(const float *x, float *y, int e) {
  float mx = -MK_INF;
  for (int j = 0; j < e; j++)
    if (x[j] > mx) mx = x[j];
  double sum = 0.0;
  for (int j = 0; j < e; j++) {
    y[j] = expf(x[j] - mx);
    sum += y[j];
  }
  float inv = (float)(1.0 / sum);
  for (int j = 0; j < e; j++) y[j] *= inv;
}
// Order: score descending, index ascending; NaN ranks as -inf (runtime rt_topk).
__device__ void mk_row_topk(const float *row, int *out, int e, int k) {
  float prev_v = MK_INF;
  int prev_i = -1;
  for (int j = 0; j < k; j++) {
    int best = -1;
    float best_v = -MK_INF;
    for (int i = 0; i < e; i++) {
      float v = row[i];
      if (v != v) v = -MK_INF;
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
__device__ void mk_row_gather(const float *row, const int *ir, float *gr, int k, int renorm) {
  double sum = 0.0;
  for (int j = 0; j < k; j++) {
    gr[j] = row[ir[j]];
    sum += gr[j];
  }
  if (renorm && sum > 0.0)
    for (int j = 0; j < k; j++) gr[j] = (float)(gr[j] / sum);
}
__device__ double mk_row_logsumexp(const float *row, int e) {
  float mx = -MK_INF;
  for (int j = 0; j < e; j++)
    if (row[j] > mx) mx = row[j];
  double sum = 0.0;
  for (int j = 0; j < e; j++) sum += exp((double)row[j] - mx);
  return mx + log(sum);
}

// dispatch_mask / combine_weights: one block per token; the token's row of [s, e*g*cap] is
// zeroed, then its kept choices set (to the gate, or 1 when gates is NULL).
__device__ void mk_scatter_choices(const int *idx, const int *loc, const float *gates, float *out, int s, int k, int e,
                                   int g, int cap) {
  if (g < 1) g = 1;
  i64 width = (i64)e * g * cap;
  MK_FOR_BLOCKS(t, s) {
    float *row = out + t * width;
    for (i64 i = threadIdx.x; i < width; i += blockDim.x) row[i] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
      int gi = mk_group_of(s, g, (int)t);
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) row[mk_slot(idx, loc, c, gi, cap, g)] = gates ? gates[c] : 1.0f;
      }
    }
    __syncthreads();
  }
}

// ---- mk_zero ----
extern "C" __global__ void mk_zero(float *y, i64 n) {
  MK_FOR(i, n) y[i] = 0.0f;
}

// ---- mk_copy ----
extern "C" __global__ void mk_copy(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i];
}

// ---- mk_add ----
extern "C" __global__ void mk_add(const float *a, const float *b, float *y, i64 n) {
  MK_FOR(i, n) y[i] = a[i] + b[i];
}

// ---- mk_mul ----
extern "C" __global__ void mk_mul(const float *a, const float *b, float *y, i64 n) {
  MK_FOR(i, n) y[i] = a[i] * b[i];
}

// ---- mk_bias ----
extern "C" __global__ void mk_bias(const float *x, const float *b, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] + b[i % n];
}

// ---- mk_bias_grad ----
// One thread per column, rows summed in order in double: deterministic, as rt_bias_grad.
extern "C" __global__ void mk_bias_grad(const float *dy, float *db, int rows, int n) {
  MK_FOR(c, n) {
    double acc = 0.0;
    for (int r = 0; r < rows; r++) acc += dy[(i64)r * n + c];
    db[c] = (float)acc;
  }
}

// ---- mk_expert_bias ----
extern "C" __global__ void mk_expert_bias(const float *x, const float *b, float *y, int e, int rows, int n) {
  MK_FOR(i, (i64)e * rows * n) y[i] = x[i] + b[(i / ((i64)rows * n)) * n + i % n];
}

// ---- mk_expert_bias_grad ----
extern "C" __global__ void mk_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) {
  MK_FOR(i, (i64)e * n) {
    i64 ex = i / n, c = i % n;
    const float *d = dy + ex * rows * n;
    double acc = 0.0;
    for (int r = 0; r < rows; r++) acc += d[(i64)r * n + c];
    db[i] = (float)acc;
  }
}

// ---- mk_gelu ----
// The tanh GELU as x * s, s = 1 / (1 + exp(-2u)) = 0.5 (1 + tanh(u)), as rt_gelu computes it
// (cols, the row width, lets the CPU kernel copy repeated rows; every element is computed here).
extern "C" __global__ void mk_gelu(const float *x, float *y, i64 n, i64 cols) {
  MK_FOR(i, n) {
    float v = x[i];
    y[i] = v * mk_gelu_s(v);
  }
}

// ---- mk_gelu_grad ----
// +0 where dy is zero (an expert's empty slots), without the exp, as rt_gelu_grad.
extern "C" __global__ void mk_gelu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) {
    if (dy[i] == 0.0f) {
      dx[i] = 0.0f;
      continue;
    }
    float v = x[i], s = mk_gelu_s(v);
    float du = MK_GELU_C * (1.0f + 3.0f * MK_GELU_A * v * v);
    dx[i] = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}

// ---- mk_relu ----
extern "C" __global__ void mk_relu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

// ---- mk_relu_grad ----
extern "C" __global__ void mk_relu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// ---- mk_silu ----
extern "C" __global__ void mk_silu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i] * mk_sigmoid1(x[i]);
}

// ---- mk_silu_grad ----
extern "C" __global__ void mk_silu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) {
    float sg = mk_sigmoid1(x[i]);
    dx[i] = dy[i] * sg * (1.0f + x[i] * (1.0f - sg));
  }
}

// ---- mk_l2norm ----
// One block (MK_BLOCK threads) per row.
extern "C" __global__ void mk_l2norm(const float *x, float *y, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double ss;
    mk_row_ss_dot(xr, NULL, n, &ss, NULL);
    float inv = (float)(1.0 / sqrt(ss + 1e-12));
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv;
  }
}

// ---- mk_l2norm_grad ----
extern "C" __global__ void mk_l2norm_grad(const float *dy, const float *x, float *dx, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    double ss, dot;
    mk_row_ss_dot(xr, dr, n, &ss, &dot);
    double norm = sqrt(ss + 1e-12);
    float inv = (float)(1.0 / norm), proj = (float)(dot / (norm * norm * norm));
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dr[i] * inv - xr[i] * proj;
  }
}

// ---- mk_rmsnorm ----
// One block (MK_BLOCK threads) per row; as rt_rmsnorm (runtime/kernels_norm.c).
extern "C" __global__ void mk_rmsnorm(const float *x, float *y, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double ss;
    mk_row_ss_dot(xr, NULL, n, &ss, NULL);
    float inv = (float)(1.0 / sqrt(ss / n + (double)eps));
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv;
  }
}

// ---- mk_rmsnorm_grad ----
extern "C" __global__ void mk_rmsnorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    double ss, dot;
    mk_row_ss_dot(xr, dr, n, &ss, &dot);
    double inv = 1.0 / sqrt(ss / n + (double)eps);
    float scale = (float)inv, proj = (float)(inv * inv * inv * dot / n);
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dr[i] * scale - xr[i] * proj;
  }
}

// ---- mk_layernorm ----
// One block per row; as rt_layernorm (runtime/kernels_norm.c).
extern "C" __global__ void mk_layernorm(const float *x, float *y, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double mean, inv;
    mk_row_moments(xr, n, eps, &mean, &inv);
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = (float)((xr[i] - mean) * inv);
  }
}

// ---- mk_layernorm_grad ----
extern "C" __global__ void mk_layernorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    double mean, inv, sd = 0.0, sdx = 0.0;
    mk_row_moments(xr, n, eps, &mean, &inv);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      sd += dr[i];
      sdx += dr[i] * ((xr[i] - mean) * inv);
    }
    sd = mk_block_sum(sd) / n;
    sdx = mk_block_sum(sdx) / n;
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = (float)(inv * (dr[i] - sd - (xr[i] - mean) * inv * sdx));
  }
}

// ---- mk_scale_cols ----
extern "C" __global__ void mk_scale_cols(const float *x, const float *w, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] * w[i % n];
}

// ---- mk_scale_cols_grad_w ----
// One thread per column, rows summed in order in double, as rt_scale_cols_grad_w.
extern "C" __global__ void mk_scale_cols_grad_w(const float *dy, const float *x, float *dw, int rows, int n) {
  MK_FOR(c, n) {
    double acc = 0.0;
    for (int r = 0; r < rows; r++) acc += (double)dy[(i64)r * n + c] * x[(i64)r * n + c];
    dw[c] = (float)acc;
  }
}

// ---- mk_scale_rows ----
extern "C" __global__ void mk_scale_rows(const float *x, const float *g, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] * g[i / n];
}

// ---- mk_scale_rows_grad_g ----
// One thread per row, columns summed in order in double, as rt_scale_rows_grad_g.
extern "C" __global__ void mk_scale_rows_grad_g(const float *dy, const float *x, float *dg, int rows, int n) {
  MK_FOR(r, rows) {
    double acc = 0.0;
    for (int i = 0; i < n; i++) acc += (double)dy[r * n + i] * x[r * n + i];
    dg[r] = (float)acc;
  }
}

// ---- mk_embed ----
extern "C" __global__ void mk_embed(const int *tokens, const float *table, float *y, int t, int m, int v) {
  MK_FOR(i, (i64)t * m) {
    int tok = tokens[i / m];
    y[i] = tok < 0 || tok >= v ? 0.0f : table[(i64)tok * m + i % m];
  }
}

// ---- mk_embed_grad ----
// One thread per column: it zeroes that column of dtable, then adds the tokens' rows in token
// order, as rt_embed_grad (deterministic, no atomics).
extern "C" __global__ void mk_embed_grad(const float *dy, const int *tokens, float *dtable, int t, int m, int v) {
  MK_FOR(j, m) {
    for (int r = 0; r < v; r++) dtable[(i64)r * m + j] = 0.0f;
    for (int i = 0; i < t; i++) {
      int tok = tokens[i];
      if (tok >= 0 && tok < v) dtable[(i64)tok * m + j] += dy[(i64)i * m + j];
    }
  }
}

// ---- mk_attn_fwd ----
// Causal grouped-query attention, tiled: a block takes a tile of blockDim.x consecutive query rows
// of one sample and head (MK_FOR_BLOCKS over samples x heads x tiles), stages the keys and values
// the tile sees through shared memory, MK_ATTN_KEYS(d) rows at a time, and each thread computes
// its row with the float operations of rt_attn_fwd (runtime/kernels_attn.c) in its order, so the
// targets agree to the bit. Nothing of size seq x seq exists anywhere. A head wider than half the
// staging buffer reads its keys from global memory instead. With a window W > 0 a row sees keys
// i - W < t <= i only, and a tile stages the keys from its first row's first one on.
#ifndef MK_ATTN_SH
#define MK_ATTN_SH 8192   // floats of shared memory a block stages keys and values in (32 KB)
#endif
#define MK_ATTN_KEYS(d) (2 * (d) <= MK_ATTN_SH ? MK_ATTN_SH / (2 * (d)) : 0)

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

// Pass 1 of a row: m = max_t s_t over the keys lo <= t <= i, staged KT at a time from the tile's
// first key `first` (every thread of the block takes part in the staging, whether its row is
// active or not).
static __device__ float mk_attn_max(const float *qi, const float *k, float *sh, MkAttnTile T, i64 r0, int first, int last,
                                    int lo, int kcols, int j, int d, float scale) {
  int KT = MK_ATTN_KEYS(d);
  float m = -3.40282347e38f;   // below every finite score (no INFINITY without headers)
  for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
    int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
    if (KT) {
      __syncthreads();
      mk_attn_stage(sh, k, r0, t0, n, kcols, j * d, d);
      __syncthreads();
    }
    for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
      const float *kt = KT ? sh + (i64)(t - t0) * d : k + (r0 + t) * kcols + (i64)j * d;
      float s = mk_attn_dot(qi, kt, d) * scale;
      m = s > m ? s : m;
    }
  }
  return m;
}

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
    float *oi = o + at;
    float m = mk_attn_max(qi, k, sh, T, r0, first, last, lo, kcols, j, d, scale), l = 0.0f;
    for (int c = 0; T.active && c < d; c++) oi[c] = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      if (KT) {
        __syncthreads();
        mk_attn_stage(sh, k, r0, t0, n, kcols, j * d, d);
        mk_attn_stage(sh + (i64)KT * d, v, r0, t0, n, kcols, j * d, d);
        __syncthreads();
      }
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = KT ? sh + (i64)(t - t0) * d : k + (r0 + t) * kcols + (i64)j * d;
        const float *vt = KT ? sh + (i64)(KT + t - t0) * d : v + (r0 + t) * kcols + (i64)j * d;
        float p = mk_exp(mk_attn_dot(qi, kt, d) * scale - m);
        l += p;
        for (int c = 0; c < d; c++) oi[c] += p * vt[c];
      }
    }
    for (int c = 0; T.active && c < d; c++) oi[c] /= l;
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
    float m = mk_attn_max(qi, k, sh, T, r0, first, last, lo, kcols, j, d, scale), l = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      if (KT) {
        __syncthreads();
        mk_attn_stage(sh, k, r0, t0, n, kcols, j * d, d);
        __syncthreads();
      }
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = KT ? sh + (i64)(t - t0) * d : k + (r0 + t) * kcols + (i64)j * d;
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
    float *dq = dqkv + r * width + (i64)T.h * d;
    for (int c = 0; T.active && c < d; c++) dq[c] = 0.0f;
    for (int t0 = first; t0 <= last; t0 += KT ? KT : last + 1) {
      int n = KT && last + 1 - t0 > KT ? KT : last + 1 - t0;
      if (KT) {
        __syncthreads();
        mk_attn_stage(sh, k, r0, t0, n, kcols, j * d, d);
        mk_attn_stage(sh + (i64)KT * d, v, r0, t0, n, kcols, j * d, d);
        __syncthreads();
      }
      for (int t = t0 > lo ? t0 : lo; T.active && t < t0 + n && t <= T.i; t++) {
        const float *kt = KT ? sh + (i64)(t - t0) * d : k + (r0 + t) * kcols + (i64)j * d;
        const float *vt = KT ? sh + (i64)(KT + t - t0) * d : v + (r0 + t) * kcols + (i64)j * d;
        float p = mk_exp(mk_attn_dot(q + at, kt, d) * scale - lse);
        float ds = p * (mk_attn_dot(dy + at, vt, d) - D);
        for (int c = 0; c < d; c++) dq[c] += ds * kt[c];
      }
    }
    for (int c = 0; T.active && c < d; c++) dq[c] *= scale;
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
    float *dk = dqkv + r * width + qcols + (i64)j * d, *dv = dk + kcols;
    for (int c = 0; T.active && c < d; c++) dk[c] = dv[c] = 0.0f;
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
            dk[c] += ds * qi[c];
            dv[c] += p * yi[c];
          }
        }
      }
    for (int c = 0; T.active && c < d; c++) dk[c] *= scale;
  }
}

// ---- mk_cols_slice ----
extern "C" __global__ void mk_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  MK_FOR(p, (i64)rows * width) y[p] = x[p / width * cols + offset + p % width];
}

// ---- mk_pos_add ----
// One thread per element, as rt_pos_add (runtime/kernels_lm.c).
extern "C" __global__ void mk_pos_add(const float *x, const float *table, float *y, int rows, int cols, int seq) {
  MK_FOR(p, (i64)rows * cols) {
    i64 r = p / cols;
    y[p] = x[p] + table[(r % seq) * cols + p % cols];
  }
}

// ---- mk_pos_add_grad ----
// One thread per element of dtable, summing its rows in row order as rt_pos_add_grad.
extern "C" __global__ void mk_pos_add_grad(const float *dy, float *dtable, int rows, int cols, int seq) {
  MK_FOR(p, (i64)seq * cols) {
    i64 i = p / cols, j = p % cols;
    float s = 0.0f;
    for (i64 r = i; r < rows; r += seq) s += dy[r * cols + j];
    dtable[p] = s;
  }
}

// ---- mk_rope ----
// One thread per rotated pair, as rt_rope (runtime/kernels_lm.c).
extern "C" __global__ void mk_rope(const float *x, float *y, int rows, int cols, int heads, int seq, float theta, int sign) {
  int d = cols / heads, half = d / 2;
  MK_FOR(p, (i64)rows * heads * half) {
    int c = (int)(p % half), h = (int)(p / half % heads);
    i64 r = p / half / heads;
    int pos = (int)(r % seq);
    double angle = pos * pow((double)theta, -2.0 * c / d);
    float cs = (float)cos(angle), sn = (float)(sign * sin(angle));
    i64 a = r * cols + (i64)h * d + c, b = a + half;
    float u = x[a], w = x[b];
    y[a] = u * cs - w * sn;
    y[b] = w * cs + u * sn;
  }
}

// ---- mk_xent ----
// One block: the rows one after another, each reduced by the block; loss[0] = scale * mean over
// rows of logsumexp - the target's logit.
extern "C" __global__ void mk_xent(const float *logits, const int *targets, float *loss, int t, int v, float scale) {
  double acc = 0.0;
  for (int i = 0; i < t; i++) {
    const float *row = logits + (i64)i * v;
    acc += mk_block_logsumexp(row, v) - row[targets[i]];
  }
  if (threadIdx.x == 0) loss[0] = t > 0 ? (float)(scale * acc / t) : 0.0f;
}

// ---- mk_xent_grad ----
// One block per row.
extern "C" __global__ void mk_xent_grad(const float *logits, const int *targets, float *dlogits, int t, int v, float scale) {
  MK_FOR_BLOCKS(i, t) {
    const float *row = logits + i * v;
    float *out = dlogits + i * v;
    double lse = mk_block_logsumexp(row, v), f = (double)scale / t;
    for (int j = threadIdx.x; j < v; j += blockDim.x) out[j] = (float)(f * (exp(row[j] - lse) - (j == targets[i])));
  }
}

// ---- mk_div_scalar ----
extern "C" __global__ void mk_div_scalar(const float *x, const float *s, float *y, i64 n) {
  float d = s[0];
  MK_FOR(i, n) y[i] = x[i] / d;
}

// ---- mk_div_scalar_grad_x ----
extern "C" __global__ void mk_div_scalar_grad_x(const float *dy, const float *s, float *dx, i64 n) {
  float d = s[0];
  MK_FOR(i, n) dx[i] = dy[i] / d;
}

// ---- mk_div_scalar_grad_s ----
// One block of MK_BLOCK threads.
extern "C" __global__ void mk_div_scalar_grad_s(const float *dy, const float *x, const float *s, float *ds, i64 n) {
  double acc = 0.0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) acc += (double)dy[i] * x[i];
  acc = mk_block_sum(acc);
  double d = s[0];
  if (threadIdx.x == 0) ds[0] = (float)(-acc / (d * d));
}

// ---- mk_gate_noise ----
// logits + sigma*N(0,1)/e; the normal of token t, expert j is
// mk_normal(key(key(key(seed, 4 = RT_STREAM_NOISE), step), layer), (token0 + t) * e + j).
extern "C" __global__ void mk_gate_noise(const float *logits, float *out, int s, int e, float sigma, int layer,
                                         u64 seed, i64 step, i64 token0) {
  u64 key = mk_key(mk_key(mk_key(seed, 4ULL), (u64)step), (u64)(i64)layer);
  double scale = (double)sigma / e;
  MK_FOR(i, (i64)s * e) {
    if (sigma == 0.0f) {
      out[i] = logits[i];
      continue;
    }
    i64 t = i / e, j = i % e;
    u64 base = (u64)(token0 + t) * (u64)e;
    out[i] = logits[i] + (float)(scale * mk_normal(key, base + (u64)j));
  }
}

// ---- mk_softmax ----
extern "C" __global__ void mk_softmax(const float *x, float *y, int s, int e) {
  MK_FOR(t, s) mk_row_softmax(x + t * e, y + t * e, e);
}

// ---- mk_softmax_grad ----
extern "C" __global__ void mk_softmax_grad(const float *dy, const float *y, float *dx, int s, int e) {
  MK_FOR(t, s) {
    const float *dr = dy + t * e, *yr = y + t * e;
    float *xr = dx + t * e;
    double dot = 0.0;
    for (int j = 0; j < e; j++) dot += (double)dr[j] * yr[j];
    float d = (float)dot;
    for (int j = 0; j < e; j++) xr[j] = yr[j] * (dr[j] - d);
  }
}

// ---- mk_sigmoid ----
extern "C" __global__ void mk_sigmoid(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = mk_sigmoid1(x[i]);
}

// ---- mk_sigmoid_grad ----
extern "C" __global__ void mk_sigmoid_grad(const float *dy, const float *y, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

// ---- mk_softmax_tokens ----
// One thread per (group, column): the column of a group in token order.
extern "C" __global__ void mk_softmax_tokens(const float *x, float *y, int s, int e, int g) {
  if (g < 1) g = 1;
  MK_FOR(i, (i64)g * e) {
    int gi = (int)(i / e), j = (int)(i % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    float mx = -MK_INF;
    for (int t = t0; t < t1; t++)
      if (x[(i64)t * e + j] > mx) mx = x[(i64)t * e + j];
    double sum = 0.0;
    for (int t = t0; t < t1; t++) {
      i64 k = (i64)t * e + j;
      y[k] = expf(x[k] - mx);
      sum += y[k];
    }
    float inv = (float)(1.0 / sum);
    for (int t = t0; t < t1; t++) y[(i64)t * e + j] *= inv;
  }
}

// ---- mk_softmax_tokens_grad ----
extern "C" __global__ void mk_softmax_tokens_grad(const float *dy, const float *y, float *dx, int s, int e, int g) {
  if (g < 1) g = 1;
  MK_FOR(i, (i64)g * e) {
    int gi = (int)(i / e), j = (int)(i % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double dot = 0.0;
    for (int t = t0; t < t1; t++) dot += (double)dy[(i64)t * e + j] * y[(i64)t * e + j];
    for (int t = t0; t < t1; t++) {
      i64 k = (i64)t * e + j;
      dx[k] = y[k] * (dy[k] - (float)dot);
    }
  }
}

// ---- mk_topk ----
extern "C" __global__ void mk_topk(const float *scores, int *idx, int s, int e, int k) {
  MK_FOR(t, s) mk_row_topk(scores + t * e, idx + t * k, e, k);
}

// ---- mk_gate_gather ----
extern "C" __global__ void mk_gate_gather(const float *scores, const int *idx, float *gates, int s, int e, int k,
                                          int renorm) {
  MK_FOR(t, s) mk_row_gather(scores + t * e, idx + t * k, gates + t * k, k, renorm);
}

// ---- mk_gate_gather_grad ----
extern "C" __global__ void mk_gate_gather_grad(const float *dgates, const float *scores, const int *idx, float *dscores,
                                               int s, int e, int k, int renorm) {
  MK_FOR(t, s) {
    const float *row = scores + t * e, *dg = dgates + t * k;
    const int *ir = idx + t * k;
    float *dr = dscores + t * e;
    for (int j = 0; j < e; j++) dr[j] = 0.0f;
    if (!renorm) {
      for (int j = 0; j < k; j++) dr[ir[j]] += dg[j];
      continue;
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += row[ir[j]];
    if (!(sum > 0.0)) continue;
    double dot = 0.0;
    for (int j = 0; j < k; j++) dot += (double)dg[j] * (row[ir[j]] / sum);
    for (int j = 0; j < k; j++) dr[ir[j]] += (float)((dg[j] - dot) / sum);
  }
}

// ---- mk_gate_softmax_topk_gather ----
// The fused gate of `gate gshard` (and xmoe): softmax -> top-k -> gather, one thread per token;
// the same results as mk_softmax, mk_topk and mk_gate_gather in sequence.
extern "C" __global__ void mk_gate_softmax_topk_gather(const float *logits, float *scores, int *idx, float *gates,
                                                       int s, int e, int k, int renorm) {
  MK_FOR(t, s) {
    float *row = scores + t * e;
    mk_row_softmax(logits + t * e, row, e);
    mk_row_topk(row, idx + t * k, e, k);
    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm);
  }
}

// ---- mk_gate_sigmoid_topk_gather ----
// The fused gate of `gate sigmoid`: sigmoid -> top-k -> gather, one thread per token.
extern "C" __global__ void mk_gate_sigmoid_topk_gather(const float *logits, float *scores, int *idx, float *gates,
                                                       int s, int e, int k, int renorm) {
  MK_FOR(t, s) {
    float *row = scores + t * e;
    for (int j = 0; j < e; j++) row[j] = mk_sigmoid1(logits[t * e + j]);
    mk_row_topk(row, idx + t * k, e, k);
    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm);
  }
}

// ---- mk_gate_locations ----
// One block per (routing group, expert): an expert's locations only depend on its own choices,
// numbered in [j, t] order (rt_gate_locations). The block's threads split the group's choice
// positions p = j*n + (t - t0) into contiguous runs; each counts the expert's choices in its run,
// an exclusive scan over the runs gives each run its first number, and a second pass numbers the
// choices: location = number when below cap (cap <= 0: dropless), else -1. Any grid and any block
// of at most MK_BLOCK threads give the same result. stats (may be NULL) gets int[g, e, 2]: kept
// and wanted choices per group and expert, for the host's drop count, loads and capacity_max.
extern "C" __global__ void mk_gate_locations(const int *idx, int *loc, int *stats, int s, int k, int e, int g,
                                             int cap) {
  __shared__ int first[MK_BLOCK];
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(b, (i64)g * e) {
    int gi = (int)(b / e), ex = (int)(b % e);
    int t0 = mk_group_begin(s, g, gi), n = mk_group_begin(s, g, gi + 1) - t0;
    i64 total = (i64)n * k, per = (total + blockDim.x - 1) / blockDim.x;
    i64 p0 = (i64)threadIdx.x * per, p1 = p0 + per < total ? p0 + per : total;
    int mine = 0;
    for (i64 p = p0; p < p1; p++) mine += idx[(i64)(t0 + p % n) * k + p / n] == ex;
    first[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
      int wanted = 0;
      for (int i = 0; i < (int)blockDim.x; i++) {
        int c = first[i];
        first[i] = wanted;
        wanted += c;
      }
      if (stats) {
        stats[((i64)gi * e + ex) * 2] = cap <= 0 || wanted < cap ? wanted : cap;
        stats[((i64)gi * e + ex) * 2 + 1] = wanted;
      }
    }
    __syncthreads();
    int number = first[threadIdx.x];
    for (i64 p = p0; p < p1; p++) {
      i64 c = (i64)(t0 + p % n) * k + p / n;
      if (idx[c] != ex) continue;
      loc[c] = cap <= 0 || number < cap ? number : -1;
      number++;
    }
    __syncthreads();  // first[] serves the block's next (group, expert)
  }
}

// ---- mk_expert_choice ----
// One block per (group, expert), one thread per token of the group: a token's rank is the
// number of tokens before it in (score descending, token ascending) order; the first cap keep
// their rank as location, the others get -1 (rt_expert_choice).
extern "C" __global__ void mk_expert_choice(const float *scores, int *loc, int s, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(b, (i64)g * e) {
    int gi = (int)(b / e), j = (int)(b % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;
    int take = cap < n ? cap : n;
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      float v = scores[(i64)t * e + j];
      if (v != v) v = -MK_INF;
      int rank = 0;
      for (int u = t0; u < t1; u++) {
        float w = scores[(i64)u * e + j];
        if (w != w) w = -MK_INF;
        rank += w > v || (w == v && u < t);
      }
      loc[(i64)t * e + j] = take > 0 && rank < take ? rank : -1;
    }
  }
}

// ---- mk_iota ----
extern "C" __global__ void mk_iota(int *idx, int s, int e) {
  MK_FOR(i, (i64)s * e) idx[i] = (int)(i % e);
}

// ---- mk_aux_loss ----
// One block of MK_BLOCK threads. Per group: me_i = mean score, ce_i = fraction of first choices;
// aux = mean over groups of E * sum_i me_i ce_i; out[0] = aux / share.
extern "C" __global__ void mk_aux_loss(const float *scores, const int *idx, float *out, int s, int e, int k, int g,
                                       float share) {
  if (g < 1) g = 1;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;
    double part = 0.0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
      double me = 0.0, ce = 0.0;
      for (int t = t0; t < t1; t++) {
        me += scores[(i64)t * e + i];
        ce += idx[(i64)t * k] == i;
      }
      if (n > 0) {
        me /= n;
        ce /= n;
      }
      part += me * ce;
    }
    total += e * mk_block_sum(part);
  }
  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;
}

// ---- mk_aux_loss_grad ----
// One block per group; dynamic shared memory e doubles. ce is a constant of the scores:
// d/dscores[t, i] = coef * E * ce_i / (n_g * G).
extern "C" __global__ void mk_aux_loss_grad(const float *scores, const int *idx, float *dscores, int s, int e, int k,
                                            int g, float coef) {
  MK_DYN_SHARED(double, mk_ce);
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(gi, g) {
    int t0 = mk_group_begin(s, g, (int)gi), t1 = mk_group_begin(s, g, (int)gi + 1), n = t1 - t0;
    for (int i = threadIdx.x; i < e; i += blockDim.x) {
      double ce = 0.0;
      for (int t = t0; t < t1; t++) ce += idx[(i64)t * k] == i;
      mk_ce[i] = n > 0 ? ce / n : 0.0;
    }
    __syncthreads();
    for (i64 q = threadIdx.x; q < (i64)n * e; q += blockDim.x) {
      int i = (int)(q % e);
      dscores[(i64)t0 * e + q] = (float)((double)coef * e * mk_ce[i] / ((double)n * g));
    }
    __syncthreads();
  }
}

// ---- mk_aux_pooled ----
// One block of MK_BLOCK threads: this rank's per-expert sums of the scores and of the top-k
// choices, stats [2, e] (rt_aux_pooled; the CUDA target refuses `aux pooled` for now).
extern "C" __global__ void mk_aux_pooled(const float *scores, const int *idx, float *stats, int s, int e, int k) {
  for (int i = threadIdx.x; i < e; i += blockDim.x) {
    double sum = 0.0, count = 0.0;
    for (int t = 0; t < s; t++) {
      sum += scores[(i64)t * e + i];
      for (int j = 0; j < k; j++) count += idx[(i64)t * k + j] == i;
    }
    stats[i] = (float)sum;
    stats[e + i] = (float)count;
  }
}

// ---- mk_aux_pooled_grad ----
// dscores[t, i] = coef * E * pooled[1, i] (F_i / N) for every token t.
extern "C" __global__ void mk_aux_pooled_grad(const float *pooled, float *dscores, int s, int e, float coef) {
  MK_FOR(q, (i64)s * e) {
    int i = (int)(q % e);
    dscores[q] = (float)((double)coef * e * pooled[e + i]);
  }
}

// ---- mk_z_loss ----
// One block of MK_BLOCK threads: mean over groups of the group's mean of logsumexp^2, / share.
extern "C" __global__ void mk_z_loss(const float *logits, float *out, int s, int e, int g, float share) {
  if (g < 1) g = 1;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double acc = 0.0;
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      double lse = mk_row_logsumexp(logits + (i64)t * e, e);
      acc += lse * lse;
    }
    acc = mk_block_sum(acc);
    if (t1 > t0) total += acc / (t1 - t0);
  }
  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;
}

// ---- mk_z_loss_grad ----
extern "C" __global__ void mk_z_loss_grad(const float *logits, float *dlogits, int s, int e, int g, float coef) {
  if (g < 1) g = 1;
  MK_FOR(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double scale = 2.0 * coef / ((double)(t1 - t0) * g);
    const float *row = logits + t * e;
    float *dr = dlogits + t * e;
    double lse = mk_row_logsumexp(row, e);
    for (int j = 0; j < e; j++) dr[j] = (float)(scale * lse * exp((double)row[j] - lse));
  }
}

// ---- mk_order_encode ----
// After mk_zero on disp: one block per choice copies the token's row to its slot (slots of kept
// choices are distinct, so nothing races).
extern "C" __global__ void mk_order_encode(const float *x, const int *idx, const int *loc, float *disp, int s, int m,
                                           int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    if (!mk_kept(loc, c, cap)) continue;
    int t = (int)(c / k);
    float *dst = disp + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;
    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] = x[(i64)t * m + i];
  }
}

// ---- mk_order_encode_grad ----
// One block per token: the sum of its kept choices' slot rows, in choice order.
extern "C" __global__ void mk_order_encode_grad(const float *ddisp, const int *idx, const int *loc, float *dx, int s,
                                                int m, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) acc += ddisp[mk_slot(idx, loc, c, gi, cap, g) * m + i];
      }
      dx[t * m + i] = acc;
    }
  }
}

// ---- mk_order_decode ----
// One block per token: sum over kept choices of gate * expert output row, in choice order.
extern "C" __global__ void mk_order_decode(const float *y, const int *idx, const int *loc, const float *gates,
                                           float *out, int s, int m, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) acc += gates[c] * y[mk_slot(idx, loc, c, gi, cap, g) * m + i];
      }
      out[t * m + i] = acc;
    }
  }
}

// ---- mk_order_decode_grad_y ----
// After mk_zero on dy: one block per kept choice writes gate * dout row to its slot.
extern "C" __global__ void mk_order_decode_grad_y(const float *dout, const int *idx, const int *loc,
                                                  const float *gates, float *dy, int s, int m, int k, int e, int g,
                                                  int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    if (!mk_kept(loc, c, cap)) continue;
    int t = (int)(c / k);
    float *dst = dy + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;
    float w = gates[c];
    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] += w * dout[(i64)t * m + i];
  }
}

// ---- mk_order_decode_grad_gates ----
// One block (MK_BLOCK threads) per choice: <dout row, slot row> in double.
extern "C" __global__ void mk_order_decode_grad_gates(const float *dout, const float *y, const int *idx,
                                                      const int *loc, float *dgates, int s, int m, int k, int e,
                                                      int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    bool keep = mk_kept(loc, c, cap);   // the same for the whole block
    if (!keep) {
      if (threadIdx.x == 0) dgates[c] = 0.0f;
      continue;
    }
    int t = (int)(c / k);
    const float *src = y + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m, *dr = dout + (i64)t * m;
    double dot = 0.0;
    for (int i = threadIdx.x; i < m; i += blockDim.x) dot += (double)dr[i] * src[i];
    dot = mk_block_sum(dot);
    if (threadIdx.x == 0) dgates[c] = (float)dot;
  }
}

// ---- mk_dispatch_mask ----
extern "C" __global__ void mk_dispatch_mask(const int *idx, const int *loc, float *mask, int s, int k, int e, int g,
                                            int cap) {
  mk_scatter_choices(idx, loc, 0, mask, s, k, e, g, cap);
}

// ---- mk_combine_weights ----
extern "C" __global__ void mk_combine_weights(const int *idx, const int *loc, const float *gates, float *cw, int s,
                                              int k, int e, int g, int cap) {
  mk_scatter_choices(idx, loc, gates, cw, s, k, e, g, cap);
}

// ---- mk_combine_weights_grad ----
extern "C" __global__ void mk_combine_weights_grad(const float *dcw, const int *idx, const int *loc, float *dgates,
                                                   int s, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  i64 width = (i64)e * g * cap;
  MK_FOR(c, (i64)s * k) {
    i64 t = c / k;
    dgates[c] = mk_kept(loc, c, cap) ? dcw[t * width + mk_slot(idx, loc, c, mk_group_of(s, g, (int)t), cap, g)] : 0.0f;
  }
}

// ---- mk_compress_f16 ----
extern "C" __global__ void mk_compress_f16(const float *x, u16 *q, i64 n) {
  MK_FOR(i, n) q[i] = mk_half_from_float(x[i]);
}

// ---- mk_decompress_f16 ----
extern "C" __global__ void mk_decompress_f16(const u16 *q, float *x, i64 n) {
  MK_FOR(i, n) x[i] = mk_float_from_half(q[i]);
}

// ---- mk_compress_bf16 ----
extern "C" __global__ void mk_compress_bf16(const float *x, u16 *q, i64 n) {
  MK_FOR(i, n) q[i] = mk_bf16_from_float(x[i]);
}

// ---- mk_decompress_bf16 ----
extern "C" __global__ void mk_decompress_bf16(const u16 *q, float *x, i64 n) {
  MK_FOR(i, n) x[i] = mk_float_from_bf16(q[i]);
}

// ---- mk_int8_scales ----
// One block (MK_BLOCK threads) per row: max|x| / 127 (every NaN ignored: `>` is false for it,
// as in runtime/hooks.c), 1 for a zero row.
extern "C" __global__ void mk_int8_scales(const float *x, float *scale, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    float mx = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float a = fabsf(x[r * n + i]);
      if (a > mx) mx = a;
    }
    mx = mk_block_max(mx);
    if (threadIdx.x == 0) scale[r] = mx > 0.0f ? mx / 127.0f : 1.0f;
  }
}

// ---- mk_compress_int8 ----
extern "C" __global__ void mk_compress_int8(const float *x, const float *scale, i8 *q, int rows, int n) {
  MK_FOR(i, (i64)rows * n) {
    float v = roundf(x[i] / scale[i / n]);
    if (v != v) v = 0.0f;
    q[i] = (i8)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
  }
}

// ---- mk_decompress_int8 ----
extern "C" __global__ void mk_decompress_int8(const i8 *q, const float *scale, float *x, int rows, int n) {
  MK_FOR(i, (i64)rows * n) x[i] = (float)q[i] * scale[i / n];
}

// ---- mk_record_stats ----
// One block of MK_BLOCK threads: out = {sum, max |x| over non-NaN, number of NaNs} for the
// host's record line (rt_record).
extern "C" __global__ void mk_record_stats(const float *x, double *out, i64 n) {
  double sum = 0.0, nans = 0.0;
  float mx = 0.0f;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
    sum += x[i];
    if (x[i] != x[i]) nans += 1.0;
    else mx = fmaxf(mx, fabsf(x[i]));
  }
  sum = mk_block_sum(sum);
  nans = mk_block_sum(nans);
  mx = mk_block_max(mx);
  if (threadIdx.x == 0) {
    out[0] = sum;
    out[1] = mx;
    out[2] = nans;
  }
}

// ---- mk_expert_major ----
// [blocks*experts, rows, m] seen as [blocks, experts, chunk] -> [experts, blocks, chunk].
extern "C" __global__ void mk_expert_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {
  i64 chunk = rows * m;
  MK_FOR(i, (i64)blocks * experts * chunk) {
    i64 o = i / chunk, w = i % chunk, ex = o / blocks, r = o % blocks;
    y[i] = x[(r * experts + ex) * chunk + w];
  }
}

// ---- mk_rank_major ----
extern "C" __global__ void mk_rank_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {
  i64 chunk = rows * m;
  MK_FOR(i, (i64)blocks * experts * chunk) {
    i64 o = i / chunk, w = i % chunk, r = o / experts, ex = o % experts;
    y[i] = x[(ex * blocks + r) * chunk + w];
  }
}

// ---- mk_layout_chunk ----
// Bytes: x [outer*blocks, rows, inner] -> slots [lo, hi) of every run, lo = index*rows/chunks,
// hi = (index+1)*rows/chunks (floor division: any chunks <= rows, sizes differ by at most one).
extern "C" __global__ void mk_layout_chunk(const unsigned char *x, unsigned char *y, i64 outer, i64 blocks, i64 rows,
                                           i64 inner, i64 chunks, i64 index) {
  i64 lo = index * rows / chunks, run = ((index + 1) * rows / chunks - lo) * inner;
  MK_FOR(i, outer * blocks * run) {
    i64 o = i / run, w = i % run;
    y[i] = x[(o * rows + lo) * inner + w];
  }
}

// ---- mk_layout_concat ----
extern "C" __global__ void mk_layout_concat(const unsigned char *a, const unsigned char *b, unsigned char *y,
                                            i64 outer, i64 blocks, i64 rows_a, i64 rows_b, i64 inner) {
  i64 ra = rows_a * inner, rb = rows_b * inner, run = ra + rb;
  MK_FOR(i, outer * blocks * run) {
    i64 o = i / run, w = i % run;
    y[i] = w < ra ? a[o * ra + w] : b[o * rb + (w - ra)];
  }
}

// ---- mk_mse ----
// One block of MK_BLOCK threads: out[0] = scale * mean((out - target)^2) / 2.
extern "C" __global__ void mk_mse(const float *out, const float *target, float *loss, i64 n, float scale) {
  double acc = 0.0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
    double d = (double)out[i] - target[i];
    acc += d * d;
  }
  acc = mk_block_sum(acc);
  if (threadIdx.x == 0) loss[0] = scale * (n > 0 ? (float)(acc / (2.0 * n)) : 0.0f);
}

// ---- mk_mse_grad ----
extern "C" __global__ void mk_mse_grad(const float *out, const float *target, float *dout, i64 n, float scale) {
  double inv = n > 0 ? 1.0 / n : 0.0;
  MK_FOR(i, n) {
    float v = (float)(((double)out[i] - target[i]) * inv);
    if (scale != 1.0f) v *= scale;
    dout[i] = v;
  }
}

// ---- mk_sgd ----
extern "C" __global__ void mk_sgd(float *p, const float *g, i64 n, float lr, float weight_decay, float lr_scale,
                                  float grad_scale) {
  lr *= lr_scale;
  MK_FOR(i, n) p[i] -= lr * (g[i] * grad_scale + weight_decay * p[i]);
}

// ---- mk_adamw ----
extern "C" __global__ void mk_adamw(float *p, const float *g, float *m, float *v, i64 n, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, i64 step, float lr_scale,
                                    float grad_scale) {
  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  lr *= lr_scale;
  MK_FOR(i, n) {
    float gi = g[i] * grad_scale;
    m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
    v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);
  }
}

