// The optimizers SGD and AdamW. The siblings of codegen/cuda/optim.cu. Conventions of every CPU
// kernel: runtime/kernels.def.
#include <math.h>

#include "moert.h"
#include "rt_internal.h"

void rt_sgd(float *p, const float *g, int64_t n, float lr, float weight_decay, float lr_scale, float grad_scale) {
  lr *= lr_scale;
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++)
    p[i] -= lr * (g[i] * grad_scale + weight_decay * p[i]);
}

void rt_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
              float beta2, float eps, float weight_decay, int64_t step, float lr_scale, float grad_scale) {
  float bc1 = (float)(1.0 - pow(beta1, (double)step));
  float bc2 = (float)(1.0 - pow(beta2, (double)step));
  lr *= lr_scale;
  RT_PARALLEL_FOR_SIMD(n >= RT_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i] * grad_scale;
    m[i] = beta1 * m[i] + (1.0f - beta1) * gi;
    v[i] = beta2 * v[i] + (1.0f - beta2) * gi * gi;
    float mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= lr * (mhat / (sqrtf(vhat) + eps) + weight_decay * p[i]);
  }
}
