// The gate's losses: the load-balancing aux loss (per group and pooled) and the router z-loss;
// the siblings of runtime/kernels/gate_loss.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: the z-loss's row logsumexp ----
__device__ double mk_row_logsumexp(const float *row, int e) {
  float mx = -MK_INF;
  for (int j = 0; j < e; j++)
    if (row[j] > mx) mx = row[j];
  double sum = 0.0;
  for (int j = 0; j < e; j++) sum += exp((double)row[j] - mx);
  return mx + log(sum);
}

// ---- mk_aux_loss ----
// One block of MK_BLOCK threads. Per group: me_i = mean score, ce_i = fraction of first choices;
// aux = mean over groups of E * sum_i me_i ce_i; out[0] = aux / share. The block takes
// blockDim.x / 32 experts at a time, 32 threads each striding over the group's tokens, summed in
// shared memory in a fixed order (one thread per expert read every token: 0.9 ms on an H200).
extern "C" __global__ void mk_aux_loss(const float *scores, const int *idx, float *out, int s, int e, int k, int g,
                                       float share) {
  __shared__ double sh_me[MK_BLOCK], sh_ce[MK_BLOCK];
  if (g < 1) g = 1;
  const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32, per = blockDim.x / lanes;
  const int j = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;
    double part = 0.0;
    for (int i0 = 0; i0 < e; i0 += per) {
      int i = i0 + j;
      double me = 0.0, ce = 0.0;
      if (i < e && j < per)
        for (int t = t0 + lane; t < t1; t += lanes) {
          me += scores[(i64)t * e + i];
          ce += idx[(i64)t * k] == i;
        }
      sh_me[threadIdx.x] = me;
      sh_ce[threadIdx.x] = ce;
      __syncthreads();
      if (threadIdx.x == 0)
        for (int q = 0; q < per && i0 + q < e; q++) {
          double m = 0.0, c = 0.0;
          for (int l = 0; l < lanes; l++) m += sh_me[q * lanes + l], c += sh_ce[q * lanes + l];
          if (n > 0) {
            m /= n;
            c /= n;
          }
          part += m * c;
        }
      __syncthreads();
    }
    total += e * part;
  }
  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;
}

// ---- mk_aux_loss_grad ----
// One block per group; dynamic shared memory e doubles. ce is a constant of the scores:
// d/dscores[t, i] = coef * E * ce_i / (n_g * G). The counts of first choices as in mk_aux_loss:
// blockDim.x / 32 experts at a time, 32 threads each striding over the group's tokens (whole
// numbers, so any order of the sums gives the same bits; one thread per expert reading every
// token took 0.6 ms of a step on an H200).
extern "C" __global__ void mk_aux_loss_grad(const float *scores, const int *idx, float *dscores, int s, int e, int k,
                                            int g, float coef) {
  MK_DYN_SHARED(double, mk_ce);
  __shared__ int sh_count[MK_BLOCK];
  if (g < 1) g = 1;
  const int lanes = blockDim.x < 32 ? (int)blockDim.x : 32, per = blockDim.x / lanes;
  const int j = threadIdx.x / lanes, lane = threadIdx.x % lanes;
  MK_FOR_BLOCKS(gi, g) {
    int t0 = mk_group_begin(s, g, (int)gi), t1 = mk_group_begin(s, g, (int)gi + 1), n = t1 - t0;
    for (int i0 = 0; i0 < e; i0 += per) {
      int i = i0 + j, count = 0;
      if (i < e && j < per)
        for (int t = t0 + lane; t < t1; t += lanes) count += idx[(i64)t * k] == i;
      sh_count[threadIdx.x] = count;
      __syncthreads();
      if (threadIdx.x < per && i0 + (int)threadIdx.x < e) {
        int c = 0;
        for (int l = 0; l < lanes; l++) c += sh_count[threadIdx.x * lanes + l];
        mk_ce[i0 + threadIdx.x] = n > 0 ? (double)c / n : 0.0;
      }
      __syncthreads();
    }
    for (i64 q = threadIdx.x; q < (i64)n * e; q += blockDim.x) {
      int i = (int)(q % e);
      dscores[(i64)t0 * e + q] = (float)((double)coef * e * mk_ce[i] / ((double)n * g));
    }
    __syncthreads();
  }
}

// ---- prelude: DeepSeek-V3's sequence-wise balance loss, as runtime/kernels/gate_loss.c ----
__device__ void mk_seq_counts(const int *idx, int t0, int t1, int e, int k, double *f) {
  for (int i = 0; i < e; i++) f[i] = 0.0;
  for (i64 c = (i64)t0 * k; c < (i64)t1 * k; c++) f[idx[c]] += 1.0;
  double n = (double)(t1 - t0) * k;
  for (int i = 0; i < e && n > 0; i++) f[i] = f[i] * e / n;
}
__device__ double mk_seq_row_sum(const float *row, int e) {
  double z = 0.0;
  for (int j = 0; j < e; j++) z += row[j];
  return z;
}

