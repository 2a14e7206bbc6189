// Unit tests of the module library's CPU kernels (runtime/kernels/: gate.c, order.c, hook.c and
// others) and of the load statistics of rt_gate_locations.
//
// Backward kernels are checked as in test_kernels.c: central finite differences of a scalar
// L = sum(w * f(inputs)) with a fixed random projection w, evaluated in double from the float
// forward kernel, routing held fixed. A check passes when
//     max_i |numeric_i - analytic_i| <= FD_TOL * max_i |analytic_i| + FD_ATOL.
// The rest is exact or compared with an independent formulation: expert choice on a hand-worked
// case, the dense order (dispatch mask, combine weights, GEMMs) against the sparse one
// (rt_order_encode / rt_order_decode and their gradients), fp16 and bf16 bit patterns checked
// with Python's struct module, every half value round-tripped, random floats rounded to the
// nearest half, int8 round-trip error, and rt_record's JSON line parsed back.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "moert.h"
#include "rt_internal.h"

#define FD_EPS 1e-2    // step for smooth ops
#define FD_TOL 1e-3    // relative to the largest analytic gradient
#define FD_ATOL 1e-6   // absolute floor, for gradients that are exactly zero

// ---- helpers (as in test_kernels.c) ----

static uint64_t test_state = 67890;

// Uniform in [lo, hi), from a splitmix64 sequence of the tests' own (independent of rt_mix).
static uint64_t next_u64(void) {
  uint64_t z = (test_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static float frand(float lo, float hi) {
  return lo + (hi - lo) * (float)((next_u64() >> 40) * (1.0 / 16777216.0));
}

static void fill(float *x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++)
    x[i] = frand(lo, hi);
}

static double dot(const float *w, const float *y, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++)
    acc += (double)w[i] * y[i];
  return acc;
}

static float max_abs_diff(const float *a, const float *b, int64_t n) {
  float mx = 0.0f;
  for (int64_t i = 0; i < n; i++)
    mx = fmaxf(mx, fabsf(a[i] - b[i]));
  return mx;
}

typedef double (*Objective)(void *ctx);

// Central differences of f with respect to every element of x (perturbed in place, restored).
// The step actually taken is (float)(x+eps) - (float)(x-eps), not 2 eps.
static void check_fd(const char *what, Objective f, void *ctx, float *x, int64_t n,
                     const float *analytic, double eps) {
  double max_grad = 0.0, max_err = 0.0, worst_num = 0.0, worst_ana = 0.0;
  int64_t worst = -1;
  for (int64_t i = 0; i < n; i++) {
    float orig = x[i];
    float hi = (float)(orig + eps), lo = (float)(orig - eps);
    x[i] = hi;
    double fp = f(ctx);
    x[i] = lo;
    double fm = f(ctx);
    x[i] = orig;
    double num = (fp - fm) / ((double)hi - lo);
    double err = fabs(num - analytic[i]);
    if (fabs(analytic[i]) > max_grad)
      max_grad = fabs(analytic[i]);
    if (worst < 0 || err > max_err) {
      max_err = err;
      worst = i;
      worst_num = num;
      worst_ana = analytic[i];
    }
  }
  double bound = FD_TOL * max_grad + FD_ATOL;
  printf("# fd %-34s n=%-4lld max|grad| %.3e  max err %.3e  (bound %.3e)\n", what, (long long)n,
         max_grad, max_err, bound);
  if (max_err > bound) {
    printf("# FAILED %s: element %lld numeric %.9e analytic %.9e\n", what, (long long)worst,
           worst_num, worst_ana);
    fail_msg("%s: finite differences disagree (max err %.3e > %.3e)", what, max_err, bound);
  }
}

// ---- finite-difference checks ----

typedef struct {
  float *x, *y, *w;
  int64_t n;
  int kind;   // 0 sigmoid, 1 silu
} ActCtx;

static double act_obj(void *p) {
  ActCtx *c = p;
  if (c->kind == 0)
    rt_sigmoid(c->x, c->y, c->n);
  else
    rt_silu(c->x, c->y, c->n);
  return dot(c->w, c->y, c->n);
}

static void test_fd_sigmoid(void **state) {
  enum { N = 64 };
  float x[N], y[N], w[N], dx[N];
  fill(x, N, -4, 4);
  fill(w, N, -1, 1);
  ActCtx c = {x, y, w, N, 0};
  rt_sigmoid(x, y, N);
  rt_sigmoid_grad(w, y, dx, N);
  check_fd("act.sigmoid", act_obj, &c, x, N, dx, FD_EPS);
}

static void test_fd_silu(void **state) {
  enum { N = 64 };
  float x[N], y[N], w[N], dx[N];
  fill(x, N, -4, 4);
  fill(w, N, -1, 1);
  ActCtx c = {x, y, w, N, 1};
  rt_silu_grad(w, x, dx, N);
  check_fd("act.silu", act_obj, &c, x, N, dx, FD_EPS);
}

// gpt-oss's clamped SwiGLU y = (clamp(u, -7, 7) + 1) g' sigmoid(1.702 g'), g' = min(g, 7):
// its two gradient kernels against central differences in g and in u, over values on both sides
// of every clamp (none within 0.05 of one: the differences would straddle the kink).
typedef struct {
  float *g, *u, *y, *w;
  int64_t n;
} OssCtx;

static double oss_obj(void *p) {
  OssCtx *c = p;
  rt_oss(c->g, c->u, c->y, c->n);
  return dot(c->w, c->y, c->n);
}

static void fill_off_clamps(float *x, int64_t n) {
  fill(x, n, -10, 10);
  for (int64_t i = 0; i < n; i++)
    if (fabsf(fabsf(x[i]) - 7.0f) < 0.05f) x[i] += 0.1f;
}

static void test_fd_oss(void **state) {
  enum { N = 96 };
  float g[N], u[N], y[N], w[N], dg[N], du[N];
  fill_off_clamps(g, N);
  fill_off_clamps(u, N);
  fill(w, N, -1, 1);
  int above = 0, below = 0, over = 0;
  for (int i = 0; i < N; i++) above += g[i] > 7.0f, below += u[i] < -7.0f, over += u[i] > 7.0f;
  assert_true(above > 0 && below > 0 && over > 0);   // every clamp is reached
  OssCtx c = {g, u, y, w, N};
  rt_oss_grad_gate(w, g, u, dg, N);
  rt_oss_grad_up(w, g, u, du, N);
  check_fd("act.oss (gate)", oss_obj, &c, g, N, dg, FD_EPS);
  check_fd("act.oss (up)", oss_obj, &c, u, N, du, FD_EPS);
}

typedef struct {
  float *x, *y, *w;
  int s, e, g;
} TokensCtx;

