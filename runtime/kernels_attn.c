// Causal grouped-query attention (DESIGN §2.1) and the column slice its backward needs.
//
// Rows r = b*seq + i of q [rows, heads*d], k and v [rows, kv*d]; query head h reads key/value
// head h / (heads/kv); query i of sample b sees keys j <= i of the same sample. Each output row
// is computed by itself, in a fixed order, without the seq x seq matrix:
//   s_j = (q_i . k_j) * scale (the dot in column order), scale = 1/sqrt(d)
//   m = max_j s_j;  l = sum_j exp(s_j - m);  o_i = (sum_j exp(s_j - m) v_j) / l   (j ascending)
// The backward keeps per (row, head) lse = m + log(l) and D = dO_i . O_i (rt_attn_stats,
// [rows, 2*heads]: lse at column h, D at column heads + h), then
//   p_ij = exp(s_ij - lse_i),  dS_ij = p_ij (dO_i . v_j - D_i)
//   dq_i = scale * sum_j dS_ij k_j                  (j ascending)
//   dk_j = scale * sum_h sum_i dS_ij q_i            (heads of the group ascending, then i)
//   dv_j = sum_h sum_i p_ij dO_i
// into one packed row [dq | dk | dv] of width (heads + 2 kv) * d. The CUDA kernels of the same
// names (codegen/cuda/kernels.cu) do the same float operations per output element in the same
// order, so the two targets agree to the bit.
#include <math.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

// Rows are independent: a parallel loop over them, each row computed as on one thread, when the
// causal work (rows * seq / 2 dot products of qcols) pays for the threads.
#define ATTN_PARALLEL RT_PARALLEL_FOR((int64_t)rows * seq * qcols >= 32 * RT_PAR_MIN)

static float dot(const float *a, const float *b, int d) {
  float s = 0.0f;
  for (int c = 0; c < d; c++) s += a[c] * b[c];
  return s;
}

void rt_attn_fwd(const float *q, const float *k, const float *v, float *o, int rows, int seq, int heads, int kv,
                 int qcols) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d;
  float scale = 1.0f / sqrtf((float)d);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group;
      const float *qi = q + (size_t)r * qcols + (size_t)h * d;
      float m = -INFINITY, l = 0.0f;
      for (int t = 0; t <= i; t++) {
        float s = dot(qi, k + (size_t)(r0 + t) * kcols + (size_t)j * d, d) * scale;
        m = s > m ? s : m;
      }
      float *oi = o + (size_t)r * qcols + (size_t)h * d;
      memset(oi, 0, (size_t)d * sizeof *oi);
      for (int t = 0; t <= i; t++) {
        float p = expf(dot(qi, k + (size_t)(r0 + t) * kcols + (size_t)j * d, d) * scale - m);
        l += p;
        const float *vt = v + (size_t)(r0 + t) * kcols + (size_t)j * d;
        for (int c = 0; c < d; c++) oi[c] += p * vt[c];
      }
      for (int c = 0; c < d; c++) oi[c] /= l;
    }
}

void rt_attn_stats(const float *dy, const float *q, const float *k, const float *o, float *stats, int rows, int seq,
                   int heads, int kv, int qcols) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d;
  float scale = 1.0f / sqrtf((float)d);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group;
      const float *qi = q + (size_t)r * qcols + (size_t)h * d;
      float m = -INFINITY, l = 0.0f;
      for (int t = 0; t <= i; t++) {
        float s = dot(qi, k + (size_t)(r0 + t) * kcols + (size_t)j * d, d) * scale;
        m = s > m ? s : m;
      }
      for (int t = 0; t <= i; t++) l += expf(dot(qi, k + (size_t)(r0 + t) * kcols + (size_t)j * d, d) * scale - m);
      size_t at = (size_t)r * qcols + (size_t)h * d;
      stats[(size_t)r * 2 * heads + h] = m + logf(l);
      stats[(size_t)r * 2 * heads + heads + h] = dot(dy + at, o + at, d);
    }
}

void rt_attn_grad_q(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                    int rows, int seq, int heads, int kv, int qcols) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = 1.0f / sqrtf((float)d);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++)
    for (int h = 0; h < heads; h++) {
      int i = r % seq, r0 = r - i, j = h / group;
      size_t at = (size_t)r * qcols + (size_t)h * d;
      float lse = stats[(size_t)r * 2 * heads + h], D = stats[(size_t)r * 2 * heads + heads + h];
      float *dq = dqkv + (size_t)r * width + (size_t)h * d;
      memset(dq, 0, (size_t)d * sizeof *dq);
      for (int t = 0; t <= i; t++) {
        const float *kt = k + (size_t)(r0 + t) * kcols + (size_t)j * d;
        float p = expf(dot(q + at, kt, d) * scale - lse);
        float ds = p * (dot(dy + at, v + (size_t)(r0 + t) * kcols + (size_t)j * d, d) - D);
        for (int c = 0; c < d; c++) dq[c] += ds * kt[c];
      }
      for (int c = 0; c < d; c++) dq[c] *= scale;
    }
}

void rt_attn_grad_kv(const float *dy, const float *q, const float *k, const float *v, const float *stats, float *dqkv,
                     int rows, int seq, int heads, int kv, int qcols) {
  int d = qcols / heads, group = heads / kv, kcols = kv * d, width = qcols + 2 * kcols;
  float scale = 1.0f / sqrtf((float)d);
  ATTN_PARALLEL
  for (int r = 0; r < rows; r++)
    for (int j = 0; j < kv; j++) {
      int t = r % seq, r0 = r - t;   // key t of sample r0 / seq
      const float *kt = k + (size_t)r * kcols + (size_t)j * d, *vt = v + (size_t)r * kcols + (size_t)j * d;
      float *dk = dqkv + (size_t)r * width + qcols + (size_t)j * d, *dv = dk + kcols;
      memset(dk, 0, (size_t)d * sizeof *dk);
      memset(dv, 0, (size_t)d * sizeof *dv);
      for (int h = j * group; h < (j + 1) * group; h++)
        for (int i = t; i < seq; i++) {
          size_t at = (size_t)(r0 + i) * qcols + (size_t)h * d;
          const float *st = stats + (size_t)(r0 + i) * 2 * heads;
          float p = expf(dot(q + at, kt, d) * scale - st[h]);
          float ds = p * (dot(dy + at, vt, d) - st[heads + h]);
          for (int c = 0; c < d; c++) {
            dk[c] += ds * q[at + c];
            dv[c] += p * dy[at + c];
          }
        }
      for (int c = 0; c < d; c++) dk[c] *= scale;
    }
}

void rt_cols_slice(const float *x, float *y, int rows, int cols, int offset, int width) {
  for (int r = 0; r < rows; r++)
    memcpy(y + (size_t)r * width, x + (size_t)r * cols + offset, (size_t)width * sizeof *y);
}
