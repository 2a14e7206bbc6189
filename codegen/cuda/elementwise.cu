// Elementwise CUDA kernels (zero, copy, add, mul, the division by a learned scalar), the siblings
// of runtime/kernels/elementwise.c.
// See prelude.cu for the conventions and for how the build embeds this file.

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
