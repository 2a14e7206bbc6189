// The optimizers SGD and AdamW, the siblings of runtime/kernels/optim.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: the optimizers' element updates ----
static __device__ float mk_sgd_at(float *p, const float *g, i64 i, float lr, float weight_decay, float grad_scale) {
  return p[i] -= lr * (g[i] * grad_scale + weight_decay * p[i]);
}

// AdamW of element i (bias corrections bc1, bc2), as rt_adamw; returns the new parameter.
static __device__ float mk_adamw_at(float *p, const float *g, float *m, float *v, i64 i, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, float bc1, float bc2, float grad_scale) {
  float gi = g[i] * grad_scale;
  m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
  v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
  float mhat = m[i] / bc1, vhat = v[i] / bc2;
  return p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);
}

// ---- mk_sgd ----
extern "C" __global__ void mk_sgd(float *p, const float *g, i64 n, float lr, float weight_decay, float lr_scale,
                                  float grad_scale) {
  lr *= lr_scale;
  MK_FOR(i, n) mk_sgd_at(p, g, i, lr, weight_decay, grad_scale);
}

// ---- mk_adamw ----
extern "C" __global__ void mk_adamw(float *p, const float *g, float *m, float *v, i64 n, float lr, float beta1,
                                    float beta2, float eps, float weight_decay, i64 step, float lr_scale,
                                    float grad_scale) {
  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  lr *= lr_scale;
  MK_FOR(i, n) mk_adamw_at(p, g, m, v, i, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale);
}

// ---- mk_sgd_bf16 ----
// mk_sgd, and each updated parameter rounded to bf16 into p16 (dtype bf16: the GEMMs' copy).
extern "C" __global__ void mk_sgd_bf16(float *p, const float *g, i64 n, float lr, float weight_decay, float lr_scale,
                                       float grad_scale, u16 *p16) {
  lr *= lr_scale;
  MK_FOR(i, n) p16[i] = mk_bf16_from_float(mk_sgd_at(p, g, i, lr, weight_decay, grad_scale));
}

// ---- mk_adamw_bf16 ----
// mk_adamw, and each updated parameter rounded to bf16 into p16 (dtype bf16: the GEMMs' copy).
extern "C" __global__ void mk_adamw_bf16(float *p, const float *g, float *m, float *v, i64 n, float lr, float beta1,
                                         float beta2, float eps, float weight_decay, i64 step, float lr_scale,
                                         float grad_scale, u16 *p16) {
  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  lr *= lr_scale;
  MK_FOR(i, n) p16[i] = mk_bf16_from_float(mk_adamw_at(p, g, m, v, i, lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale));
}
