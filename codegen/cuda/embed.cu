// Token embedding, learned positions and RoPE, the siblings of runtime/kernels/embed.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- mk_embed ----
extern "C" __global__ void mk_embed(const int *tokens, const float *table, float *y, int t, int m, int v, i64 v0) {
  MK_FOR(i, (i64)t * m) {
    i64 tok = tokens[i / m] - v0;
    y[i] = tok < 0 || tok >= v ? 0.0f : table[(i64)tok * m + i % m];
  }
}

// ---- mk_embed_grad ----
// Thread (b, j), p = b * m + j, owns the rows r with r % B == b of column j (B buckets of rows,
// the largest power of two up to min(v, 64)): it zeroes them, then adds the tokens' rows of dy
// that fall in them in token order, as rt_embed_grad (each element's sum in token order, no
// atomics). Launched with 64 m threads: one thread per column (2048 threads for a 2048-wide
// table) scanned a 32000-row vocabulary alone, 2.4 ms of a language model's step on an H200.
extern "C" __global__ void mk_embed_grad(const float *dy, const int *tokens, float *dtable, int t, int m, int v, i64 v0) {
  int B = 1;
  while (B * 2 <= v && B * 2 <= 64) B *= 2;
  MK_FOR(p, (i64)B * m) {
    int b = (int)(p / m), j = (int)(p % m);
    for (int r = b; r < v; r += B) dtable[(i64)r * m + j] = 0.0f;
    for (int i = 0; i < t; i++) {
      i64 tok = tokens[i] - v0;
      if (tok >= 0 && tok < v && (tok & (B - 1)) == b) dtable[tok * m + j] += dy[(i64)i * m + j];
    }
  }
}

// ---- mk_pos_add ----
// One thread per element, as rt_pos_add (runtime/kernels/embed.c).
extern "C" __global__ void mk_pos_add(const float *x, const float *table, float *y, int rows, int cols, int seq) {
  MK_FOR(p, (i64)rows * cols) {
    i64 r = p / cols;
    y[p] = x[p] + table[(r % seq) * cols + p % cols];
  }
}

// ---- mk_pos_add_grad ----
// One thread per element of dtable, summing its rows in row order as rt_pos_add_grad.
extern "C" __global__ void mk_pos_add_grad(const float *dy, float *dtable, int rows, int cols, int seq) {
  MK_FOR(p, (i64)seq * cols) {
    i64 i = p / cols, j = p % cols;
    float s = 0.0f;
    for (i64 r = i; r < rows; r += seq) s += dy[r * cols + j];
    dtable[p] = s;
  }
}

// ---- prelude: the turn of a rope pair, as rt_rope_freq ----
__device__ double mk_yarn_dim(double turns, int R, double theta, int original) {
  return R * log(original / (turns * 2 * 3.14159265358979323846)) / (2 * log(theta));
}
__device__ double mk_rope_freq(int c, int R, double theta, double factor, int original, int truncate, double beta_fast,
                               double beta_slow) {
  double extrapolated = pow(theta, -2.0 * c / R);
  if (!(factor > 0)) return extrapolated;
  double low = mk_yarn_dim(beta_fast, R, theta, original), high = mk_yarn_dim(beta_slow, R, theta, original);
  if (truncate) low = floor(low), high = ceil(high);
  low = fmax(low, 0.0), high = fmin(high, (double)(R - 1));
  if (low == high) high += 0.001;
  double ramp = fmin(fmax((c - low) / (high - low), 0.0), 1.0);
  return extrapolated / factor * ramp + extrapolated * (1 - ramp);
}

// ---- mk_rope ----
// One thread per rotated pair and per passed column, as rt_rope (runtime/kernels/embed.c).
extern "C" __global__ void mk_rope(const float *x, float *y, int rows, int cols, int heads, int seq, float theta, int sign,
                                   int rotary, int interleave, float factor, int original, int truncate, float beta_fast,
                                   float beta_slow, float scale) {
  int d = cols / heads, rd = rotary > 0 ? rotary : d, half = rd / 2, pass = d - rd;
  i64 pairs = (i64)rows * heads * half;
  MK_FOR(p, pairs + (i64)rows * heads * pass) {
    if (p >= pairs) {   // a column past the rotary ones
      i64 q = p - pairs;
      i64 at = q / pass * d + rd + q % pass;   // (row, head) q / pass, column rd + q % pass
      y[at] = x[at];
      continue;
    }
    int c = (int)(p % half), h = (int)(p / half % heads);
    i64 r = p / half / heads;
    int pos = (int)(r % seq);
    double angle = pos * mk_rope_freq(c, rd, theta, factor, original, truncate, beta_fast, beta_slow);
    float cs = (float)(cos(angle) * scale), sn = (float)(sign * sin(angle) * scale);
    i64 a = r * cols + (i64)h * d + (interleave ? 2 * c : c), b = a + (interleave ? 1 : half);
    float u = x[a], w = x[b];
    y[a] = u * cs - w * sn;
    y[b] = w * cs + u * sn;
  }
}
