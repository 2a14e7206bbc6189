// The gate chain: noise, the score functions (softmax, sigmoid, softmax over tokens), top-k,
// gather, the fused gates, locations, expert choice; the siblings of runtime/kernels/gate.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: per-row gate functions (the separate kernels and the fused gate kernels share them) ----
__device__ void mk_row_softmax(const float *x, float *y, int e) {
  float mx = -MK_INF;
  for (int j = 0; j < e; j++)
    if (x[j] > mx) mx = x[j];
  double sum = 0.0;
  for (int j = 0; j < e; j++) {
    y[j] = expf(x[j] - mx);
    sum += y[j];
  }
  float inv = (float)(1.0 / sum);
  for (int j = 0; j < e; j++) y[j] *= inv;
}
// Order: score descending, index ascending; NaN ranks as -inf; with bias, row[i] + bias[i];
// with groups > 1 only the experts of the best `best` groups take part, the others count as -inf
// (runtime rt_topk).
__device__ float mk_choice_score(const float *row, const float *bias, int i) {
  float v = bias ? row[i] + bias[i] : row[i];
  return v != v ? -MK_INF : v;
}
__device__ void mk_row_topk_limited(const float *row, const float *bias, int *out, int e, int k, int groups, int best,
                                    int score_kind) {
  u64 keep = ~(u64)0;
  if (groups > 1 && best < groups) {
    int per = e / groups;
    float gscore[64];
    for (int g = 0; g < groups; g++) {
      float a = -MK_INF, b = -MK_INF;
      for (int i = g * per; i < (g + 1) * per; i++) {
        float v = mk_choice_score(row, bias, i);
        if (v > a) {
          b = a;
          a = v;
        } else if (v > b) {
          b = v;
        }
      }
      gscore[g] = score_kind == 0 ? a + b : a;
    }
    keep = 0;
    for (int j = 0; j < best; j++) {
      int pick = -1;
      for (int g = 0; g < groups; g++)
        if (!(keep >> g & 1) && (pick < 0 || gscore[g] > gscore[pick])) pick = g;
      keep |= (u64)1 << pick;
    }
  }
  int per = e / (groups > 0 ? groups : 1);
  float prev_v = MK_INF;
  int prev_i = -1;
  for (int j = 0; j < k; j++) {
    int pick = -1;
    float best_v = -MK_INF;
    for (int i = 0; i < e; i++) {
      float v = keep >> (i / per) & 1 ? mk_choice_score(row, bias, i) : -MK_INF;
      bool after_prev = v < prev_v || (v == prev_v && i > prev_i);
      if (after_prev && (pick < 0 || v > best_v)) {
        pick = i;
        best_v = v;
      }
    }
    out[j] = pick;
    prev_v = best_v;
    prev_i = pick;
  }
}
__device__ void mk_row_topk(const float *row, int *out, int e, int k) { mk_row_topk_limited(row, 0, out, e, k, 1, 1, 0); }
__device__ void mk_row_gather(const float *row, const int *ir, float *gr, int k, int renorm, float scale) {
  double sum = 0.0;
  for (int j = 0; j < k; j++) {
    gr[j] = row[ir[j]];
    sum += gr[j];
  }
  if (renorm && sum > 0.0)
    for (int j = 0; j < k; j++) gr[j] = (float)(gr[j] / sum);
  for (int j = 0; j < k; j++) gr[j] *= scale;
}

// ---- mk_gate_noise ----
// logits + sigma*N(0,1)/e; the normal of token t, expert j is
// mk_normal(key(key(key(seed, 4 = RT_STREAM_NOISE), step), layer), (token0 + t) * e + j).
extern "C" __global__ void mk_gate_noise(const float *logits, float *out, int s, int e, float sigma, int layer,
                                         u64 seed, i64 step, i64 token0) {
  u64 key = mk_key(mk_key(mk_key(seed, 4ULL), (u64)step), (u64)(i64)layer);
  double scale = (double)sigma / e;
  MK_FOR(i, (i64)s * e) {
    if (sigma == 0.0f) {
      out[i] = logits[i];
      continue;
    }
    i64 t = i / e, j = i % e;
    u64 base = (u64)(token0 + t) * (u64)e;
    out[i] = logits[i] + (float)(scale * mk_normal(key, base + (u64)j));
  }
}

// ---- prelude: the softmax gradient of one row ----
// dx = y * (dy - sum(dy * y)), the sum in double (rt_softmax_grad), over loaders dy(j), y(j) and a
// storer dx(j, v): one thread a row, for mk_softmax_grad and the fused kernels (codegen/fused.c).
template <class D, class Y, class X> __device__ void mk_softmax_grad_row(D dy, Y y, X dx, int e) {
  double dot = 0.0;
  for (int j = 0; j < e; j++) dot += (double)dy(j) * y(j);
  float d = (float)dot;
  for (int j = 0; j < e; j++) dx(j, y(j) * (dy(j) - d));
}

