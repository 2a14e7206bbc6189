// Elementwise kernels of libmoert: zero, copy, add, mul, an in-place scale, and the division by a
// learned scalar (xmoe's router temperature) with its gradients. The siblings of
// codegen/cuda/elementwise.cu. Conventions of every CPU kernel: runtime/kernels.def.
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

void rt_zero(float *y, int64_t n) {
  if (n > 0)
    memset(y, 0, (size_t)n * sizeof *y);
}

void rt_copy(const float *x, float *y, int64_t n) {
  if (x != y && n > 0)
    memmove(y, x, (size_t)n * sizeof *y);
}

void rt_add(const float *a, const float *b, float *y, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    y[i] = a[i] + b[i];
}

// The gradient w.r.t. a is rt_mul(dy, b), w.r.t. b rt_mul(dy, a): no separate kernel.
void rt_mul(const float *a, const float *b, float *y, int64_t n) {
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    y[i] = a[i] * b[i];
}

void rt_scale(float *x, int64_t n, float s) {
  for (int64_t i = 0; i < n; i++) x[i] *= s;
}

void rt_div_scalar(const float *x, const float *s, float *y, int64_t n) {
  float d = s[0];
  for (int64_t i = 0; i < n; i++)
    y[i] = x[i] / d;
}

void rt_div_scalar_grad_x(const float *dy, const float *s, float *dx, int64_t n) {
  float d = s[0];
  for (int64_t i = 0; i < n; i++)
    dx[i] = dy[i] / d;
}

void rt_div_scalar_grad_s(const float *dy, const float *x, const float *s, float *ds, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++)
    acc += (double)dy[i] * x[i];
  double d = s[0];
  ds[0] = (float)(-acc / (d * d));
}
