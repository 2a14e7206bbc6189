// The optimizers SGD and AdamW. The siblings of codegen/cuda/optim.cu. Conventions of every CPU
// kernel: runtime/kernels.def.
#include <math.h>

#include "moert.h"
#include "rt_internal.h"

// Called inside rt_team (every thread of the pool runs the update's calls), each thread updates
// its share of the tensor (rt_team_share) and goes on to the next tensor without waiting; called
// alone, the loop is split over the pool when it is big enough. Per element either way: the bits
// do not depend on the threads.
static void sgd_share(float *p, const float *g, int64_t n, float lr, float weight_decay, float grad_scale) {
  int64_t lo, hi;
  rt_team_share(n, &lo, &hi);
  RT_SIMD
  for (int64_t i = lo; i < hi; i++)
    p[i] -= lr * (g[i] * grad_scale + weight_decay * p[i]);
}

void rt_sgd(float *p, const float *g, int64_t n, float lr, float weight_decay, float lr_scale, float grad_scale) {
  lr *= lr_scale;
  if (rt_in_team()) {
    sgd_share(p, g, n, lr, weight_decay, grad_scale);
    return;
  }
  RT_PARALLEL(n >= RT_PAR_MIN)
  sgd_share(p, g, n, lr, weight_decay, grad_scale);
}

typedef struct AdamW { float lr, beta1, beta2, eps, weight_decay, bc1, bc2, grad_scale; } AdamW;

static void adamw_share(float *p, const float *g, float *m, float *v, int64_t n, AdamW a) {
  int64_t lo, hi;
  rt_team_share(n, &lo, &hi);
  RT_SIMD
  for (int64_t i = lo; i < hi; i++) {
    float gi = g[i] * a.grad_scale;
    m[i] = a.beta1 * m[i] + (1.0f - a.beta1) * gi;
    v[i] = a.beta2 * v[i] + (1.0f - a.beta2) * gi * gi;
    float mhat = m[i] / a.bc1, vhat = v[i] / a.bc2;
    p[i] -= a.lr * (mhat / (sqrtf(vhat) + a.eps) + a.weight_decay * p[i]);
  }
}

void rt_adamw(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
              float beta2, float eps, float weight_decay, int64_t step, float lr_scale, float grad_scale) {
  AdamW a = {lr * lr_scale, beta1, beta2, eps, weight_decay, (float)(1.0 - pow(beta1, (double)step)),
             (float)(1.0 - pow(beta2, (double)step)), grad_scale};
  if (rt_in_team()) {
    adamw_share(p, g, m, v, n, a);
    return;
  }
  RT_PARALLEL(n >= RT_PAR_MIN)
  adamw_share(p, g, m, v, n, a);
}

// Aux-loss-free balancing (manual, `balance bias`): the correction bias moves by rate against the
// sign of its summed load imbalance (gate.balance_load): down for an expert above the mean load.
void rt_balance_update(float *p, const float *g, int64_t n, float rate) {
  int64_t lo = 0, hi = n;
  if (rt_in_team())
    rt_team_share(n, &lo, &hi);
  for (int64_t i = lo; i < hi; i++)
    p[i] -= rate * (float)((g[i] > 0.0f) - (g[i] < 0.0f));
}

// The optimizers, then the updated parameters rounded to bf16 (the CUDA target's dtype bf16 keeps
// its GEMMs' copy of the parameters so; here, the twins its kernels are checked against).
void rt_sgd_bf16(float *p, const float *g, int64_t n, float lr, float weight_decay, float lr_scale, float grad_scale,
                 uint16_t *p16) {
  rt_sgd(p, g, n, lr, weight_decay, lr_scale, grad_scale);
  rt_compress_bf16(p, p16, n);
}

void rt_adamw_bf16(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1, float beta2, float eps,
                   float weight_decay, int64_t step, float lr_scale, float grad_scale, uint16_t *p16) {
  rt_adamw(p, g, m, v, n, lr, beta1, beta2, eps, weight_decay, step, lr_scale, grad_scale);
  rt_compress_bf16(p, p16, n);
}

// A run of parameter tensors (the CUDA target's one launch; here, the twins its kernels are checked
// against): each range as rt_sgd / rt_adamw with its lr and weight decay, then its bf16 copy when
// p16 is not NULL. blocks and chunk say how the GPU splits the ranges; the result does not depend
// on them.
void rt_sgd_ranges(float *p, const float *g, const void *ranges, int nranges, int64_t blocks, int64_t chunk,
                   float lr_scale, float grad_scale, uint16_t *p16) {
  const RtUpdateRange *r = ranges;
  for (int j = 0; j < nranges; j++) {
    rt_sgd(p + r[j].start, g + r[j].start, r[j].n, r[j].lr, r[j].weight_decay, lr_scale, grad_scale);
    if (p16) rt_compress_bf16(p + r[j].start, p16 + r[j].start, r[j].n);
  }
}

void rt_adamw_ranges(float *p, const float *g, float *m, float *v, const void *ranges, int nranges, int64_t blocks,
                     int64_t chunk, float beta1, float beta2, float eps, int64_t step, float lr_scale,
                     float grad_scale, uint16_t *p16) {
  const RtUpdateRange *r = ranges;
  for (int j = 0; j < nranges; j++) {
    int64_t s = r[j].start;
    rt_adamw(p + s, g + s, m + s, v + s, r[j].n, r[j].lr, beta1, beta2, eps, r[j].weight_decay, step, lr_scale,
             grad_scale);
    if (p16) rt_compress_bf16(p + s, p16 + s, r[j].n);
  }
}
