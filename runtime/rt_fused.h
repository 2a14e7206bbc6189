// The elementwise functions of ir/scalar.def on the CPU, over a chunk of at most RT_FUSED_CHUNK
// elements: rt_fv_NAME(m, out, in...) computes out[i] = NAME(in...[i]) for i < m, the twin of the
// CUDA prelude's mk_f_NAME, in the vector loops of the CPU kernels (runtime/kernels/ffn.c: the
// exp-based factor in one loop, the product in another, which GCC vectorises well on every path).
// The CPU kernels (GELU, SiLU, gpt-oss's clamped SwiGLU, the sigmoid gate) and the fused loops of the generated CPU program
// (codegen/fused.c) both call these, so a fused group computes the bits of its ops one by one
// (rt_gelu_grad keeps its own loop for MOERT_ALL_SLOTS, where it does not zero empty slots; ReLU
// is a comparison either way).
#ifndef RT_FUSED_H
#define RT_FUSED_H

#include <math.h>
#include <stdint.h>

#include "rt_internal.h"

enum { RT_FUSED_CHUNK = 256 };

// GELU's s = 1 / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3); gelu(x) = x s.
#define RT_GELU_C 0.7978845608028654f
#define RT_GELU_A 0.044715f
static inline float rt_gelu_s(float v) { return 1.0f / (1.0f + rt_exp(-2.0f * RT_GELU_C * (v + RT_GELU_A * v * v * v))); }
// SiLU's s = sigmoid(x) = 1 / (1 + exp(-x)); silu(x) = x s.
static inline float rt_silu_s(float v) { return 1.0f / (1.0f + rt_exp(-v)); }
// gpt-oss's clamped SwiGLU (transformers' GptOssExperts, alpha 1.702 and limit 7): the gate g
// clamped above, g' = min(g, 7), the up projection u to u' = clamp(u, -7, 7), s = sigmoid(1.702
// g') = 1 / (1 + exp(-1.702 g')); oss(g, u) = (u' + 1) (g' s). The CUDA prelude's MK_OSS_*,
// mk_oss_gate, mk_oss_up and mk_f_oss* (codegen/cuda/ffn.cu) are the same float operations.
#define RT_OSS_ALPHA 1.702f
#define RT_OSS_LIMIT 7.0f
static inline float rt_oss_gate(float g) { return g > RT_OSS_LIMIT ? RT_OSS_LIMIT : g; }
static inline float rt_oss_up(float u) { return u < -RT_OSS_LIMIT ? -RT_OSS_LIMIT : u > RT_OSS_LIMIT ? RT_OSS_LIMIT : u; }
static inline float rt_oss_s(float g) { return 1.0f / (1.0f + rt_exp(-RT_OSS_ALPHA * rt_oss_gate(g))); }

static inline __attribute__((always_inline)) void rt_fv_gelu(int64_t m, float *y, const float *x) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_gelu_s(x[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) y[i] = x[i] * s[i];
}

// dy (s + 2 x s (1 - s) u'), u' = sqrt(2/pi) (1 + 3*0.044715 x^2); +0 where dy is zero (an
// expert's empty slots), as mk_f_gelu_grad.
static inline __attribute__((always_inline)) void rt_fv_gelu_grad(int64_t m, float *dx, const float *dy, const float *x) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_gelu_s(x[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) {
    float v = x[i], du = RT_GELU_C * (1.0f + 3.0f * RT_GELU_A * v * v);
    float g = dy[i] * (s[i] + 2.0f * v * s[i] * (1.0f - s[i]) * du);
    dx[i] = dy[i] == 0.0f ? 0.0f : g;
  }
}