// ---- mk_softmax ----
extern "C" __global__ void mk_softmax(const float *x, float *y, int s, int e) {
  MK_FOR(t, s) mk_row_softmax(x + t * e, y + t * e, e);
}

// ---- mk_softmax_grad ----
extern "C" __global__ void mk_softmax_grad(const float *dy, const float *y, float *dx, int s, int e) {
  MK_FOR(t, s) {
    const float *dr = dy + t * e, *yr = y + t * e;
    float *xr = dx + t * e;
    mk_softmax_grad_row([&](int j) { return dr[j]; }, [&](int j) { return yr[j]; }, [&](int j, float v) { xr[j] = v; }, e);
  }
}

// ---- mk_sigmoid ----
extern "C" __global__ void mk_sigmoid(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = mk_f_sigmoid(x[i]);
}

// ---- mk_sigmoid_grad ----
extern "C" __global__ void mk_sigmoid_grad(const float *dy, const float *y, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = mk_f_sigmoid_grad(dy[i], y[i]);
}

// ---- mk_softmax_tokens ----
// One thread per (group, column): the column of a group in token order.
extern "C" __global__ void mk_softmax_tokens(const float *x, float *y, int s, int e, int g) {
  if (g < 1) g = 1;
  MK_FOR(i, (i64)g * e) {
    int gi = (int)(i / e), j = (int)(i % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    float mx = -MK_INF;
    for (int t = t0; t < t1; t++)
      if (x[(i64)t * e + j] > mx) mx = x[(i64)t * e + j];
    double sum = 0.0;
    for (int t = t0; t < t1; t++) {
      i64 k = (i64)t * e + j;
      y[k] = expf(x[k] - mx);
      sum += y[k];
    }
    float inv = (float)(1.0 / sum);
    for (int t = t0; t < t1; t++) y[(i64)t * e + j] *= inv;
  }
}

// ---- mk_softmax_tokens_grad ----
extern "C" __global__ void mk_softmax_tokens_grad(const float *dy, const float *y, float *dx, int s, int e, int g) {
  if (g < 1) g = 1;
  MK_FOR(i, (i64)g * e) {
    int gi = (int)(i / e), j = (int)(i % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1);
    double dot = 0.0;
    for (int t = t0; t < t1; t++) dot += (double)dy[(i64)t * e + j] * y[(i64)t * e + j];
    for (int t = t0; t < t1; t++) {
      i64 k = (i64)t * e + j;
      dx[k] = y[k] * (dy[k] - (float)dot);
    }
  }
}

// ---- mk_topk ----
extern "C" __global__ void mk_topk(const float *scores, int *idx, int s, int e, int k, int groups, int best,
                                   int score_kind) {
  MK_FOR(t, s) mk_row_topk_limited(scores + t * e, 0, idx + t * k, e, k, groups, best, score_kind);
}

// ---- mk_topk_bias ----
extern "C" __global__ void mk_topk_bias(const float *scores, const float *bias, int *idx, int s, int e, int k,
                                        int groups, int best, int score_kind) {
  MK_FOR(t, s) mk_row_topk_limited(scores + t * e, bias, idx + t * k, e, k, groups, best, score_kind);
}

// ---- mk_balance_load ----
// One thread (a grid of one), one pass over the choices: the counts in load (whole numbers, exact
// in float below 2^24), then e * count_i - s * k, as rt_balance_load.
extern "C" __global__ void mk_balance_load(const int *idx, float *load, int s, int k, int e) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  for (int i = 0; i < e; i++) load[i] = 0.0f;
  for (i64 c = 0; c < (i64)s * k; c++)
    if (idx[c] >= 0 && idx[c] < e) load[idx[c]] += 1.0f;
  for (int i = 0; i < e; i++) load[i] = (float)((i64)e * (i64)load[i] - (i64)s * k);
}

// ---- mk_gate_gather ----
extern "C" __global__ void mk_gate_gather(const float *scores, const int *idx, float *gates, int s, int e, int k,
                                          int renorm, float scale) {
  MK_FOR(t, s) mk_row_gather(scores + t * e, idx + t * k, gates + t * k, k, renorm, scale);
}

// ---- mk_gate_gather_grad ----
extern "C" __global__ void mk_gate_gather_grad(const float *dgates, const float *scores, const int *idx, float *dscores,
                                               int s, int e, int k, int renorm, float scale) {
  MK_FOR(t, s) {
    const float *row = scores + t * e, *dg = dgates + t * k;
    const int *ir = idx + t * k;
    float *dr = dscores + t * e;
    for (int j = 0; j < e; j++) dr[j] = 0.0f;
    if (!renorm) {
      for (int j = 0; j < k; j++) dr[ir[j]] += dg[j] * scale;
      continue;
    }
    double sum = 0.0;
    for (int j = 0; j < k; j++) sum += row[ir[j]];
    if (!(sum > 0.0)) continue;
    double dot = 0.0;
    for (int j = 0; j < k; j++) dot += (double)(dg[j] * scale) * (row[ir[j]] / sum);
    for (int j = 0; j < k; j++) dr[ir[j]] += (float)((dg[j] * scale - dot) / sum);
  }
}