// ---- mk_aux_seq ----
// One thread (block 0's first); dynamic shared memory 2e doubles (f and P).
extern "C" __global__ void mk_aux_seq(const float *scores, const int *idx, float *out, int s, int e, int k, int g,
                                      float share) {
  MK_DYN_SHARED(double, mk_fp);
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  if (g < 1) g = 1;
  double *f = mk_fp, *p = mk_fp + e, total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    mk_seq_counts(idx, t0, t1, e, k, f);
    for (int i = 0; i < e; i++) p[i] = 0.0;
    for (int t = t0; t < t1; t++) {
      const float *row = scores + (i64)t * e;
      double z = mk_seq_row_sum(row, e);
      for (int i = 0; i < e && z > 0; i++) p[i] += row[i] / z;
    }
    double part = 0.0;
    for (int i = 0; i < e && t1 > t0; i++) part += f[i] * (p[i] / (t1 - t0));
    total += part;
  }
  out[0] = (float)(total / g) / share;
}

// ---- mk_aux_seq_grad ----
// One block per group; dynamic shared memory e doubles (f, by the block's first thread); then each
// thread whole tokens, as rt_aux_seq_grad.
extern "C" __global__ void mk_aux_seq_grad(const float *scores, const int *idx, float *dscores, int s, int e, int k,
                                           int g, float coef) {
  MK_DYN_SHARED(double, mk_f);
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(gi, g) {
    int t0 = mk_group_begin(s, g, (int)gi), t1 = mk_group_begin(s, g, (int)gi + 1);
    if (threadIdx.x == 0) mk_seq_counts(idx, t0, t1, e, k, mk_f);
    __syncthreads();
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      const float *row = scores + (i64)t * e;
      float *dr = dscores + (i64)t * e;
      double z = mk_seq_row_sum(row, e), dot = 0.0;
      for (int i = 0; i < e; i++) dot += mk_f[i] * row[i];
      for (int j = 0; j < e; j++)
        dr[j] = z > 0 ? (float)((double)coef / ((double)(t1 - t0) * g) * (mk_f[j] - dot / z) / z) : 0.0f;
    }
    __syncthreads();
  }
}

// ---- mk_aux_pooled ----
// One block of MK_BLOCK threads: this rank's per-expert sums of the scores and of the top-k
// choices, stats [2, e] (rt_aux_pooled; the CUDA target refuses `aux pooled` for now).
extern "C" __global__ void mk_aux_pooled(const float *scores, const int *idx, float *stats, int s, int e, int k) {
  for (int i = threadIdx.x; i < e; i += blockDim.x) {
    double sum = 0.0, count = 0.0;
    for (int t = 0; t < s; t++) {
      sum += scores[(i64)t * e + i];
      for (int j = 0; j < k; j++) count += idx[(i64)t * k + j] == i;
    }
    stats[i] = (float)sum;
    stats[e + i] = (float)count;
  }
}

// ---- mk_aux_pooled_grad ----
// dscores[t, i] = coef * E * pooled[1, i] (F_i / N) for every token t.
extern "C" __global__ void mk_aux_pooled_grad(const float *pooled, float *dscores, int s, int e, float coef) {
  MK_FOR(q, (i64)s * e) {
    int i = (int)(q % e);
    dscores[q] = (float)((double)coef * e * pooled[e + i]);
  }
}

// ---- mk_z_loss ----
// One block of MK_BLOCK threads: mean over groups of the group's mean of logsumexp^2, / share.
extern "C" __global__ void mk_z_loss(const float *logits, float *out, int s, int e, int g, float share) {
  if (g < 1) g = 1;
  double total = 0.0;
  for (int gi = 0; gi < g; gi++) {
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double acc = 0.0;
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      double lse = mk_row_logsumexp(logits + (i64)t * e, e);
      acc += lse * lse;
    }
    acc = mk_block_sum(acc);
    if (t1 > t0) total += acc / (t1 - t0);
  }
  if (threadIdx.x == 0) out[0] = (float)(total / g) / share;
}

// ---- mk_z_loss_grad ----
extern "C" __global__ void mk_z_loss_grad(const float *logits, float *dlogits, int s, int e, int g, float coef) {
  if (g < 1) g = 1;
  MK_FOR(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double scale = 2.0 * coef / ((double)(t1 - t0) * g);
    const float *row = logits + t * e;
    float *dr = dlogits + t * e;
    double lse = mk_row_logsumexp(row, e);
    for (int j = 0; j < e; j++) dr[j] = (float)(scale * lse * exp((double)row[j] - lse));
  }
}
