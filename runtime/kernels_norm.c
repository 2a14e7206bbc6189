// Normalisations over the last dimension of a [rows, n] matrix, one row at a time, with the sums
// in double (as the gate's l2norm in kernels_gate.c). The CUDA kernels of the same names
// (codegen/cuda/kernels.cu) run one block per row and reduce in the same precision.
//
// RMSNorm (Zhang and Sennrich 2019) without its learned scale, which is a separate op:
//   r = 1 / sqrt(mean(x^2) + eps),  y = x r,
//   dx = r dy - x r^3 <dy, x> / n.
#include <math.h>

#include "moert.h"

// 1 / sqrt(mean(x^2) + eps) of one row.
static double rms_inverse(const float *x, int n, float eps) {
  double ss = 0.0;
  for (int i = 0; i < n; i++) ss += (double)x[i] * x[i];
  return 1.0 / sqrt(ss / n + (double)eps);
}

void rt_rmsnorm(const float *x, float *y, int rows, int n, float eps) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    float *yr = y + (size_t)r * n;
    float inv = (float)rms_inverse(xr, n, eps);
    for (int i = 0; i < n; i++) yr[i] = xr[i] * inv;
  }
}

void rt_rmsnorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n, *dr = dy + (size_t)r * n;
    float *out = dx + (size_t)r * n;
    double inv = rms_inverse(xr, n, eps), dot = 0.0;
    for (int i = 0; i < n; i++) dot += (double)dr[i] * xr[i];
    float scale = (float)inv, proj = (float)(inv * inv * inv * dot / n);
    for (int i = 0; i < n; i++) out[i] = dr[i] * scale - xr[i] * proj;
  }
}
