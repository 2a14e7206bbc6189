// The model's losses: cross-entropy over the vocabulary and the mean squared error; the
// siblings of runtime/kernels/loss.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: the cross-entropy's row logsumexp ----
// logsumexp of a row reduced by the block: the max, then the sum in double of mk_exp (rt_exp's
// float bits, as the CPU kernels) of the differences (the cross-entropy kernels).
__device__ double mk_block_logsumexp(const float *row, int v) {
  float mx = -MK_INF;
  for (int j = threadIdx.x; j < v; j += blockDim.x) mx = row[j] > mx ? row[j] : mx;
  mx = mk_block_max(mx);
  double s = 0.0;
  for (int j = threadIdx.x; j < v; j += blockDim.x) s += (double)mk_exp(row[j] - mx);
  return mx + log(mk_block_sum(s));
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
    for (int j = threadIdx.x; j < v; j += blockDim.x)
      out[j] = (float)(f * ((double)mk_exp((float)((double)row[j] - lse)) - (j == targets[i])));
  }
}

// ---- mk_xent_stats ----
// One block per row, as rt_xent_stats (runtime/kernels/loss.c): the slice's logsumexp as two
// floats, the target's logit where the slice holds it.
extern "C" __global__ void mk_xent_stats(const float *logits, const int *targets, float *stats, int t, int v, i64 v0) {
  MK_FOR_BLOCKS(i, t) {
    const float *row = logits + i * v;
    double lse = mk_block_logsumexp(row, v);
    i64 k = targets[i] - v0;
    if (threadIdx.x == 0) {
      float hi = (float)lse;
      stats[3 * i] = hi;
      stats[3 * i + 1] = (float)(lse - hi);
      stats[3 * i + 2] = k >= 0 && k < v ? row[k] : 0.0f;
    }
  }
}

// Row i's logsumexp over the whole vocabulary and its target's logit (rt_xent_vp's whole_lse).
__device__ double mk_whole_lse(const float *stats, int t, int parts, int i, double *target) {
  double m = -MK_INF, s = 0.0;
  *target = 0.0;
  for (int r = 0; r < parts; r++) {
    const float *p = stats + 3 * ((i64)r * t + i);
    double l = (double)p[0] + (double)p[1];
    m = l > m ? l : m;
    *target += p[2];
  }
  for (int r = 0; r < parts; r++) {
    const float *p = stats + 3 * ((i64)r * t + i);
    s += exp((double)p[0] + (double)p[1] - m);
  }
  return m + log(s);
}

// ---- mk_xent_vp ----
// One thread: the rows' terms in order, as rt_xent_vp.
extern "C" __global__ void mk_xent_vp(const float *stats, float *loss, int n, int parts, float scale) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  int t = parts > 0 ? n / parts : 0;
  double acc = 0.0;
  for (int i = 0; i < t; i++) {
    double target, lse = mk_whole_lse(stats, t, parts, i, &target);
    acc += lse - target;
  }
  loss[0] = t > 0 ? (float)(scale * acc / t) : 0.0f;
}

// ---- mk_xent_vp_grad ----
// One block per row, mk_xent_grad's operations with the whole row's logsumexp.
extern "C" __global__ void mk_xent_vp_grad(const float *logits, const int *targets, const float *stats, float *dlogits,
                                           int t, int v, int parts, i64 v0, float scale) {
  MK_FOR_BLOCKS(i, t) {
    const float *row = logits + i * v;
    float *out = dlogits + i * v;
    double target, lse = mk_whole_lse(stats, t, parts, (int)i, &target), f = (double)scale / t;
    i64 k = targets[i] - v0;
    for (int j = threadIdx.x; j < v; j += blockDim.x)
      out[j] = (float)(f * ((double)mk_exp((float)((double)row[j] - lse)) - (j == k)));
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

// ---- mk_mse_part ----
// The CUDA target's loss.mse in two launches (codegen/lower.c, cg_lower): gridDim.x blocks, block
// b sums (out - target)^2 over the elements i = b*MK_BLOCK + thread + j*gridDim.x*MK_BLOCK into
// part[b] (double); then mk_sum_parts. The grid depends on n only, so the sum does not change
// with the device (mk_mse, one block, took 28 ms of a 60 ms step at 16.7M elements on an H200).
extern "C" __global__ void mk_mse_part(const float *out, const float *target, double *part, i64 n) {
  double acc = 0.0;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (i64)gridDim.x * blockDim.x) {
    double d = (double)out[i] - target[i];
    acc += d * d;
  }
  acc = mk_block_sum(acc);
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// ---- mk_xent_part ----
// loss.xent in two launches: block b takes rows b, b + gridDim.x, ... and writes the sum of their
// logsumexp - the target's logit to part[b]; then mk_sum_parts.
extern "C" __global__ void mk_xent_part(const float *logits, const int *targets, double *part, int t, int v) {
  double acc = 0.0;
  for (int i = blockIdx.x; i < t; i += gridDim.x) {
    const float *row = logits + (i64)i * v;
    acc += mk_block_logsumexp(row, v) - row[targets[i]];
  }
  if (threadIdx.x == 0) part[blockIdx.x] = acc;
}

// ---- mk_sum_parts ----
// One block: out[0] = scale * (sum of part[0..nparts) in order) / div.
extern "C" __global__ void mk_sum_parts(const double *part, float *out, int nparts, i64 div, float scale) {
  double acc = 0.0;
  for (int i = threadIdx.x; i < nparts; i += blockDim.x) acc += part[i];
  acc = mk_block_sum(acc);
  if (threadIdx.x == 0) out[0] = scale * (div > 0 ? (float)(acc / (double)div) : 0.0f);
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