static double softmax_tokens_obj(void *p) {
  TokensCtx *c = p;
  rt_softmax_tokens(c->x, c->y, c->s, c->e, c->g);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void fd_softmax_tokens(int g) {
  enum { S = 8, E = 3 };
  float x[S * E], y[S * E], w[S * E], dx[S * E];
  fill(x, S * E, -2, 2);
  fill(w, S * E, -1, 1);
  TokensCtx c = {x, y, w, S, E, g};
  rt_softmax_tokens(x, y, S, E, g);
  rt_softmax_tokens_grad(w, y, dx, S, E, g);
  char name[64];
  snprintf(name, sizeof name, "gate.softmax_tokens g=%d", g);
  check_fd(name, softmax_tokens_obj, &c, x, S * E, dx, FD_EPS);
}

static void test_fd_softmax_tokens(void **state) {
  fd_softmax_tokens(1);
  fd_softmax_tokens(2);
}

static double l2norm_obj(void *p) {
  TokensCtx *c = p;
  rt_l2norm(c->x, c->y, c->s, c->e);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void test_fd_l2norm_rows(void **state) {
  enum { R = 4, N = 5 };
  float x[R * N], y[R * N], w[R * N], dx[R * N];
  fill(x, R * N, -1, 1);
  fill(w, R * N, -1, 1);
  TokensCtx c = {x, y, w, R, N, 1};
  rt_l2norm_grad(w, x, dx, R, N);
  check_fd("gate.l2norm_rows", l2norm_obj, &c, x, R * N, dx, FD_EPS);
}

// norm.rms (runtime/kernels/norm.c): eps large enough to matter in the second row, whose
// values are small.
static double rmsnorm_obj(void *p) {
  TokensCtx *c = p;
  rt_rmsnorm(c->x, c->y, c->s, c->e, 1e-3f);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void test_fd_rmsnorm(void **state) {
  enum { R = 3, N = 7 };
  float x[R * N], y[R * N], w[R * N], dx[R * N];
  fill(x, R * N, -2, 2);
  for (int i = N; i < 2 * N; i++) x[i] *= 0.02f;
  fill(w, R * N, -1, 1);
  TokensCtx c = {x, y, w, R, N, 1};
  rt_rmsnorm_grad(w, x, dx, R, N, 1e-3f);
  check_fd("norm.rms", rmsnorm_obj, &c, x, R * N, dx, 1e-3);
  // each row of y has mean square 1 up to eps: x = (3, 4) gives 3 / sqrt(12.5 + eps)
  float x2[2] = {3, 4}, y2[2];
  rt_rmsnorm(x2, y2, 1, 2, 1e-3f);
  assert_float_equal(y2[0], 3.0 / sqrt(12.5 + 1e-3), 1e-6);
  assert_float_equal(y2[1], 4.0 / sqrt(12.5 + 1e-3), 1e-6);
}

// norm.layer, scale (runtime/kernels/norm.c).
static double layernorm_obj(void *p) {
  TokensCtx *c = p;
  rt_layernorm(c->x, c->y, c->s, c->e, 1e-3f);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void test_fd_layernorm(void **state) {
  enum { R = 3, N = 7 };
  float x[R * N], y[R * N], w[R * N], dx[R * N];
  fill(x, R * N, -2, 2);
  for (int i = N; i < 2 * N; i++) x[i] = 0.5f + 0.02f * x[i];   // a nearly constant row: eps matters
  fill(w, R * N, -1, 1);
  TokensCtx c = {x, y, w, R, N, 1};
  rt_layernorm_grad(w, x, dx, R, N, 1e-3f);
  check_fd("norm.layer", layernorm_obj, &c, x, R * N, dx, 1e-3);
  float x2[2] = {1, 3}, y2[2];   // mean 2, variance 1
  rt_layernorm(x2, y2, 1, 2, 1e-3f);
  assert_float_equal(y2[0], -1.0 / sqrt(1.0 + 1e-3), 1e-6);
  assert_float_equal(y2[1], 1.0 / sqrt(1.0 + 1e-3), 1e-6);
}

typedef struct {
  float *x, *g, *y, *w;
  int rows, n;
} ScaleCtx;

static double scale_obj(void *p) {
  ScaleCtx *c = p;
  rt_scale_cols(c->x, c->g, c->y, c->rows, c->n);
  return dot(c->w, c->y, (int64_t)c->rows * c->n);
}

static void test_fd_scale(void **state) {
  enum { R = 4, N = 5 };
  float x[R * N], g[N], y[R * N], w[R * N], dx[R * N], dg[N];
  fill(x, R * N, -2, 2);
  fill(g, N, -2, 2);
  fill(w, R * N, -1, 1);
  ScaleCtx c = {x, g, y, w, R, N};
  rt_scale_cols(w, g, dx, R, N);   // dx = scale(dy, w)
  rt_scale_cols_grad_w(w, x, dg, R, N);
  check_fd("scale (d/dx)", scale_obj, &c, x, R * N, dx, FD_EPS);
  check_fd("scale (d/dw)", scale_obj, &c, g, N, dg, FD_EPS);
}

// scale_rows (the shared expert's gate): one factor per row.
static double scale_rows_obj(void *p) {
  ScaleCtx *c = p;
  rt_scale_rows(c->x, c->g, c->y, c->rows, c->n);
  return dot(c->w, c->y, (int64_t)c->rows * c->n);
}

static void test_fd_scale_rows(void **state) {
  enum { R = 4, N = 5 };
  float x[R * N], g[R], y[R * N], w[R * N], dx[R * N], dg[R];
  fill(x, R * N, -2, 2);
  fill(g, R, -2, 2);
  fill(w, R * N, -1, 1);
  ScaleCtx c = {x, g, y, w, R, N};
  rt_scale_rows(w, g, dx, R, N);   // dx = scale_rows(dy, g)
  rt_scale_rows_grad_g(w, x, dg, R, N);
  check_fd("scale_rows (d/dx)", scale_rows_obj, &c, x, R * N, dx, FD_EPS);
  check_fd("scale_rows (d/dg)", scale_rows_obj, &c, g, R, dg, FD_EPS);
  float x2[4] = {1, 2, 3, 4}, g2[2] = {0.5f, -2}, y2[4];
  rt_scale_rows(x2, g2, y2, 2, 2);
  assert_true(y2[0] == 0.5f && y2[1] == 1 && y2[2] == -6 && y2[3] == -8);
}

// embed, rope, loss.xent (runtime/kernels/embed.c, loss.c).
typedef struct {
  const int32_t *tok;
  float *table, *y, *w;
  int t, m, v;
} EmbedCtx;

static double embed_obj(void *p) {
  EmbedCtx *c = p;
  rt_embed(c->tok, c->table, c->y, c->t, c->m, c->v, 0);
  return dot(c->w, c->y, (int64_t)c->t * c->m);
}

static void test_fd_embed(void **state) {
  enum { T = 6, M = 3, V = 5 };
  const int32_t tok[T] = {4, 0, 4, 2, 4, 1};   // a repeated token sums its rows; token 3 unused
  float table[V * M], y[T * M], w[T * M], dt[V * M];
  fill(table, V * M, -1, 1);
  fill(w, T * M, -1, 1);
  EmbedCtx c = {tok, table, y, w, T, M, V};
  rt_embed_grad(w, tok, dt, T, M, V, 0);
  check_fd("embed (d/dtable)", embed_obj, &c, table, V * M, dt, FD_EPS);
  for (int j = 0; j < M; j++) assert_true(dt[3 * M + j] == 0.0f);
}

typedef struct {
  float *x, *y, *w;
  int rows, cols, heads, seq, rotary, interleave;
} RopeCtx;

static double rope_obj(void *p) {
  RopeCtx *c = p;
  rt_rope(c->x, c->y, c->rows, c->cols, c->heads, c->seq, 10000.0f, 1, c->rotary, c->interleave, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
  return dot(c->w, c->y, (int64_t)c->rows * c->cols);
}

// Whole heads (rotary 0) and a partial rotary factor (4 of a head's 8 columns turn, the rest
// pass), each with the halves paired (c, c + R/2) and with adjacent pairs (2c, 2c + 1, interleave).
static void test_fd_rope(void **state) {
  enum { ROWS = 6, COLS = 16, HEADS = 2, SEQ = 3 };
  for (int k = 0; k < 4; k++) {
    int rotary = k % 2 ? 4 : 0, il = k / 2;
    float x[ROWS * COLS], y[ROWS * COLS], w[ROWS * COLS], dx[ROWS * COLS], back[ROWS * COLS];
    fill(x, ROWS * COLS, -2, 2);
    fill(w, ROWS * COLS, -1, 1);
    RopeCtx c = {x, y, w, ROWS, COLS, HEADS, SEQ, rotary, il};
    rt_rope(w, dx, ROWS, COLS, HEADS, SEQ, 10000.0f, -1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);   // the gradient: the inverse rotation
    check_fd("rope", rope_obj, &c, x, ROWS * COLS, dx, FD_EPS);
    // position 0 (rows 0 and 3) is unrotated; rotating back restores x
    rt_rope(x, y, ROWS, COLS, HEADS, SEQ, 10000.0f, 1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
    for (int j = 0; j < COLS; j++) assert_true(y[j] == x[j] && y[3 * COLS + j] == x[3 * COLS + j]);
    // the columns past rotary of every head pass unchanged; the turned ones move at position 1
    for (int h = 0; rotary > 0 && h < HEADS; h++)
      for (int j = rotary; j < COLS / HEADS; j++) assert_true(y[COLS + h * (COLS / HEADS) + j] == x[COLS + h * (COLS / HEADS) + j]);
    // the turn of the pair of frequency 1 at position 1 is theta^(-2/R): columns (1, 1 + R/2), or (2, 3)
    int R = rotary ? rotary : COLS / HEADS, a = il ? 2 : 1, b = il ? 3 : 1 + R / 2;
    double angle = pow(10000.0, -2.0 * 1 / R);
    assert_true(y[COLS + a] != x[COLS + a]);
    assert_true(fabs(y[COLS + a] - (x[COLS + a] * cos(angle) - x[COLS + b] * sin(angle))) < 1e-5);
    assert_true(fabs(y[COLS + b] - (x[COLS + b] * cos(angle) + x[COLS + a] * sin(angle))) < 1e-5);
    rt_rope(y, back, ROWS, COLS, HEADS, SEQ, 10000.0f, -1, rotary, il, 0.0f, 0, 1, 32.0f, 1.0f, 1.0f);
    assert_true(max_abs_diff(back, x, ROWS * COLS) < 1e-5f);
  }
}

// YaRN's frequencies against transformers' (rope_type "yarn", float32 there: 1e-6): 16 rotary
// columns, theta 10000, factor 4, 2048 original positions, beta 32 and 1. Pairs 0-2 keep theta's,
// 4-7 take theta's / 4, pair 3 is on the ramp. Without a factor: theta's.
static void test_rope_yarn(void **state) {
  static const double want[8] = {1, 0.316227764, 0.100000001, 0.025693506, 0.00624999963, 0.00138349656,
                                 0.000250000012, 7.90569466e-05};
  for (int c = 0; c < 8; c++) {
    double f = rt_rope_freq(c, 16, 10000.0, 4.0, 2048, 1, 32.0, 1.0);
    assert_true(fabs(f - want[c]) <= 1e-6 * want[c]);
    assert_true(rt_rope_freq(c, 16, 10000.0, 0.0, 2048, 1, 32.0, 1.0) == pow(10000.0, -2.0 * c / 16));
  }
}

// MLA's parts of heads: slices, placements back into zeros (the slice's adjoint: <slice(x), w> =
// <x, place(w)>), a shared head and per-head parts concatenated, and the sum over heads.
static void test_heads_ops(void **state) {
  enum { R = 3, H = 4, D = 6, OFF = 2, W = 3 };
  float x[R * H * D], s[R * H * W], w[R * H * W], p[R * H * D], a[R * 2], b[R * H * W], c[R * H * (2 + W)], sum[R * W];
  fill(x, R * H * D, -1, 1);
  fill(w, R * H * W, -1, 1);
  rt_heads_slice(x, s, R, H * D, H, OFF, W);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++)
      for (int j = 0; j < W; j++) assert_true(s[(r * H + h) * W + j] == x[r * H * D + h * D + OFF + j]);
  rt_heads_place(w, p, R, H, OFF, W, D);
  assert_true(fabs(dot(s, w, R * H * W) - dot(x, p, R * H * D)) < 1e-5);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) assert_true(p[(r * H + h) * D] == 0.0f && p[(r * H + h) * D + OFF] == w[(r * H + h) * W]);
  fill(a, R * 2, -1, 1);
  memcpy(b, w, sizeof b);
  rt_heads_cat(a, b, c, R, 2, H * W, H, 1);
  for (int r = 0; r < R; r++)
    for (int h = 0; h < H; h++) {
      assert_true(c[(r * H + h) * (2 + W)] == a[r * 2] && c[(r * H + h) * (2 + W) + 1] == a[r * 2 + 1]);
      assert_true(c[(r * H + h) * (2 + W) + 2] == b[(r * H + h) * W]);
    }
  rt_heads_sum(w, sum, R, H * W, H);
  for (int r = 0; r < R; r++)
    for (int j = 0; j < W; j++) {
      float t = 0.0f;
      for (int h = 0; h < H; h++) t += w[(r * H + h) * W + j];
      assert_true(sum[r * W + j] == t);
    }
}

typedef struct {
  float *logits, *loss;
  const int32_t *targets;
  int t, v;
} XentCtx;

static double xent_obj(void *p) {
  XentCtx *c = p;
  rt_xent(c->logits, c->targets, c->loss, c->t, c->v, 0.5f);
  return c->loss[0];
}

static void test_fd_xent(void **state) {
  enum { T = 4, V = 6 };
  const int32_t targets[T] = {0, 5, 2, 2};
  float logits[T * V], dl[T * V], loss[1];
  fill(logits, T * V, -3, 3);
  XentCtx c = {logits, loss, targets, T, V};
  rt_xent_grad(logits, targets, dl, T, V, 0.5f);
  check_fd("loss.xent", xent_obj, &c, logits, T * V, dl, FD_EPS);
  float flat[V] = {0};   // uniform logits: ln V
  const int32_t one[1] = {3};
  rt_xent(flat, one, loss, 1, V, 1.0f);
  assert_float_equal(loss[0], log(6.0), 1e-6);
}

typedef struct {
  float *x, *s, *y, *w;
  int64_t n;
} DivCtx;

static double div_obj(void *p) {
  DivCtx *c = p;
  rt_div_scalar(c->x, c->s, c->y, c->n);
  return dot(c->w, c->y, c->n);
}

static void test_fd_div_scalar(void **state) {
  enum { N = 24 };
  float x[N], y[N], w[N], dx[N], s[1] = {1.7f}, ds[1];
  fill(x, N, -2, 2);
  fill(w, N, -1, 1);
  DivCtx c = {x, s, y, w, N};
  rt_div_scalar_grad_x(w, s, dx, N);
  rt_div_scalar_grad_s(w, x, s, ds, N);
  check_fd("gate.div_scalar (d/dx)", div_obj, &c, x, N, dx, FD_EPS);
  check_fd("gate.div_scalar (d/ds)", div_obj, &c, s, 1, ds, FD_EPS);
}

// The routing of test_kernels.c: 8 tokens, 2 groups of 4, 3 experts, k = 2, capacity 2 per
// group, with 5 choices dropped.
enum { RS = 8, RK = 2, RE = 3, RG = 2, RCAP = 2, RC = RG * RCAP };
static const int32_t route_idx[RS * RK] = {0, 1, 0, 2, 0, 1, 1, 0, 2, 0, 2, 1, 1, 2, 0, 2};
static const int32_t route_loc[RS * RK] = {0, 1, 1, 0, -1, -1, 0, -1,
                                           0, 1, 1, 1, 0, -1, 0, -1};

typedef struct {
  float *gates, *cw, *w;
} CombineCtx;

static double combine_obj(void *p) {
  CombineCtx *c = p;
  rt_combine_weights(route_idx, route_loc, c->gates, c->cw, RS, RK, RE, RG, RCAP);
  return dot(c->w, c->cw, (int64_t)RS * RE * RC);
}

static void test_fd_combine_weights(void **state) {
  float gates[RS * RK], cw[RS * RE * RC], w[RS * RE * RC], dg[RS * RK];
  fill(gates, RS * RK, 0.1f, 1);
  fill(w, RS * RE * RC, -1, 1);
  CombineCtx c = {gates, cw, w};
  rt_combine_weights_grad(w, route_idx, route_loc, dg, RS, RK, RE, RG, RCAP);
  check_fd("order.combine_weights (d/dgates)", combine_obj, &c, gates, RS * RK, dg, FD_EPS);
  for (int i = 0; i < RS * RK; i++)
    if (route_loc[i] < 0)
      assert_true(dg[i] == 0.0f);
}

typedef struct {
  float *a, *b, *y, *w;
  int64_t n;
} MulCtx;

static double mul_obj(void *p) {
  MulCtx *c = p;
  rt_mul(c->a, c->b, c->y, c->n);
  return dot(c->w, c->y, c->n);
}

static void test_fd_mul(void **state) {
  enum { N = 32 };
  float a[N], b[N], y[N], w[N], da[N], db[N];
  fill(a, N, -2, 2);
  fill(b, N, -2, 2);
  fill(w, N, -1, 1);
  MulCtx c = {a, b, y, w, N};
  rt_mul(w, b, da, N);   // the gradient w.r.t. a is rt_mul(dy, b)
  rt_mul(w, a, db, N);
  check_fd("expert.mul (d/da)", mul_obj, &c, a, N, da, FD_EPS);
  check_fd("expert.mul (d/db)", mul_obj, &c, b, N, db, FD_EPS);
}

// ---- exact checks: elementwise and gate kernels ----

static void test_elementwise_values(void **state) {
  float x[5] = {0.0f, 100.0f, -100.0f, 1.0f, -1.0f}, y[5];
  rt_sigmoid(x, y, 5);
  assert_true(y[0] == 0.5f && y[1] == 1.0f);
  assert_true(y[2] > 0.0f && y[2] < 1e-40f);   // 3.7e-44, no overflow on either side
  assert_float_equal(y[3], 0.7310585786300049, 1e-7);
  assert_float_equal(y[4], 0.2689414213699951, 1e-7);
  rt_silu(x, y, 5);   // its sigmoid from rt_exp, which clamps at exp(88): silu(-100) = -100 / (1 + e^88)
  assert_true(y[0] == 0.0f && y[1] == 100.0f && y[2] < 0.0f && y[2] > -1e-35f);
  assert_float_equal(y[3], 0.7310585786300049, 1e-7);
  {   // act.oss: clamped values equal the edge's; gradients zero past an edge, passed at it; +0
      // where dy is zero (an expert's empty slots), whatever the sign of the rest
    const float g[6] = {10.0f, 7.0f, -100.0f, 0.5f, 3.0f, 2.0f}, u[6] = {2.0f, 2.0f, 0.5f, 10.0f, -7.5f, -7.0f};
    const float ge[6] = {7.0f, 7.0f, -100.0f, 0.5f, 3.0f, 2.0f}, ue[6] = {2.0f, 2.0f, 0.5f, 7.0f, -7.0f, -7.0f};
    float yo[6], ye[6], dg[6], du[6];
    const float dy[6] = {1.0f, 1.0f, 1.0f, 1.0f, 1.0f, 1.0f}, dz[6] = {-0.0f, 0.0f, -0.0f, 0.0f, -0.0f, -0.0f};
    rt_oss(g, u, yo, 6);
    rt_oss(ge, ue, ye, 6);
    assert_memory_equal(yo, ye, sizeof yo);
    assert_float_equal(yo[4], (-7.0 + 1.0) * 3.0 / (1.0 + exp(-1.702 * 3.0)), 1e-5);   // -6 g' sigmoid(1.702 g')
    rt_oss_grad_gate(dy, g, u, dg, 6);
    rt_oss_grad_up(dy, g, u, du, 6);
    assert_true(dg[0] == 0.0f && dg[1] != 0.0f);   // g = 10 past the edge, g = 7 at it
    assert_true(du[3] == 0.0f && du[4] == 0.0f && du[5] != 0.0f);   // u = 10, -7.5 past, -7 at
    assert_true(dg[2] > -1e-30f && dg[2] <= 0.0f);   // g = -100: sigmoid(-170) (rt_exp's clamp)
    assert_float_equal(du[5], 2.0 / (1.0 + exp(-1.702 * 2.0)), 1e-6);   // g' sigmoid(1.702 g'), g = 2
    assert_float_equal(dg[3], (7.0 + 1.0) * (1.0 / (1.0 + exp(-1.702 * 0.5))) *
                                  (1.0 + 1.702 * 0.5 * (1.0 - 1.0 / (1.0 + exp(-1.702 * 0.5)))), 1e-5);
    rt_oss_grad_gate(dz, g, u, dg, 6);
    rt_oss_grad_up(dz, g, u, du, 6);
    for (int i = 0; i < 6; i++) assert_true(dg[i] == 0.0f && !signbit(dg[i]) && du[i] == 0.0f && !signbit(du[i]));
  }
  rt_copy(x, y, 5);
  assert_memory_equal(x, y, sizeof x);
  rt_copy(y, y, 5);   // in place
  assert_memory_equal(x, y, sizeof x);
  const float s[1] = {-4.0f};
  rt_div_scalar(x, s, y, 5);
  assert_true(y[1] == -25.0f && y[4] == 0.25f);
}

static void test_softmax_tokens_values(void **state) {
  // Column sums over each group are 1; a large column stays finite.
  enum { S = 6, E = 2, G = 2 };
  float x[S * E] = {0, 1000, logf(3.0f), 1000, 0, 0, 1, 2, 1, 2, 1, 2}, y[S * E];
  rt_softmax_tokens(x, y, S, E, G);
  assert_float_equal(y[0], 0.2, 1e-7);
  assert_float_equal(y[2], 0.6, 1e-7);
  assert_float_equal(y[4], 0.2, 1e-7);
  assert_float_equal(y[1], 0.5, 1e-7);
  assert_float_equal(y[3], 0.5, 1e-7);
  assert_true(y[5] == 0.0f);
  for (int t = 3; t < 6; t++)
    for (int j = 0; j < E; j++)
      assert_float_equal(y[t * E + j], 1.0 / 3, 1e-7);
}

static void test_l2norm_values(void **state) {
  float x[6] = {3, 4, 0, 0, 0, 0}, y[6], dx[6];
  const float dy[6] = {1, 1, 1, 1, 1, 1};
  rt_l2norm(x, y, 2, 3);
  assert_float_equal(y[0], 0.6, 1e-7);
  assert_float_equal(y[1], 0.8, 1e-7);
  assert_true(y[2] == 0.0f && y[3] == 0.0f && y[5] == 0.0f);   // a zero row stays zero, no NaN
  rt_l2norm_grad(dy, x, dx, 2, 3);
  for (int i = 0; i < 6; i++)
    assert_true(isfinite(dx[i]));
}

// Expert choice, 8 tokens in 2 groups of 4, 3 experts, capacity 2 (ranks in parentheses):
//   group 0      e0    e1    e2        group 1      e0    e1    e2
//     t0        0.5   0.1   0.3          t4        0.9   0.8   0.1
//     t1        0.5   0.2   0.3          t5        0.8   0.9   0.1
//     t2        0.2   0.2   0.9          t6        0.7   0.7   0.2
//     t3        0.7   0.2   0.3          t7        0.1   0.1   NaN
// e0 takes t3 (0), t0 (1: ties t1, lower index); e1 takes t1, t2 (three-way tie at 0.2);
// e2 takes t2, then t0 (three-way tie at 0.3). Group 1: e0 takes t4, t5; e1 t5, t4; e2 t6, then
// t4 (tie with t5 at 0.1); NaN ranks last. t7 is taken by nobody: 1 dropped of 8 routed.
static const float choice_scores[8 * 3] = {
    0.5f, 0.1f, 0.3f, 0.5f, 0.2f, 0.3f, 0.2f, 0.2f, 0.9f, 0.7f, 0.2f, 0.3f,
    0.9f, 0.8f, 0.1f, 0.8f, 0.9f, 0.1f, 0.7f, 0.7f, 0.2f, 0.1f, 0.1f, NAN,
};

static void test_expert_choice(void **state) {
  enum { S = 8, E = 3, G = 2 };
  const int32_t want[S * E] = {1, -1, 1, -1, 0, -1, -1, 1, 0, 0, -1, -1,
                               0, 1, 1, 1, 0, -1, -1, -1, 0, -1, -1, -1};
  int32_t loc[S * E];
  RtStep st = {0};
  rt_step_begin_forward(&st);
  rt_expert_choice(choice_scores, loc, S, E, G, 2);
  rt_expert_choice_stats(&st, loc, S, E, G, 2);
  assert_memory_equal(loc, want, sizeof want);
  assert_int_equal(st.dropped, 1);
  assert_int_equal(st.routed, S);
  assert_int_equal(st.load_min, 2);  // loads are per routing group: 2 tokens each
  assert_int_equal(st.load_max, 2);
  assert_true(st.load_sum == 12.0 && st.load_count == 6);
  assert_true(st.route_hash != 0);
  uint64_t hash = st.route_hash;
  RtStep st2 = {0};
  rt_expert_choice(choice_scores, loc, S, E, G, 2);
  rt_expert_choice_stats(&st2, loc, S, E, G, 2);
  assert_true(st2.route_hash == hash);
  rt_expert_choice(choice_scores, loc, S, E, G, 2);
  assert_memory_equal(loc, want, sizeof want);

  // Capacity beyond the group: every token is taken, loc is the full rank order.
  rt_expert_choice(choice_scores, loc, S, E, G, 5);
  const int32_t want_all[S * E] = {1, 3, 1, 2, 0, 2, 3, 1, 0, 0, 2, 3,
                                   0, 1, 1, 1, 0, 2, 2, 2, 0, 3, 3, 3};
  assert_memory_equal(loc, want_all, sizeof want_all);

  int32_t idx[S * E];
  rt_iota(idx, S, E);
  for (int t = 0; t < S; t++)
    for (int j = 0; j < E; j++)
      assert_int_equal(idx[t * E + j], j);
}

// ---- the dense order against the sparse one ----

// For a routing (idx, loc, gates) over s tokens: mask^T x = encode(x), cw y = decode(y), and the
// three gradients of the dense form (mask dd, cw^T dout, combine_weights_grad(dout y^T)) equal
// encode_grad, decode_grad_y and decode_grad_gates.
static void check_dense_matches_sparse(const char *what, const int32_t *idx, const int32_t *loc,
                                       const float *gates, int s, int m, int k, int e, int g,
                                       int cap) {
  int c = g * cap, rows = e * c;
  size_t sm = (size_t)s * m, rm = (size_t)rows * m, sr = (size_t)s * rows;
  float *x = malloc(sm * sizeof *x), *y = malloc(rm * sizeof *y), *dd = malloc(rm * sizeof *dd);
  float *dout = malloc(sm * sizeof *dout), *mask = malloc(sr * sizeof *mask);
  float *cw = malloc(sr * sizeof *cw), *dcw = malloc(sr * sizeof *dcw);
  float *sp_rm = malloc(rm * sizeof(float)), *de_rm = malloc(rm * sizeof(float));
  float *sp_sm = malloc(sm * sizeof(float)), *de_sm = malloc(sm * sizeof(float));
  float *sp_g = malloc((size_t)s * k * sizeof(float));
  float *de_g = malloc((size_t)s * k * sizeof(float));
  fill(x, (int64_t)sm, -1, 1);
  fill(y, (int64_t)rm, -1, 1);
  fill(dd, (int64_t)rm, -1, 1);
  fill(dout, (int64_t)sm, -1, 1);
  rt_dispatch_mask(idx, loc, mask, s, k, e, g, cap);
  rt_combine_weights(idx, loc, gates, cw, s, k, e, g, cap);

  rt_zero(sp_rm, (int64_t)rm);
  rt_order_encode(x, idx, loc, sp_rm, s, m, k, e, g, cap);
  rt_matmul(mask, x, de_rm, rows, m, s, true, false, false);
  float err_encode = max_abs_diff(sp_rm, de_rm, (int64_t)rm);
  rt_order_decode(y, idx, loc, gates, sp_sm, s, m, k, e, g, cap);
  rt_matmul(cw, y, de_sm, s, m, rows, false, false, false);
  float err_decode = max_abs_diff(sp_sm, de_sm, (int64_t)sm);
  rt_order_encode_grad(dd, idx, loc, sp_sm, s, m, k, e, g, cap);
  rt_matmul(mask, dd, de_sm, s, m, rows, false, false, false);
  float err_encode_grad = max_abs_diff(sp_sm, de_sm, (int64_t)sm);
  rt_zero(sp_rm, (int64_t)rm);
  rt_order_decode_grad_y(dout, idx, loc, gates, sp_rm, s, m, k, e, g, cap);
  rt_matmul(cw, dout, de_rm, rows, m, s, true, false, false);
  float err_grad_y = max_abs_diff(sp_rm, de_rm, (int64_t)rm);
  rt_order_decode_grad_gates(dout, y, idx, loc, sp_g, s, m, k, e, g, cap);
  rt_matmul(dout, y, dcw, s, rows, m, false, true, false);
  rt_combine_weights_grad(dcw, idx, loc, de_g, s, k, e, g, cap);
  float err_grad_gates = max_abs_diff(sp_g, de_g, (int64_t)s * k);
  printf("# dense vs sparse %-22s encode %.1e decode %.1e encode.grad %.1e grad_y %.1e "
         "grad_gates %.1e\n", what, err_encode, err_decode, err_encode_grad, err_grad_y,
         err_grad_gates);
  assert_true(err_encode <= 1e-6f && err_decode <= 1e-6f && err_encode_grad <= 1e-6f);
  assert_true(err_grad_y <= 1e-6f && err_grad_gates <= 1e-6f);

  // The mask is one-hot per kept choice: its sum is the number of kept choices.
  double total = 0.0;
  int kept = 0;
  for (size_t i = 0; i < sr; i++)
    total += mask[i];
  for (int i = 0; i < s * k; i++)
    kept += loc[i] >= 0 && loc[i] < cap;
  assert_true(total == kept);
  float *buffers[] = {x, y, dd, dout, mask, cw, dcw, sp_rm, de_rm, sp_sm, de_sm, sp_g, de_g};
  for (size_t i = 0; i < sizeof buffers / sizeof *buffers; i++)
    free(buffers[i]);
}

static void test_dense_order_token_choice(void **state) {
  enum { S = 24, M = 5, E = 4, K = 2 };
  float logits[S * E], scores[S * E], gates[S * K];
  int32_t idx[S * K], loc[S * K];
  for (int g = 1; g <= 3; g++) {
    for (int cap = 1; cap <= 6; cap += 5) {   // 1: many drops; 6: a few
      fill(logits, S * E, -2, 2);
      rt_softmax(logits, scores, S, E);
      rt_topk(scores, idx, S, E, K, 1, 1, 0);
      rt_gate_gather(scores, idx, gates, S, E, K, true, 1.0f);
      rt_gate_locations(idx, loc, NULL, S, K, E, g, cap);
      char what[64];
      snprintf(what, sizeof what, "topk g=%d cap=%d", g, cap);
      check_dense_matches_sparse(what, idx, loc, gates, S, M, K, E, g, cap);
    }
  }
  // The hand-worked routing of test_kernels.c with its drops.
  fill(gates, RS * RK, 0.1f, 1);
  check_dense_matches_sparse("fixed routing", route_idx, route_loc, gates, RS, M, RK, RE, RG,
                             RCAP);
}

static void test_dense_order_expert_choice(void **state) {
  enum { S = 16, M = 3, E = 4, G = 2, CAP = 3 };
  float logits[S * E], scores[S * E];
  int32_t idx[S * E], loc[S * E];
  fill(logits, S * E, -2, 2);
  rt_softmax_tokens(logits, scores, S, E, G);
  rt_iota(idx, S, E);
  rt_expert_choice(scores, loc, S, E, G, CAP);
  check_dense_matches_sparse("expert choice", idx, loc, scores, S, M, E, E, G, CAP);
}

// ---- locations: dropless and load statistics ----

// route_idx without a capacity (want4 of test_kernels.c): per-group loads e0 4/2, e1 3/2,
// e2 1/4; over both groups 6, 5, 5.
static void test_gate_locations_dropless(void **state) {
  int32_t loc[RS * RK];
  RtStep st = {0};
  rt_step_begin_forward(&st);
  int most = rt_gate_locations(route_idx, loc, &st, RS, RK, RE, RG, 0);
  const int32_t want[RS * RK] = {0, 1, 1, 0, 2, 2, 0, 3, 0, 1, 1, 1, 0, 2, 0, 3};
  assert_memory_equal(loc, want, sizeof want);
  assert_int_equal(most, 4);
  assert_int_equal(st.dropped, 0);
  assert_int_equal(st.routed, RS * RK);
  assert_int_equal(st.capacity_max, 4);
  assert_int_equal(st.load_min, 1);  // per routing group: 4 3 1 | 2 2 4
  assert_int_equal(st.load_max, 4);
  assert_true(st.load_sum == 16.0 && st.load_count == 6);
  // A negative capacity is dropless too; st may be NULL.
  assert_int_equal(rt_gate_locations(route_idx, loc, NULL, RS, RK, RE, RG, -1), 4);
  assert_memory_equal(loc, want, sizeof want);
  // One group: e0 has 6 choices.
  assert_int_equal(rt_gate_locations(route_idx, loc, &st, RS, RK, RE, 1, 0), 6);
  assert_int_equal(st.capacity_max, 6);
}

// Two layers in one step: capacity 2 keeps, per routing group, e0 2|2, e1 2|2, e2 1|2 (the
// largest demand is still 4, and capacity_max is not touched by a layer with a capacity); then
// a dropless layer with loads 4|2, 3|2, 1|4. The statistics are min/max over every expert and
// group of both layers and the sum over both.
static void test_load_statistics(void **state) {
  int32_t loc[RS * RK];
  RtStep st = {.load_min = 1, .load_max = 99, .load_sum = 5, .load_count = 7, .capacity_max = 9};
  rt_step_begin_forward(&st);
  assert_true(st.load_min == INT64_MAX && st.load_max == 0 && st.load_sum == 0.0);
  assert_true(st.load_count == 0 && st.capacity_max == 0);
  assert_int_equal(rt_gate_locations(route_idx, loc, &st, RS, RK, RE, RG, RCAP), 4);
  assert_memory_equal(loc, route_loc, sizeof loc);
  assert_int_equal(st.load_min, 1);
  assert_int_equal(st.load_max, 2);
  assert_true(st.load_sum == 11.0 && st.load_count == 6);
  assert_int_equal(st.capacity_max, 0);
  assert_int_equal(st.dropped, 5);
  rt_gate_locations(route_idx, loc, &st, RS, RK, RE, RG, 0);
  assert_int_equal(st.load_min, 1);
  assert_int_equal(st.load_max, 4);
  assert_true(st.load_sum == 27.0 && st.load_count == 12);
  assert_int_equal(st.capacity_max, 4);
  assert_int_equal(st.dropped, 5);
  assert_int_equal(st.routed, 2 * RS * RK);
}

// ---- compression ----

static float f_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static uint32_t bits_f(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

// Expected bit patterns from Python: struct.unpack('<H', struct.pack('<e', x)) for x =
// struct.unpack('<f', struct.pack('<f', value)) (pack('<e') rounds to nearest even and raises
// OverflowError exactly when the result would be inf, as for 65520). 2^-24 is the smallest
// subnormal; 2^-25 is a tie between 0 and it (to even: 0); 2^-25 + 1 ulp rounds up; 3*2^-25 and
// 5*2^-25 are ties between subnormals 1|2 and 2|3; 1 + 2^-11 and 1 + 3*2^-11 are ties in the
// normal range (to 0x3c00 and 0x3c02); 2^-14 - 2^-24 is the largest subnormal.
static void test_fp16_edges(void **state) {
  const struct {
    uint32_t f32;
    uint16_t f16;
  } cases[] = {
      {0x00000000, 0x0000},   // 0
      {0x80000000, 0x8000},   // -0
      {0x3f800000, 0x3c00},   // 1
      {0xbf800000, 0xbc00},   // -1
      {0x477fe000, 0x7bff},   // 65504, the largest half
      {0x477fefff, 0x7bff},   // 65519.99 (just below the tie)
      {0x477ff000, 0x7c00},   // 65520 -> inf
      {0xc77ff000, 0xfc00},   // -65520 -> -inf
      {0x7f7fffff, 0x7c00},   // FLT_MAX -> inf
      {0x322bcc77, 0x0000},   // 1e-8 -> 0
      {0x33800000, 0x0001},   // 2^-24
      {0x33000000, 0x0000},   // 2^-25: tie, to even 0
      {0x33000001, 0x0001},   // 2^-25 + 1 ulp
      {0x33c00000, 0x0002},   // 3 * 2^-25: tie between 1 and 2
      {0x34200000, 0x0002},   // 5 * 2^-25: tie between 2 and 3
      {0x387fc000, 0x03ff},   // 2^-14 - 2^-24
      {0x38800000, 0x0400},   // 2^-14, the smallest normal
      {0x3f801000, 0x3c00},   // 1 + 2^-11: tie, to even
      {0x3f803000, 0x3c02},   // 1 + 3*2^-11: tie, to even (up)
      {0x3f801001, 0x3c01},   // just above the tie
      {0x3dcccccd, 0x2e66},   // 0.1
      {0xc0200000, 0xc100},   // -2.5
      {0x3eaaaaab, 0x3555},   // 1/3
      {0x7f800000, 0x7c00},   // inf
      {0xff800000, 0xfc00},   // -inf
      {0x00000001, 0x0000},   // the smallest binary32 subnormal
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    float x = f_bits(cases[i].f32);
    uint16_t q;
    rt_compress_f16(&x, &q, 1);
    if (q != cases[i].f16)
      fail_msg("fp16(%a = 0x%08x) = 0x%04x, want 0x%04x", x, cases[i].f32, q, cases[i].f16);
  }
  // NaN stays NaN (quiet, sign kept).
  float nans[2] = {NAN, -NAN};
  uint16_t q[2];
  rt_compress_f16(nans, q, 2);
  assert_true((q[0] & 0x7c00) == 0x7c00 && (q[0] & 0x3ff) != 0 && !(q[0] & 0x8000));
  assert_true((q[1] & 0x7c00) == 0x7c00 && (q[1] & 0x3ff) != 0 && (q[1] & 0x8000));
  float sig = f_bits(0x7f800001);   // a signalling NaN with a payload only in the low bits
  rt_compress_f16(&sig, q, 1);
  assert_true((q[0] & 0x7c00) == 0x7c00 && (q[0] & 0x3ff) != 0);

  // Decompression: struct.unpack('<e', ...) of these patterns.
  const uint16_t halves[] = {0x0001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x8000, 0x3555};
  const float values[] = {5.960464477539063e-08f, 6.097555160522461e-05f, 6.103515625e-05f,
                          65504.0f, INFINITY, -INFINITY, -0.0f, 0.333251953125f};
  float back[8];
  rt_decompress_f16(halves, back, 8);
  for (int i = 0; i < 8; i++)
    assert_true(bits_f(back[i]) == bits_f(values[i]));
  uint16_t qnan = 0x7e00;
  rt_decompress_f16(&qnan, back, 1);
  assert_true(isnan(back[0]));
}

// Every one of the 65536 halves survives decompress -> compress (NaNs as some NaN).
static void test_fp16_round_trip_all(void **state) {
  uint16_t *h = malloc(65536 * sizeof *h), *h2 = malloc(65536 * sizeof *h2);
  float *f = malloc(65536 * sizeof *f);
  for (int i = 0; i < 65536; i++)
    h[i] = (uint16_t)i;
  rt_decompress_f16(h, f, 65536);
  rt_compress_f16(f, h2, 65536);
  for (int i = 0; i < 65536; i++) {
    bool is_nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff) != 0;
    if (is_nan)
      assert_true(isnan(f[i]) && (h2[i] & 0x7c00) == 0x7c00 && (h2[i] & 0x3ff) != 0);
    else if (h2[i] != h[i])
      fail_msg("half 0x%04x -> %a -> 0x%04x", i, f[i], h2[i]);
  }
  free(h);
  free(h2);
  free(f);
}

// Random finite floats within the half range: the result is the nearest half (in double), and
// on a tie the one with an even mantissa. An independent check of the rounding rule.
static void test_fp16_nearest(void **state) {
  int ties = 0;
  for (int i = 0; i < 200000; i++) {
    // Exponents spread from 2^-27 to 2^15; every 8th draw sits exactly on a tie.
    float x = ldexpf(frand(1.0f, 2.0f), (int)(next_u64() % 43) - 27);
    if (i % 8 == 0) {
      uint16_t lo;
      rt_compress_f16(&x, &lo, 1);
      lo &= 0x7fff;
      float a, b;
      uint16_t pair[2] = {lo, (uint16_t)(lo + 1)};
      if (pair[1] >= 0x7c00)
        continue;
      rt_decompress_f16(pair, &a, 1);
      rt_decompress_f16(pair + 1, &b, 1);
      x = (float)(((double)a + b) / 2);
      if ((double)x != ((double)a + b) / 2)
        continue;
      ties++;
    }
    if (next_u64() & 1)
      x = -x;
    uint16_t q;
    rt_compress_f16(&x, &q, 1);
    if ((q & 0x7fff) >= 0x7c00) {   // only when x rounds past 65504
      assert_true(fabsf(x) >= 65520.0f);
      continue;
    }
    float got;
    rt_decompress_f16(&q, &got, 1);
    double err = fabs((double)got - x);
    uint16_t nb[2] = {(uint16_t)(q - 1), (uint16_t)(q + 1)};
    for (int j = 0; j < 2; j++) {
      if ((nb[j] & 0x7fff) >= 0x7c00 || (q & 0x7fff) == 0)
        continue;
      float other;
      rt_decompress_f16(&nb[j], &other, 1);
      double err2 = fabs((double)other - x);
      if (err2 < err || (err2 == err && (q & 1)))
        fail_msg("fp16(%a) = 0x%04x (%a) but 0x%04x (%a) is nearer or even", x, q, got, nb[j],
                 other);
    }
  }
  printf("# fp16 nearest-even: 200000 random values, %d exact ties\n", ties);
  assert_true(ties > 10000);
}

// Expected patterns: the top 16 bits of struct.pack('<f', x), rounded to nearest even on the
// low 16 (1 + 2^-8 and 1 + 3*2^-8 are ties; FLT_MAX rounds up to inf; 0x7f7f0000 is exact).
static void test_bf16_edges(void **state) {
  const struct {
    uint32_t f32;
    uint16_t bf16;
  } cases[] = {
      {0x00000000, 0x0000}, {0x80000000, 0x8000}, {0x3f800000, 0x3f80},
      {0x3f808000, 0x3f80},   // 1 + 2^-8: tie, to even
      {0x3f818000, 0x3f82},   // 1 + 3*2^-8: tie, to even (up)
      {0x3f808008, 0x3f81},   // just above the tie
      {0x7f7fffff, 0x7f80},   // FLT_MAX -> inf
      {0x7f7f0000, 0x7f7f},   // the largest bf16
      {0x3dcccccd, 0x3dcd},   // 0.1
      {0xc0200000, 0xc020},   // -2.5
      {0x7f800000, 0x7f80},   // inf
      {0xff800000, 0xff80},   // -inf
      {0x00010000, 0x0001},   // a subnormal, exact
      {0x00008000, 0x0000},   // a subnormal tie, to even 0
  };
  for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
    float x = f_bits(cases[i].f32), back;
    uint16_t q;
    rt_compress_bf16(&x, &q, 1);
    if (q != cases[i].bf16)
      fail_msg("bf16(0x%08x) = 0x%04x, want 0x%04x", cases[i].f32, q, cases[i].bf16);
    rt_decompress_bf16(&q, &back, 1);
    assert_true(bits_f(back) == (uint32_t)cases[i].bf16 << 16);
  }
  // NaN stays NaN, even one whose payload sits only in the low 16 bits (plain truncation or
  // the rounding add would turn 0x7f800001 into 0x7f80, inf).
  float nans[2] = {NAN, f_bits(0x7f800001)}, back[2];
  uint16_t q[2];
  rt_compress_bf16(nans, q, 2);
  rt_decompress_bf16(q, back, 2);
  assert_true(isnan(back[0]) && isnan(back[1]));
}

static void test_int8_round_trip(void **state) {
  enum { R = 5, N = 37 };
  float x[R * N], scale[R], back[R * N];
  int8_t q[R * N];
  fill(x, R * N, -3, 3);
  for (int i = 0; i < N; i++)
    x[3 * N + i] = 0.0f;          // an all-zero row: scale 1
  for (int i = 0; i < N; i++)
    x[4 * N + i] *= 1e-20f;       // a tiny row: scale still max/127
  rt_int8_scales(x, scale, R, N);
  rt_compress_int8(x, scale, q, R, N);
  rt_decompress_int8(q, scale, back, R, N);
  assert_true(scale[3] == 1.0f);
  for (int r = 0; r < R; r++) {
    float mx = 0.0f;
    for (int i = 0; i < N; i++)
      mx = fmaxf(mx, fabsf(x[r * N + i]));
    if (r != 3)
      assert_true(scale[r] == mx / 127.0f);
    for (int i = 0; i < N; i++) {
      float err = fabsf(back[r * N + i] - x[r * N + i]);
      // scale/2 plus the float rounding of x/scale and q*scale (a few ulps of |x|).
      if (!(err <= scale[r] * 0.5f * (1 + 1e-5f) + 4e-7f * fabsf(x[r * N + i])))
        fail_msg("int8 row %d elem %d: x %g back %g err %g > scale/2 %g", r, i, x[r * N + i],
                 back[r * N + i], err, scale[r] / 2);
      assert_true(q[r * N + i] >= -127 && q[r * N + i] <= 127);
    }
  }
  // Round half away from zero, the clamp, NaN -> 0.
  const float one = 1.0f, y[6] = {2.5f, -2.5f, 0.49f, 200.0f, -200.0f, NAN};
  const int8_t want[6] = {3, -3, 0, 127, -127, 0};
  int8_t qy[6];
  rt_compress_int8(y, &one, qy, 1, 6);
  assert_memory_equal(qy, want, sizeof want);
}

// ---- record ----

static void test_record(void **state) {
  const float x[4] = {1.0f, -3.0f, 2.5f, 0.5f};
  RtStep st = {.step = 7, .dropped = 1, .routed = 4};
  rt_record(&st, "before_dispatch", 2, x, 4);   // no file: nothing happens
  FILE *f = tmpfile();
  assert_non_null(f);
  st.record = f;
  rt_record(&st, "before_dispatch", 2, x, 4);
  st.routed = 0;
  const float bad[2] = {NAN, 1.0f};
  rt_record(&st, "after_combine", 0, bad, 2);
  rewind(f);
  char line[512];
  assert_non_null(fgets(line, sizeof line, f));
  assert_string_equal(line, "{\"step\": 7, \"layer\": 2, \"point\": \"before_dispatch\", "
                            "\"numel\": 4, \"mean\": 0.25, \"max_abs\": 3, \"dropped\": 0.25}\n");
  int step, layer;
  long long numel;
  double mean, max_abs, dropped;
  char point[32];
  assert_int_equal(sscanf(line, "{\"step\": %d, \"layer\": %d, \"point\": \"%31[^\"]\", "
                                "\"numel\": %lld, \"mean\": %lf, \"max_abs\": %lf, "
                                "\"dropped\": %lf}", &step, &layer, point, &numel, &mean,
                          &max_abs, &dropped),
                   7);
  assert_true(step == 7 && layer == 2 && numel == 4 && mean == 0.25 && max_abs == 3.0);
  assert_true(dropped == 0.25);
  assert_string_equal(point, "before_dispatch");
  // Non-finite statistics are JSON nulls; no routing yet: dropped 0.
  assert_non_null(fgets(line, sizeof line, f));
  assert_string_equal(line, "{\"step\": 7, \"layer\": 0, \"point\": \"after_combine\", "
                            "\"numel\": 2, \"mean\": null, \"max_abs\": null, \"dropped\": 0}\n");
  assert_null(fgets(line, sizeof line, f));
  fclose(f);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fd_sigmoid),
      cmocka_unit_test(test_fd_silu),
      cmocka_unit_test(test_fd_oss),
      cmocka_unit_test(test_fd_rmsnorm),
      cmocka_unit_test(test_fd_layernorm),
      cmocka_unit_test(test_fd_scale),
      cmocka_unit_test(test_fd_scale_rows),
      cmocka_unit_test(test_fd_embed),
      cmocka_unit_test(test_fd_rope),
    cmocka_unit_test(test_heads_ops),
    cmocka_unit_test(test_rope_yarn),
      cmocka_unit_test(test_fd_xent),
      cmocka_unit_test(test_fd_softmax_tokens),
      cmocka_unit_test(test_fd_l2norm_rows),
      cmocka_unit_test(test_fd_div_scalar),
      cmocka_unit_test(test_fd_combine_weights),
      cmocka_unit_test(test_fd_mul),
      cmocka_unit_test(test_elementwise_values),
      cmocka_unit_test(test_softmax_tokens_values),
      cmocka_unit_test(test_l2norm_values),
      cmocka_unit_test(test_expert_choice),
      cmocka_unit_test(test_dense_order_token_choice),
      cmocka_unit_test(test_dense_order_expert_choice),
      cmocka_unit_test(test_gate_locations_dropless),
      cmocka_unit_test(test_load_statistics),
      cmocka_unit_test(test_fp16_edges),
      cmocka_unit_test(test_fp16_round_trip_all),
      cmocka_unit_test(test_fp16_nearest),
      cmocka_unit_test(test_bf16_edges),
      cmocka_unit_test(test_int8_round_trip),
      cmocka_unit_test(test_record),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
