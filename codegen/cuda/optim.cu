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

// The update of a run of parameter tensors in one launch: a table of ranges (RtUpdateRange of
// runtime/moert.h, the same layout), each cut into blocks of chunk elements numbered from its
// block0; block w finds its range by bisection and updates its chunk.
typedef struct MkUpdateRange {
  i64 start, n, block0;
  float lr, weight_decay;
} MkUpdateRange;

static __device__ const MkUpdateRange *mk_update_range(const unsigned char *ranges, int nranges, i64 w) {
  const MkUpdateRange *r = (const MkUpdateRange *)ranges;
  int lo = 0, hi = nranges - 1;
  while (lo < hi) {
    int mid = (lo + hi + 1) / 2;
    if (r[mid].block0 <= w) lo = mid;
    else hi = mid - 1;
  }
  return r + lo;
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

// ---- mk_balance_update ----
extern "C" __global__ void mk_balance_update(float *p, const float *g, i64 n, float rate) {
  MK_FOR(i, n) p[i] -= rate * (float)((g[i] > 0.0f) - (g[i] < 0.0f));
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

// ---- mk_sgd_ranges ----
// mk_sgd over every range of the table (its lr and weight decay), and the bf16 copy when p16 is
// not NULL: the update of a run of parameter tensors in one launch.
extern "C" __global__ void mk_sgd_ranges(float *p, const float *g, const unsigned char *ranges, int nranges, i64 blocks,
                                         i64 chunk, float lr_scale, float grad_scale, u16 *p16) {
  MK_FOR_BLOCKS(w, blocks) {
    const MkUpdateRange *r = mk_update_range(ranges, nranges, w);
    i64 first = (w - r->block0) * chunk, end = first + chunk < r->n ? first + chunk : r->n;
    float lr = r->lr * lr_scale;
    for (i64 e = first + threadIdx.x; e < end; e += blockDim.x) {
      float np = mk_sgd_at(p, g, r->start + e, lr, r->weight_decay, grad_scale);
      if (p16) p16[r->start + e] = mk_bf16_from_float(np);
    }
  }
}

// ---- mk_adamw_ranges ----
// mk_adamw over every range of the table (its lr and weight decay; beta1, beta2 and eps are the
// run's), and the bf16 copy when p16 is not NULL: the update of a run of parameter tensors in one
// launch.
extern "C" __global__ void mk_adamw_ranges(float *p, const float *g, float *m, float *v, const unsigned char *ranges,
                                           int nranges, i64 blocks, i64 chunk, float beta1, float beta2, float eps,
                                           i64 step, float lr_scale, float grad_scale, u16 *p16) {
  float bc1 = (float)(1.0 - pow((double)beta1, (double)step));
  float bc2 = (float)(1.0 - pow((double)beta2, (double)step));
  MK_FOR_BLOCKS(w, blocks) {
    const MkUpdateRange *r = mk_update_range(ranges, nranges, w);
    i64 first = (w - r->block0) * chunk, end = first + chunk < r->n ? first + chunk : r->n;
    float lr = r->lr * lr_scale;
    for (i64 e = first + threadIdx.x; e < end; e += blockDim.x) {
      float np = mk_adamw_at(p, g, m, v, r->start + e, lr, beta1, beta2, eps, r->weight_decay, bc1, bc2, grad_scale);
      if (p16) p16[r->start + e] = mk_bf16_from_float(np);
    }
  }
}
