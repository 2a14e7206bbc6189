// The language model's input kernels: token embedding, learned positions and rotary position
// embedding (lang/manual.md §7.2). The siblings of codegen/cuda/embed.cu, which accumulate gradients in
// the same order (so the targets agree to the bit). Conventions of every CPU kernel:
// runtime/kernels.def.
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

// y[i] = table[tokens[i] - v0] for t tokens, rows of m; a token outside [v0, v0 + v) gives a zero
// row: a vocabulary-parallel rank's table holds the rows of tokens [v0, v0 + v), and the ranks'
// rows are summed (the driver refuses tokens outside the vocabulary before they get here).
void rt_embed(const int32_t *tokens, const float *table, float *y, int t, int m, int v, int64_t v0) {
  for (int i = 0; i < t; i++) {
    int64_t tok = tokens[i] - v0;
    if (tok < 0 || tok >= v) memset(y + (size_t)i * m, 0, (size_t)m * sizeof *y);
    else memcpy(y + (size_t)i * m, table + (size_t)tok * m, (size_t)m * sizeof *y);
  }
}

// dtable = sum over tokens i of dy[i] into row tokens[i] - v0, in token order (deterministic).
void rt_embed_grad(const float *dy, const int32_t *tokens, float *dtable, int t, int m, int v, int64_t v0) {
  memset(dtable, 0, (size_t)v * m * sizeof *dtable);
  for (int i = 0; i < t; i++) {
    int64_t tok = tokens[i] - v0;
    if (tok < 0 || tok >= v) continue;
    for (int j = 0; j < m; j++) dtable[(size_t)tok * m + j] += dy[(size_t)i * m + j];
  }
}

// y[r] = x[r] + table[r % seq] (learned positions: row r of the activations is position r % seq).
void rt_pos_add(const float *x, const float *table, float *y, int rows, int cols, int seq) {
  for (int r = 0; r < rows; r++) {
    const float *t = table + (size_t)(r % seq) * cols;
    for (int j = 0; j < cols; j++) y[(size_t)r * cols + j] = x[(size_t)r * cols + j] + t[j];
  }
}

// dtable[i] = sum over samples b, in order, of dy[b*seq + i] (deterministic).
void rt_pos_add_grad(const float *dy, float *dtable, int rows, int cols, int seq) {
  for (int i = 0; i < seq; i++)
    for (int j = 0; j < cols; j++) {
      float s = 0.0f;
      for (int r = i; r < rows; r += seq) s += dy[(size_t)r * cols + j];
      dtable[(size_t)i * cols + j] = s;
    }
}

// The turn per position of pair c of R rotary columns: theta^(-2c/R); with YaRN (factor > 0,
// transformers' rope_type "yarn") the blend of that and its 1/factor by a linear ramp over the
// pairs between the dimensions where `original` positions make beta_fast and beta_slow turns,
// rounded out to whole pairs when truncate is 1 (transformers' default; gpt-oss's is 0).
static double yarn_dim(double turns, int R, double theta, int original) {
  return R * log(original / (turns * 2 * M_PI)) / (2 * log(theta));
}

double rt_rope_freq(int c, int R, double theta, double factor, int original, int truncate, double beta_fast,
                    double beta_slow) {
  double extrapolated = pow(theta, -2.0 * c / R);
  if (!(factor > 0))
    return extrapolated;
  double low = yarn_dim(beta_fast, R, theta, original), high = yarn_dim(beta_slow, R, theta, original);
  if (truncate)
    low = floor(low), high = ceil(high);
  low = fmax(low, 0), high = fmin(high, R - 1);
  if (low == high)
    high += 0.001;
  double ramp = fmin(fmax((c - low) / (high - low), 0), 1);
  return extrapolated / factor * ramp + extrapolated * (1 - ramp);
}

// RoPE ("rotate half") on rows of [heads * d]: row s is position s % seq; the first R = rotary
// columns of every head turn (R = d when rotary is 0), the pair (c, c + R/2) for c < R/2 by angle =
// pos * theta^(-2c/R), sign +1; sign -1 turns back (the gradient: the rotation's transpose). The
// columns R..d of a head pass unchanged (a partial rotary factor, GLM's). With interleave the pair
// of frequency c is the adjacent (2c, 2c + 1) (DeepSeek's layout). With factor > 0, YaRN's
// frequencies (rt_rope_freq) and cos and sin times scale.
void rt_rope(const float *x, float *y, int rows, int cols, int heads, int seq, float theta, int sign, int rotary,
             int interleave, float factor, int original, int truncate, float beta_fast, float beta_slow, float scale) {
  int d = cols / heads, rd = rotary > 0 ? rotary : d, half = rd / 2;
  double *freq = rt_alloc((size_t)(half > 0 ? half : 1) * sizeof *freq, "rt_rope");
  for (int c = 0; c < half; c++) freq[c] = rt_rope_freq(c, rd, theta, factor, original, truncate, beta_fast, beta_slow);
  for (int r = 0; r < rows; r++) {
    int pos = r % seq;
    for (int c = 0; c < half; c++) {   // the same turn for every head
      double angle = pos * freq[c];
      float cs = (float)(cos(angle) * scale), sn = (float)(sign * sin(angle) * scale);
      for (int h = 0; h < heads; h++) {
        size_t a = (size_t)r * cols + (size_t)h * d + (interleave ? 2 * c : c), b = a + (interleave ? 1 : half);
        float u = x[a], w = x[b];
        y[a] = u * cs - w * sn;
        y[b] = w * cs + u * sn;
      }
    }
    for (int h = 0; h < heads && rd < d; h++)
      for (int c = rd; c < d; c++)
        y[(size_t)r * cols + (size_t)h * d + c] = x[(size_t)r * cols + (size_t)h * d + c];
  }
  free(freq);
}