// ---- mk_gate_softmax_topk_gather ----
// The fused gate of `gate gshard` (and xmoe): softmax -> top-k -> gather, one thread per token;
// the same results as mk_softmax, mk_topk and mk_gate_gather in sequence.
extern "C" __global__ void mk_gate_softmax_topk_gather(const float *logits, float *scores, int *idx, float *gates,
                                                       int s, int e, int k, int renorm) {
  MK_FOR(t, s) {
    float *row = scores + t * e;
    mk_row_softmax(logits + t * e, row, e);
    mk_row_topk(row, idx + t * k, e, k);
    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm, 1.0f);
  }
}

// ---- mk_gate_sigmoid_topk_gather ----
// The fused gate of `gate sigmoid`: sigmoid -> top-k -> gather, one thread per token.
extern "C" __global__ void mk_gate_sigmoid_topk_gather(const float *logits, float *scores, int *idx, float *gates,
                                                       int s, int e, int k, int renorm) {
  MK_FOR(t, s) {
    float *row = scores + t * e;
    for (int j = 0; j < e; j++) row[j] = mk_sigmoid1(logits[t * e + j]);
    mk_row_topk(row, idx + t * k, e, k);
    mk_row_gather(row, idx + t * k, gates + t * k, k, renorm, 1.0f);
  }
}

// ---- mk_gate_locations ----
// One block per (routing group, expert): an expert's locations only depend on its own choices,
// numbered in [j, t] order (rt_gate_locations). The block's threads split the group's choice
// positions p = j*n + (t - t0) into contiguous runs; each counts the expert's choices in its run,
// an exclusive scan over the runs gives each run its first number, and a second pass numbers the
// choices: location = number when below cap (cap <= 0: dropless), else -1. Any grid and any block
// of at most MK_BLOCK threads give the same result. stats (may be NULL) gets int[g, e, 2]: kept
// and wanted choices per group and expert, for the host's drop count, loads and capacity_max.
extern "C" __global__ void mk_gate_locations(const int *idx, int *loc, int *stats, int s, int k, int e, int g,
                                             int cap) {
  __shared__ int first[MK_BLOCK];
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(b, (i64)g * e) {
    int gi = (int)(b / e), ex = (int)(b % e);
    int t0 = mk_group_begin(s, g, gi), n = mk_group_begin(s, g, gi + 1) - t0;
    i64 total = (i64)n * k, per = (total + blockDim.x - 1) / blockDim.x;
    i64 p0 = (i64)threadIdx.x * per, p1 = p0 + per < total ? p0 + per : total;
    int mine = 0;
    for (i64 p = p0; p < p1; p++) mine += idx[(i64)(t0 + p % n) * k + p / n] == ex;
    first[threadIdx.x] = mine;
    __syncthreads();
    if (threadIdx.x == 0) {
      int wanted = 0;
      for (int i = 0; i < (int)blockDim.x; i++) {
        int c = first[i];
        first[i] = wanted;
        wanted += c;
      }
      if (stats) {
        stats[((i64)gi * e + ex) * 2] = cap <= 0 || wanted < cap ? wanted : cap;
        stats[((i64)gi * e + ex) * 2 + 1] = wanted;
      }
    }
    __syncthreads();
    int number = first[threadIdx.x];
    for (i64 p = p0; p < p1; p++) {
      i64 c = (i64)(t0 + p % n) * k + p / n;
      if (idx[c] != ex) continue;
      loc[c] = cap <= 0 || number < cap ? number : -1;
      number++;
    }
    __syncthreads();  // first[] serves the block's next (group, expert)
  }
}

// ---- mk_expert_choice ----
// One block per (group, expert), one thread per token of the group: a token's rank is the
// number of tokens before it in (score descending, token ascending) order; the first cap keep
// their rank as location, the others get -1 (rt_expert_choice).
extern "C" __global__ void mk_expert_choice(const float *scores, int *loc, int s, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(b, (i64)g * e) {
    int gi = (int)(b / e), j = (int)(b % e);
    int t0 = mk_group_begin(s, g, gi), t1 = mk_group_begin(s, g, gi + 1), n = t1 - t0;
    int take = cap < n ? cap : n;
    for (int t = t0 + threadIdx.x; t < t1; t += blockDim.x) {
      float v = scores[(i64)t * e + j];
      if (v != v) v = -MK_INF;
      int rank = 0;
      for (int u = t0; u < t1; u++) {
        float w = scores[(i64)u * e + j];
        if (w != w) w = -MK_INF;
        rank += w > v || (w == v && u < t);
      }
      loc[(i64)t * e + j] = take > 0 && rank < take ? rank : -1;
    }
  }
}

// ---- mk_iota ----
extern "C" __global__ void mk_iota(int *idx, int s, int e) {
  MK_FOR(i, (i64)s * e) idx[i] = (int)(i % e);
}
