// The optimizers SGD and AdamW, the siblings of runtime/kernels/optim.c.
// See prelude.cu for the conventions and for how the build embeds this file.

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