static inline __attribute__((always_inline)) void rt_fv_relu(int64_t m, float *y, const float *x) {
RT_SIMD
  for (int64_t i = 0; i < m; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static inline __attribute__((always_inline)) void rt_fv_relu_grad(int64_t m, float *dx, const float *dy, const float *x) {
RT_SIMD
  for (int64_t i = 0; i < m; i++) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

static inline __attribute__((always_inline)) void rt_fv_silu(int64_t m, float *y, const float *x) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_silu_s(x[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) y[i] = x[i] * s[i];
}

static inline __attribute__((always_inline)) void rt_fv_silu_grad(int64_t m, float *dx, const float *dy, const float *x) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_silu_s(x[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) dx[i] = dy[i] * s[i] * (1.0f + x[i] * (1.0f - s[i]));
}

// oss(g, u) = (u' + 1) (g' s): s in one loop, the product in another (as SiLU).
static inline __attribute__((always_inline)) void rt_fv_oss(int64_t m, float *y, const float *g, const float *u) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_oss_s(g[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) y[i] = (rt_oss_up(u[i]) + 1.0f) * (rt_oss_gate(g[i]) * s[i]);
}

// Its gradients as torch's clamp passes them (where min <= x <= max, bounds included): d/dg =
// dy (u' + 1) s (1 + 1.702 g' (1 - s)) where g <= 7, else 0; d/du = dy (g' s) where -7 <= u <= 7,
// else 0. +0 where dy is zero (an expert's empty slots), as mk_f_oss_grad_gate and
// mk_f_oss_grad_up, which skip the exp there; a NaN g or u gives 0, a NaN dy NaN.
static inline __attribute__((always_inline)) void rt_fv_oss_grad_gate(int64_t m, float *dg, const float *dy, const float *g,
                                                                       const float *u) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_oss_s(g[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) {
    float d = (dy[i] * (rt_oss_up(u[i]) + 1.0f)) * (s[i] * (1.0f + RT_OSS_ALPHA * rt_oss_gate(g[i]) * (1.0f - s[i])));
    dg[i] = dy[i] != 0.0f && g[i] <= RT_OSS_LIMIT ? d : 0.0f;
  }
}

static inline __attribute__((always_inline)) void rt_fv_oss_grad_up(int64_t m, float *du, const float *dy, const float *g,
                                                                     const float *u) {
  float s[RT_FUSED_CHUNK];
RT_SIMD
  for (int64_t i = 0; i < m; i++) s[i] = rt_oss_s(g[i]);
RT_SIMD
  for (int64_t i = 0; i < m; i++) {
    float d = dy[i] * (rt_oss_gate(g[i]) * s[i]);
    du[i] = dy[i] != 0.0f && u[i] >= -RT_OSS_LIMIT && u[i] <= RT_OSS_LIMIT ? d : 0.0f;
  }
}

// The gate's sigmoid with libm's expf of a non-positive number (rt_sigmoid): a scalar loop, so
// that no vector expf of another library computes it.
static inline void rt_fv_sigmoid(int64_t m, float *y, const float *x) {
  for (int64_t i = 0; i < m; i++) {
    float v = x[i];
    if (v >= 0.0f) {
      y[i] = 1.0f / (1.0f + expf(-v));
    } else {
      float z = expf(v);
      y[i] = z / (1.0f + z);
    }
  }
}

static inline __attribute__((always_inline)) void rt_fv_sigmoid_grad(int64_t m, float *dx, const float *dy, const float *y) {
RT_SIMD
  for (int64_t i = 0; i < m; i++) dx[i] = dy[i] * y[i] * (1.0f - y[i]);
}

// The column sums of bias and norm-weight gradients (runtime/kernels/ffn.c column_sums, norm.c
// rt_scale_cols_grad_w), this thread's share of the work items without a barrier at the end
// (omp for nowait): the kernels run one in a parallel region of their own, a fused group of them
// (the CPU program's) all in one region. Outside a region the caller does all of it.
void rt_column_sums_share(const float *dy, float *db, int e, int rows, int n);
void rt_scale_cols_grad_w_share(const float *dy, const float *x, float *dw, int rows, int n);

// The norms' rows lo .. hi - 1 (runtime/kernels/norm.c: the rows of rt_rmsnorm, rt_layernorm and
// their gradients, one at a time in the vector path's copy), for a fused group of the CPU program
// that runs a norm between elementwise ops: each thread its own rows, then the ops after it.
void rt_rmsnorm_rows(const float *x, float *y, int64_t lo, int64_t hi, int n, float eps);
void rt_rmsnorm_grad_rows(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi, int n, float eps);
void rt_layernorm_rows(const float *x, float *y, int64_t lo, int64_t hi, int n, float eps);
void rt_layernorm_grad_rows(const float *dy, const float *x, float *dx, int64_t lo, int64_t hi, int n, float eps);

#endif
