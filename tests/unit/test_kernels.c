// Unit tests of libmoert's CPU kernels and deterministic randomness.
//
// Backward kernels are checked against an independent formulation: central finite differences
// of a scalar L = sum(w * f(inputs)) with a fixed random projection w, evaluated in double from
// the float forward kernel. Routing is held fixed (idx and loc are integer inputs), so L is
// smooth in every float input. A check passes when
//     max_i |numeric_i - analytic_i| <= FD_TOL * max_i |analytic_i| + FD_ATOL.
// Each check prints one '#' line with its worst error. The remaining tests are exact:
// tie-breaking, locations and drops on a hand-worked case, encode/decode identities, optimizer
// steps and RNG values checked against an integer reimplementation in Python.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <cmocka.h>

#include "moert.h"
#include "rt_internal.h"   // rt_exp

#define FD_EPS 1e-2    // step for smooth ops; the gather check uses 1e-3 (scores are ~0.2)
#define FD_TOL 1e-3    // relative to the largest analytic gradient
#define FD_ATOL 1e-6   // absolute floor, for gradients that are exactly zero

// ---- helpers ----

static uint64_t test_state = 12345;

// Uniform in [lo, hi), from a splitmix64 sequence of the tests' own (independent of rt_mix).
static float frand(float lo, float hi) {
  uint64_t z = (test_state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return lo + (hi - lo) * (float)((z >> 40) * (1.0 / 16777216.0));
}

static void fill(float *x, int64_t n, float lo, float hi) {
  for (int64_t i = 0; i < n; i++)
    x[i] = frand(lo, hi);
}

// Values away from zero, for relu whose derivative jumps there.
static void fill_away_from_zero(float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    x[i] = (frand(0.0f, 1.0f) < 0.5f ? -1.0f : 1.0f) * frand(0.1f, 2.0f);
}

static double dot(const float *w, const float *y, int64_t n) {
  double acc = 0.0;
  for (int64_t i = 0; i < n; i++)
    acc += (double)w[i] * y[i];
  return acc;
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
    for (int64_t i = 0; i < n && i < 64; i++)
      printf("#   [%lld] analytic %.6e\n", (long long)i, analytic[i]);
    fail_msg("%s: finite differences disagree (max err %.3e > %.3e)", what, max_err, bound);
  }
}

// ---- finite-difference checks ----

typedef struct {
  float *x, *y, *w;
  int s, e;
} RowCtx;

static double softmax_obj(void *p) {
  RowCtx *c = p;
  rt_softmax(c->x, c->y, c->s, c->e);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void test_fd_softmax(void **state) {
  enum { S = 6, E = 5 };
  float x[S * E], y[S * E], w[S * E], dx[S * E];
  fill(x, S * E, -2, 2);
  fill(w, S * E, -1, 1);
  RowCtx c = {x, y, w, S, E};
  rt_softmax(x, y, S, E);
  rt_softmax_grad(w, y, dx, S, E);
  check_fd("softmax", softmax_obj, &c, x, S * E, dx, FD_EPS);
}

typedef struct {
  float *scores, *gates, *w;
  int32_t *idx;
  int s, e, k;
  bool renorm;
} GatherCtx;

static double gather_obj(void *p) {
  GatherCtx *c = p;
  rt_gate_gather(c->scores, c->idx, c->gates, c->s, c->e, c->k, c->renorm, 1.0f);
  return dot(c->w, c->gates, (int64_t)c->s * c->k);
}

static void fd_gather(int k, bool renorm) {
  enum { S = 6, E = 5 };
  float logits[S * E], scores[S * E], gates[S * 3], w[S * 3], ds[S * E];
  int32_t idx[S * 3];
  fill(logits, S * E, -2, 2);
  rt_softmax(logits, scores, S, E);
  rt_topk(scores, idx, S, E, k, 1, 1, 0);
  fill(w, S * k, -1, 1);
  GatherCtx c = {scores, gates, w, idx, S, E, k, renorm};
  rt_gate_gather_grad(w, scores, idx, ds, S, E, k, renorm, 1.0f);
  char name[64];
  snprintf(name, sizeof name, "gate.gather k=%d renorm=%d", k, renorm);
  check_fd(name, gather_obj, &c, scores, S * E, ds, 1e-3);
  // Not chosen: exactly zero.
  for (int t = 0; t < S; t++)
    for (int i = 0; i < E; i++) {
      bool chosen = false;
      for (int j = 0; j < k; j++)
        chosen |= idx[t * k + j] == i;
      if (!chosen)
        assert_true(ds[t * E + i] == 0.0f);
    }
}

static void test_fd_gate_gather(void **state) {
  fd_gather(1, false);
  fd_gather(1, true);
  fd_gather(2, false);
  fd_gather(2, true);
  fd_gather(3, true);
}

typedef struct {
  float *x;
  int32_t *idx;
  int s, e, k, g;
  float coef;
} LossCtx;

static double aux_obj(void *p) {
  LossCtx *c = p;
  return (double)c->coef * rt_aux_loss_value(c->x, c->idx, c->s, c->e, c->k, c->g);
}

static void test_fd_aux_loss(void **state) {
  enum { S = 8, E = 4, K = 2, G = 2 };
  float logits[S * E], scores[S * E], ds[S * E];
  int32_t idx[S * K];
  fill(logits, S * E, -2, 2);
  rt_softmax(logits, scores, S, E);
  rt_topk(scores, idx, S, E, K, 1, 1, 0);
  LossCtx c = {scores, idx, S, E, K, G, 0.5f};
  rt_aux_loss_grad(scores, idx, ds, S, E, K, G, c.coef);
  check_fd("gate.aux_loss (d/dscores)", aux_obj, &c, scores, S * E, ds, FD_EPS);
}

static double z_obj(void *p) {
  LossCtx *c = p;
  return (double)c->coef * rt_z_loss_value(c->x, c->s, c->e, c->g);
}

static void test_fd_z_loss(void **state) {
  enum { S = 8, E = 4, G = 2 };
  float logits[S * E], dl[S * E];
  fill(logits, S * E, -2, 2);
  LossCtx c = {logits, NULL, S, E, 1, G, 1.0f};
  rt_z_loss_grad(logits, dl, S, E, G, c.coef);
  check_fd("gate.z_loss (d/dlogits)", z_obj, &c, logits, S * E, dl, FD_EPS);
}

typedef struct {
  float *x, *y, *w;
  int64_t n;
  enum { ACT_GELU, ACT_RELU, ACT_RELU2 } act;
} ActCtx;

static double act_obj(void *p) {
  ActCtx *c = p;
  if (c->act == ACT_RELU)
    rt_relu(c->x, c->y, c->n);
  else if (c->act == ACT_RELU2)
    rt_relu2(c->x, c->y, c->n);
  else
    rt_gelu(c->x, c->y, c->n, c->n);
  return dot(c->w, c->y, c->n);
}

static void test_fd_gelu(void **state) {
  enum { N = 64 };
  float x[N], y[N], w[N], dx[N];
  fill(x, N, -3, 3);
  fill(w, N, -1, 1);
  ActCtx c = {x, y, w, N, ACT_GELU};
  rt_gelu_grad(w, x, dx, N);
  check_fd("act.gelu", act_obj, &c, x, N, dx, FD_EPS);
}

static void test_fd_relu(void **state) {
  enum { N = 64 };
  float x[N], y[N], w[N], dx[N];
  fill_away_from_zero(x, N);
  fill(w, N, -1, 1);
  ActCtx c = {x, y, w, N, ACT_RELU};
  rt_relu_grad(w, x, dx, N);
  check_fd("act.relu", act_obj, &c, x, N, dx, FD_EPS);
}

// Squared ReLU is smooth but at 0 (its derivative 2 max(x, 0) continuous there): points away from
// it as for ReLU, whose second derivative jumps at 0.
static void test_fd_relu2(void **state) {
  enum { N = 64 };
  float x[N], y[N], w[N], dx[N];
  fill_away_from_zero(x, N);
  fill(w, N, -1, 1);
  ActCtx c = {x, y, w, N, ACT_RELU2};
  rt_relu2_grad(w, x, dx, N);
  check_fd("act.relu2", act_obj, &c, x, N, dx, FD_EPS);
}

typedef struct {
  float *x, *b, *y, *w;
  int e, rows, n;   // e = 0: rt_bias, else rt_expert_bias
} BiasCtx;

static double bias_obj(void *p) {
  BiasCtx *c = p;
  if (c->e == 0) {
    rt_bias(c->x, c->b, c->y, c->rows, c->n);
    return dot(c->w, c->y, (int64_t)c->rows * c->n);
  }
  rt_expert_bias(c->x, c->b, c->y, c->e, c->rows, c->n);
  return dot(c->w, c->y, (int64_t)c->e * c->rows * c->n);
}

static void test_fd_bias(void **state) {
  enum { R = 5, N = 7, E = 3 };
  float x[E * R * N], b[E * N], y[E * R * N], w[E * R * N], db[E * N];
  fill(x, E * R * N, -1, 1);
  fill(b, E * N, -1, 1);
  fill(w, E * R * N, -1, 1);

  BiasCtx c = {x, b, y, w, 0, R, N};
  rt_bias_grad(w, db, R, N);
  check_fd("bias (d/db)", bias_obj, &c, b, N, db, FD_EPS);
  check_fd("bias (d/dx = dy)", bias_obj, &c, x, R * N, w, FD_EPS);

  BiasCtx ce = {x, b, y, w, E, R, N};
  rt_expert_bias_grad(w, db, E, R, N);
  check_fd("expert.bias (d/db)", bias_obj, &ce, b, E * N, db, FD_EPS);
  check_fd("expert.bias (d/dx = dy)", bias_obj, &ce, x, E * R * N, w, FD_EPS);
}

typedef struct {
  float *a, *b, *c, *w;
  int e, m, n, k;   // e = 0: rt_matmul, else rt_expert_matmul
  bool ta, tb;
} MatmulCtx;

static double matmul_obj(void *p) {
  MatmulCtx *c = p;
  if (c->e == 0) {
    rt_matmul(c->a, c->b, c->c, c->m, c->n, c->k, c->ta, c->tb, false);
    return dot(c->w, c->c, (int64_t)c->m * c->n);
  }
  rt_expert_matmul(c->a, c->b, c->c, c->e, c->m, c->n, c->k, c->ta, c->tb);
  return dot(c->w, c->c, (int64_t)c->e * c->m * c->n);
}

// The backward of C = op(A) op(B) with dC = W, written with the forward kernels as a generated
// program would: dop(A) = W op(B)^T, dop(B) = op(A)^T W, each stored the way its operand is.
static void mm(const MatmulCtx *c, const float *a, const float *b, float *out, int m, int n,
               int k, bool ta, bool tb) {
  if (c->e == 0)
    rt_matmul(a, b, out, m, n, k, ta, tb, false);
  else
    rt_expert_matmul(a, b, out, c->e, m, n, k, ta, tb);
}

static void matmul_backward(const MatmulCtx *c, float *da, float *db) {
  int m = c->m, n = c->n, k = c->k;
  if (!c->ta)
    mm(c, c->w, c->b, da, m, k, n, false, !c->tb);   // [m,k] = W op(B)^T
  else
    mm(c, c->b, c->w, da, k, m, n, c->tb, true);     // [k,m] = op(B) W^T
  if (!c->tb)
    mm(c, c->a, c->w, db, k, n, m, !c->ta, false);   // [k,n] = op(A)^T W
  else
    mm(c, c->w, c->a, db, n, k, m, true, c->ta);     // [n,k] = W^T op(A)
}

static void fd_matmul(int e, bool ta, bool tb) {
  enum { M = 4, N = 5, K = 3, EMAX = 3 };
  float a[EMAX * M * K], b[EMAX * K * N], c[EMAX * M * N], w[EMAX * M * N];
  float da[EMAX * M * K], db[EMAX * K * N];
  int ne = e ? e : 1;
  fill(a, ne * M * K, -1, 1);
  fill(b, ne * K * N, -1, 1);
  fill(w, ne * M * N, -1, 1);
  MatmulCtx ctx = {a, b, c, w, e, M, N, K, ta, tb};
  matmul_backward(&ctx, da, db);
  char name[64];
  snprintf(name, sizeof name, "%s ta=%d tb=%d (d/dA)", e ? "expert.matmul" : "matmul", ta, tb);
  check_fd(name, matmul_obj, &ctx, a, ne * M * K, da, FD_EPS);
  snprintf(name, sizeof name, "%s ta=%d tb=%d (d/dB)", e ? "expert.matmul" : "matmul", ta, tb);
  check_fd(name, matmul_obj, &ctx, b, ne * K * N, db, FD_EPS);
}

static void test_fd_matmul(void **state) {
  for (int t = 0; t < 4; t++)
    fd_matmul(0, t & 1, t & 2);
}

static void test_fd_expert_matmul(void **state) {
  for (int t = 0; t < 4; t++)
    fd_matmul(3, t & 1, t & 2);
}

// A small routing used by the encode/decode checks: 8 tokens, 2 groups of 4, 3 experts, k = 2,
// capacity 2 per group, so that some choices are dropped (worked out in test_gate_locations).
enum { RS = 8, RK = 2, RE = 3, RG = 2, RCAP = 2, RM = 3 };
static const int32_t route_idx[RS * RK] = {0, 1, 0, 2, 0, 1, 1, 0, 2, 0, 2, 1, 1, 2, 0, 2};
static const int32_t route_loc[RS * RK] = {0, 1, 1, 0, -1, -1, 0, -1,
                                           0, 1, 1, 1, 0, -1, 0, -1};

typedef struct {
  float *x, *disp, *gates, *out, *w;
  int cap;
} OrderCtx;

static double encode_obj(void *p) {
  OrderCtx *c = p;
  rt_zero(c->disp, (int64_t)RE * RG * c->cap * RM);
  rt_order_encode(c->x, route_idx, route_loc, c->disp, RS, RM, RK, RE, RG, c->cap);
  return dot(c->w, c->disp, (int64_t)RE * RG * c->cap * RM);
}

static void test_fd_order_encode(void **state) {
  float x[RS * RM], disp[RE * RG * RCAP * RM], w[RE * RG * RCAP * RM], dx[RS * RM];
  fill(x, RS * RM, -1, 1);
  fill(w, RE * RG * RCAP * RM, -1, 1);
  OrderCtx c = {x, disp, NULL, NULL, w, RCAP};
  rt_order_encode_grad(w, route_idx, route_loc, dx, RS, RM, RK, RE, RG, RCAP);
  check_fd("order.encode (d/dx)", encode_obj, &c, x, RS * RM, dx, FD_EPS);
}

static double decode_obj(void *p) {
  OrderCtx *c = p;
  rt_order_decode(c->disp, route_idx, route_loc, c->gates, c->out, RS, RM, RK, RE, RG, c->cap);
  return dot(c->w, c->out, (int64_t)RS * RM);
}

static void test_fd_order_decode(void **state) {
  float y[RE * RG * RCAP * RM], gates[RS * RK], out[RS * RM], w[RS * RM];
  float dy[RE * RG * RCAP * RM], dg[RS * RK];
  fill(y, RE * RG * RCAP * RM, -1, 1);
  fill(gates, RS * RK, 0.1f, 1);
  fill(w, RS * RM, -1, 1);
  OrderCtx c = {NULL, y, gates, out, w, RCAP};
  rt_zero(dy, RE * RG * RCAP * RM);
  rt_order_decode_grad_y(w, route_idx, route_loc, gates, dy, RS, RM, RK, RE, RG, RCAP);
  rt_order_decode_grad_gates(w, y, route_idx, route_loc, dg, RS, RM, RK, RE, RG, RCAP);
  check_fd("order.decode (d/dy)", decode_obj, &c, y, RE * RG * RCAP * RM, dy, FD_EPS);
  check_fd("order.decode (d/dgates)", decode_obj, &c, gates, RS * RK, dg, FD_EPS);
}

typedef struct {
  float *o, *t;
  int64_t n;
} MseCtx;

static double mse_obj(void *p) {
  MseCtx *c = p;
  return rt_mse_value(c->o, c->t, c->n);
}

static void test_fd_mse(void **state) {
  enum { N = 20 };
  float o[N], t[N], d[N];
  fill(o, N, -1, 1);
  fill(t, N, -1, 1);
  MseCtx c = {o, t, N};
  rt_mse_grad(o, t, d, N, 1.0f);
  check_fd("loss.mse (d/dout)", mse_obj, &c, o, N, d, FD_EPS);
}

typedef struct {
  RtStep *st;
  float *x, *y, *w;
  int s, e;
} NoiseCtx;

static double noise_obj(void *p) {
  NoiseCtx *c = p;
  rt_gate_noise(c->x, c->y, c->s, c->e, 1.0f, 3, c->st->seed, c->st->step, c->st->token0);
  return dot(c->w, c->y, (int64_t)c->s * c->e);
}

static void test_fd_gate_noise(void **state) {
  enum { S = 6, E = 4 };
  float x[S * E], y[S * E], w[S * E];
  fill(x, S * E, -2, 2);
  fill(w, S * E, -1, 1);
  RtStep st = {.step = 2, .seed = 42, .token0 = 5};
  NoiseCtx c = {&st, x, y, w, S, E};
  check_fd("gate.noise (identity)", noise_obj, &c, x, S * E, w, FD_EPS);
}

// ---- exact checks ----

static void naive_matmul(const float *a, const float *b, double *c, int m, int n, int k, bool ta,
                         bool tb) {
  for (int i = 0; i < m; i++)
    for (int j = 0; j < n; j++) {
      double acc = 0.0;
      for (int l = 0; l < k; l++) {
        float av = ta ? a[l * m + i] : a[i * k + l];
        float bv = tb ? b[j * k + l] : b[l * n + j];
        acc += (double)av * bv;
      }
      c[i * n + j] = acc;
    }
}

static void test_matmul_values(void **state) {
  enum { M = 7, N = 5, K = 6 };
  float a[M * K], b[K * N], c[M * N], c0[M * N];
  double ref[M * N];
  fill(a, M * K, -1, 1);
  fill(b, K * N, -1, 1);
  for (int t = 0; t < 4; t++) {
    bool ta = t & 1, tb = t & 2;
    naive_matmul(a, b, ref, M, N, K, ta, tb);
    rt_matmul(a, b, c, M, N, K, ta, tb, false);
    for (int i = 0; i < M * N; i++)
      assert_true(fabs(c[i] - ref[i]) <= 1e-5);
    fill(c0, M * N, -1, 1);
    memcpy(c, c0, sizeof c);
    rt_matmul(a, b, c, M, N, K, ta, tb, true);
    for (int i = 0; i < M * N; i++)
      assert_true(fabs(c[i] - (c0[i] + ref[i])) <= 1e-5);
  }
  // k = 0: the product is empty; C is zeroed, or left alone when accumulating.
  memcpy(c, c0, sizeof c);
  rt_matmul(a, b, c, M, N, 0, false, false, true);
  assert_memory_equal(c, c0, sizeof c);
  rt_matmul(a, b, c, M, N, 0, false, false, false);
  for (int i = 0; i < M * N; i++)
    assert_true(c[i] == 0.0f);
}

static void test_bias_grad_wide(void **state) {
  // Wider than the kernel's 256-column block.
  enum { R = 3, N = 300 };
  float dy[R * N], db[N];
  fill(dy, R * N, -1, 1);
  rt_bias_grad(dy, db, R, N);
  for (int i = 0; i < N; i++)
    assert_true(db[i] == (float)((double)dy[i] + dy[N + i] + dy[2 * N + i]));
}

static void test_activation_values(void **state) {
  float x[4] = {0.0f, 1.0f, -1.0f, 2.5f}, y[4];
  rt_gelu(x, y, 4, 4);
  assert_true(y[0] == 0.0f);
  assert_float_equal(y[1], 0.84119199060827676, 1e-6);   // tanh form, from Python's math
  assert_float_equal(y[2], -0.15880800939172324, 1e-6);
  assert_float_equal(y[3], 2.4849157339100012, 1e-6);
  rt_relu(x, y, 4);
  assert_true(y[0] == 0.0f && y[1] == 1.0f && y[2] == 0.0f && y[3] == 2.5f);
  float dy[4] = {1, 1, 1, 1}, dx[4];
  rt_relu_grad(dy, x, dx, 4);
  assert_true(dx[0] == 0.0f && dx[1] == 1.0f && dx[2] == 0.0f && dx[3] == 1.0f);
  rt_gelu_grad(dy, x, dx, 1);
  assert_float_equal(dx[0], 0.5, 1e-7);
  // squared ReLU: x^2 and 2x where x > 0, +0 elsewhere (NaN and -0 too); 2.5^2 and 2 * 2.5 exact
  float x2[6] = {0.0f, 1.0f, -1.0f, 2.5f, -0.0f, NAN}, y2[6], dy2[6] = {1, 1, 1, 3, 1, 1}, dx2[6];
  rt_relu2(x2, y2, 6);
  rt_relu2_grad(dy2, x2, dx2, 6);
  float want_y[6] = {0, 1, 0, 6.25f, 0, 0}, want_dx[6] = {0, 2, 0, 15, 0, 0};
  for (int i = 0; i < 6; i++) {
    assert_true(y2[i] == want_y[i] && !signbit(y2[i]));
    assert_true(dx2[i] == want_dx[i] && !signbit(dx2[i]));
  }
}

// rt_exp, GELU's exp: within 1.5 ulp of exp on a dense grid of [-87, 88], clamped outside (never
// inf), NaN through; GELU saturates to 0 and x at the ends.
static void test_exp_poly(void **state) {
  enum { N = 2000000 };
  double worst = 0.0;
  for (int i = 0; i <= N; i++) {
    float x = -87.0f + 175.0f * (float)i / (float)N;
    double want = exp((double)x);
    double ulp = (double)nextafterf((float)want, INFINITY) - (float)want;
    double err = fabs((double)rt_exp(x) - want) / ulp;
    if (err > worst) worst = err;
  }
  printf("# rt_exp over %d points of [-87, 88]: worst %.3f ulp\n", N + 1, worst);
  assert_true(worst < 1.5);
  assert_true(rt_exp(0.0f) == 1.0f);
  assert_true(rt_exp(-1000.0f) == rt_exp(-87.0f) && rt_exp(1000.0f) == rt_exp(88.0f));
  assert_true(isfinite(rt_exp(1e30f)) && rt_exp(-1e30f) > 0.0f);
  assert_true(isnan(rt_exp(NAN)));
  float x[3] = {-30.0f, 30.0f, NAN}, y[3];
  rt_gelu(x, y, 3, 3);
  assert_true(fabsf(y[0]) < 1e-30f && y[1] == 30.0f && isnan(y[2]));
}

static void test_softmax_values(void **state) {
  // Large logits: subtracting the row max keeps it finite.
  float x[6] = {1000.0f, 1000.0f, 0.0f, 0.0f, logf(3.0f), 0.0f}, y[6];
  rt_softmax(x, y, 2, 3);
  assert_float_equal(y[0], 0.5, 1e-7);
  assert_float_equal(y[1], 0.5, 1e-7);
  assert_true(y[2] == 0.0f);
  assert_float_equal(y[3], 0.2, 1e-7);
  assert_float_equal(y[4], 0.6, 1e-7);
  assert_float_equal(y[5], 0.2, 1e-7);
}

static void test_topk_ties(void **state) {
  enum { S = 4, E = 5, K = 3 };
  const float scores[S * E] = {
      0.1f, 0.3f, 0.3f, 0.2f, 0.3f,   // three-way tie: lower indices first
      0.2f, 0.2f, 0.2f, 0.2f, 0.2f,   // all equal
      0.5f, NAN,  0.1f, 0.9f, 0.1f,   // NaN ranks last
      1.0f, 2.0f, 3.0f, 4.0f, 5.0f,   // ascending
  };
  const int32_t want[S * K] = {1, 2, 4, 0, 1, 2, 3, 0, 2, 4, 3, 2};
  int32_t idx[S * K];
  rt_topk(scores, idx, S, E, K, 1, 1, 0);
  assert_memory_equal(idx, want, sizeof want);

  int32_t all[E];
  rt_topk(scores + 15, all, 1, E, E, 1, 1, 0);   // k = e: the full descending order
  const int32_t want_all[E] = {4, 3, 2, 1, 0};
  assert_memory_equal(all, want_all, sizeof want_all);
}

static void test_gate_gather_values(void **state) {
  const float scores[4] = {0.5f, 0.1f, 0.3f, 0.1f};
  const int32_t idx[2] = {0, 2};
  float gates[2];
  rt_gate_gather(scores, idx, gates, 1, 4, 2, false, 1.0f);
  assert_true(gates[0] == 0.5f && gates[1] == 0.3f);
  rt_gate_gather(scores, idx, gates, 1, 4, 2, true, 1.0f);
  assert_float_equal(gates[0], 0.625, 1e-7);
  assert_float_equal(gates[1], 0.375, 1e-7);
}

// The hand-worked routing of route_idx with capacity 2 (groups: tokens 0-3 and 4-7).
// Group 0, first choices: t0 e0->0, t1 e0->1, t2 e0 dropped, t3 e1->0;
//          second choices: t0 e1->1, t1 e2->0, t2 e1 dropped, t3 e0 dropped.   3 drops
// Group 1, first choices: t4 e2->0, t5 e2->1, t6 e1->0, t7 e0->0;
//          second choices: t4 e0->1, t5 e1->1, t6 e2 dropped, t7 e2 dropped.   2 drops
static void test_gate_locations(void **state) {
  int32_t loc[RS * RK];
  RtStep st = {.dropped = 1, .routed = 4, .route_hash = 0};
  rt_gate_locations(route_idx, loc, &st, RS, RK, RE, RG, RCAP);
  assert_memory_equal(loc, route_loc, sizeof loc);
  assert_int_equal(st.dropped, 1 + 5);
  assert_int_equal(st.routed, 4 + RS * RK);
  uint64_t hash = st.route_hash;
  assert_true(hash != 0);

  // Same routing, same hash; st may be NULL.
  RtStep st2 = {0};
  rt_gate_locations(route_idx, loc, &st2, RS, RK, RE, RG, RCAP);
  assert_true(st2.route_hash == hash);
  rt_gate_locations(route_idx, loc, NULL, RS, RK, RE, RG, RCAP);
  assert_memory_equal(loc, route_loc, sizeof loc);

  // Another capacity changes the locations and the hash.
  RtStep st3 = {0};
  rt_gate_locations(route_idx, loc, &st3, RS, RK, RE, RG, 4);
  assert_int_equal(st3.dropped, 0);
  assert_true(st3.route_hash != hash);
  const int32_t want4[RS * RK] = {0, 1, 1, 0, 2, 2, 0, 3, 0, 1, 1, 1, 0, 2, 0, 3};
  assert_memory_equal(loc, want4, sizeof want4);

  // One group over all 8 tokens, capacity 3.
  rt_gate_locations(route_idx, loc, NULL, RS, RK, RE, 1, 3);
  // first choices: e0: t0 0, t1 1, t2 2, t7 -; e1: t3 0, t6 1; e2: t4 0, t5 1
  // second choices: e1: t0 2, t2 -, t5 -; e2: t1 2, t6 -, t7 -; e0: t3 -, t4 -
  const int32_t want1[RS * RK] = {0, 2, 1, 2, 2, -1, 0, -1, 0, -1, 1, -1, 1, -1, -1, -1};
  assert_memory_equal(loc, want1, sizeof want1);
}

static int count_kept(int t) {
  return (route_loc[t * RK] >= 0) + (route_loc[t * RK + 1] >= 0);
}

static void test_order_round_trip(void **state) {
  enum { M = 4, ROWS = RE * RG * RCAP };
  float x[RS * M], disp[ROWS * M], out[RS * M], dx[RS * M], gates[RS * RK];
  fill(x, RS * M, -1, 1);
  for (int i = 0; i < RS * RK; i++)
    gates[i] = 0.5f;
  for (int i = 0; i < ROWS * M; i++)   // encode writes every row: the empty one must not stay NaN
    disp[i] = NAN;
  rt_order_encode(x, route_idx, route_loc, disp, RS, M, RK, RE, RG, RCAP);

  // Placement: expert 0, group 0 holds t0, t1; expert 2 group 1 (rows 2, 3) holds t4, t5.
  assert_memory_equal(disp + 0 * M, x + 0 * M, M * sizeof *x);
  assert_memory_equal(disp + 1 * M, x + 1 * M, M * sizeof *x);
  assert_memory_equal(disp + (2 * RG * RCAP + 2) * M, x + 4 * M, M * sizeof *x);
  assert_memory_equal(disp + (2 * RG * RCAP + 3) * M, x + 5 * M, M * sizeof *x);

  // Every row either holds a kept choice or is zero: 11 kept choices, 12 rows.
  int nonzero = 0;
  for (int r = 0; r < ROWS; r++) {
    bool any = false;
    for (int i = 0; i < M; i++)
      any |= disp[r * M + i] != 0.0f;
    nonzero += any;
  }
  assert_int_equal(nonzero, 11);

  // Decode with gates 1/2: kept choices sum to x exactly, dropped ones add nothing.
  rt_order_decode(disp, route_idx, route_loc, gates, out, RS, M, RK, RE, RG, RCAP);
  for (int t = 0; t < RS; t++)
    for (int i = 0; i < M; i++)
      assert_true(out[t * M + i] == 0.5f * count_kept(t) * x[t * M + i]);

  // encode_grad(encode(x)) = (number of kept choices) * x.
  rt_order_encode_grad(disp, route_idx, route_loc, dx, RS, M, RK, RE, RG, RCAP);
  for (int t = 0; t < RS; t++)
    for (int i = 0; i < M; i++)
      assert_true(dx[t * M + i] == count_kept(t) * x[t * M + i]);

  // decode_grad_y is zero on the empty row; dgates is zero for dropped choices.
  float dy[ROWS * M], dg[RS * RK];
  for (int i = 0; i < ROWS * M; i++)
    dy[i] = NAN;
  rt_order_decode_grad_y(x, route_idx, route_loc, gates, dy, RS, M, RK, RE, RG, RCAP);
  rt_order_decode_grad_gates(x, disp, route_idx, route_loc, dg, RS, M, RK, RE, RG, RCAP);
  for (int r = 0; r < ROWS; r++) {
    bool empty = true;
    for (int i = 0; i < M; i++)
      empty &= disp[r * M + i] == 0.0f;
    for (int i = 0; i < M && empty; i++)
      assert_true(dy[r * M + i] == 0.0f);
  }
  for (int c = 0; c < RS * RK; c++)
    if (route_loc[c] < 0)
      assert_true(dg[c] == 0.0f);
}

static void test_loss_values(void **state) {
  const float scores[8] = {0.9f, 0.1f, 0.6f, 0.4f, 0.2f, 0.8f, 0.5f, 0.5f};
  int32_t idx[4];
  rt_topk(scores, idx, 4, 2, 1, 1, 1, 0);   // 0, 0, 1, 0 (the tie goes to expert 0)
  // One group: me = (0.55, 0.45), ce = (0.75, 0.25): 2 * (0.4125 + 0.1125) = 1.05.
  assert_float_equal(rt_aux_loss_value(scores, idx, 4, 2, 1, 1), 1.05, 1e-6);
  // Two groups: 2*(0.75*1) = 1.5 and 2*(0.35*0.5 + 0.65*0.5) = 1.0, mean 1.25.
  assert_float_equal(rt_aux_loss_value(scores, idx, 4, 2, 1, 2), 1.25, 1e-6);

  // z: rows (0, 0) and (ln 3, 0): (ln^2 2 + ln^2 4) / 2.
  const float logits[4] = {0.0f, 0.0f, logf(3.0f), 0.0f};
  assert_float_equal(rt_z_loss_value(logits, 2, 2, 1), 1.2011325347955035, 1e-6);
  assert_float_equal(rt_z_loss_value(logits, 2, 2, 2), 1.2011325347955035, 1e-6);

  const float o[3] = {1, 2, 3}, t[3] = {0, 0, 1};
  float d[3];
  assert_float_equal(rt_mse_value(o, t, 3), 1.5, 1e-7);
  rt_mse_grad(o, t, d, 3, 1.0f);
  assert_float_equal(d[0], 1.0 / 3, 1e-7);
  assert_float_equal(d[1], 2.0 / 3, 1e-7);
  assert_float_equal(d[2], 2.0 / 3, 1e-7);
}

static void test_optimizers(void **state) {
  float p[2] = {1.0f, -2.0f};
  const float g[2] = {0.5f, -1.0f};
  rt_sgd(p, g, 2, 0.1f, 0.01f, 1.0f, 1.0f);
  assert_float_equal(p[0], 0.949, 1e-6);    // 1 - 0.1 (0.5 + 0.01)
  assert_float_equal(p[1], -1.898, 1e-6);   // -2 - 0.1 (-1 - 0.02)
  // The schedule's lr_scale and clipping's grad_scale: lr 0.1 * 0.5, gradient * 0.5.
  float r[2] = {1.0f, -2.0f};
  rt_sgd(r, g, 2, 0.1f, 0.01f, 0.5f, 0.5f);
  assert_float_equal(r[0], 0.987, 1e-6);    // 1 - 0.05 (0.25 + 0.01)
  assert_float_equal(r[1], -1.974, 1e-6);   // -2 - 0.05 (-0.5 - 0.02)

  // AdamW, lr 0.1, betas (0.9, 0.999), eps 1e-8, weight decay 0.01. Step 1: mhat = g,
  // vhat = g^2, so the update is lr (sign(g) + wd p) up to eps.
  float q[2] = {1.0f, -2.0f}, m[2] = {0, 0}, v[2] = {0, 0};
  // 1 - 0.9f and 1 - 0.999f are not exact in float, hence the tolerances on the moments.
  rt_adamw(q, g, m, v, 2, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 1, 1.0f, 1.0f);
  assert_float_equal(m[0], 0.05, 1e-7);
  assert_float_equal(v[0], 0.00025, 1e-8);
  assert_float_equal(q[0], 0.899, 1e-6);    // 1 - 0.1 (1 + 0.01)
  assert_float_equal(q[1], -1.898, 1e-6);   // -2 - 0.1 (-1 - 0.02)
  // Step 2, same gradient: m = 0.095, v = 0.00049975, mhat = 0.5, vhat = 0.25 again,
  // q0 = 0.899 - 0.1 (1 + 0.01 * 0.899) = 0.798101.
  rt_adamw(q, g, m, v, 2, 0.1f, 0.9f, 0.999f, 1e-8f, 0.01f, 2, 1.0f, 1.0f);
  assert_float_equal(m[0], 0.095, 1e-7);
  assert_float_equal(v[0], 0.00049975, 1e-8);
  assert_float_equal(q[0], 0.798101, 1e-6);
}

// Constants from a Python integer reimplementation of moert.h's definitions (splitmix64's
// finaliser with 64-bit wrap-around, FNV-1a 64); rt_mix(0) is splitmix64's well-known first
// output for seed 0, and FNV-1a("a") the published test vector.
static void test_rng_constants(void **state) {
  assert_true(rt_mix(0) == 0xe220a8397b1dcdafULL);
  assert_true(rt_mix(1) == 0x910a2dec89025cc1ULL);
  assert_true(rt_mix(UINT64_MAX) == 0xe4d971771b652c20ULL);
  assert_true(rt_key(42, 1) == 0x7eb3b394ac9efc29ULL);
  assert_true(rt_key(rt_key(42, 1), 3) == 0xbcc8b206714523c9ULL);
  assert_true(rt_uniform(rt_mix(0)) == 0.88331082463264465);
  assert_true(rt_uniform(0) == 0.5 / 16777216.0);
  assert_true(rt_uniform(UINT64_MAX) == 1.0 - 0.5 / 16777216.0);

  uint64_t key = rt_key(rt_key(42, RT_STREAM_NOISE), 1);
  // The values tests/ref/moe_ref.py's numpy twin computes (float32 step by step): the same bits.
  assert_true(rt_normal(key, 0) == (double)-0.2813464403152466f);
  assert_true(rt_normal(key, 1) == (double)0.14713847637176514f);
  assert_true(rt_normal(key, 7) == (double)-0.15407010912895203f);
  assert_true(rt_normal(key, 1000) == (double)-0.4435584247112274f);

  assert_true(rt_hash_name("") == 0xcbf29ce484222325ULL);
  assert_true(rt_hash_name("a") == 0xaf63dc4c8601ec8cULL);
  assert_true(rt_hash_name("block0.moe.gate.wg") == 0x72c1802f657a33c4ULL);
  assert_true(rt_hash_name("block0.moe.experts.w1") == 0xf5108f26992b039aULL);
}

static void test_normal_moments(void **state) {
  enum { N = 100000 };
  uint64_t key = rt_key(rt_key(7, RT_STREAM_INPUT), 1);
  double sum = 0.0, sum2 = 0.0;
  for (int i = 0; i < N; i++) {
    double z = rt_normal(key, (uint64_t)i);
    sum += z;
    sum2 += z * z;
  }
  double mean = sum / N, var = sum2 / N - mean * mean;
  printf("# rt_normal over %d samples: mean %.5f var %.5f\n", N, mean, var);
  // Standard errors are 0.0032 (mean) and 0.0045 (variance): these are about 4 sigma.
  assert_true(fabs(mean) < 0.013);
  assert_true(fabs(var - 1.0) < 0.018);
}

// rt_normal_fill = rt_normal element by element, from an odd or even first index, odd or even
// lengths, on one thread and threaded (the fill splits pairs over the pool).
static void test_normal_fill(void **state) {
  enum { N = 70001 };
  static float out[N + 1];
  uint64_t key = rt_key(rt_key(7, RT_STREAM_INPUT), 2);
  const int64_t firsts[] = {0, 1, 6, 99999}, lengths[] = {0, 1, 2, 3, 17, 1000, N};
  for (size_t a = 0; a < sizeof firsts / sizeof *firsts; a++)
    for (size_t b = 0; b < sizeof lengths / sizeof *lengths; b++) {
      int64_t first = firsts[a], n = lengths[b];
      out[n] = 12345.0f;
      rt_normal_fill(key, (uint64_t)first, n, out);
      for (int64_t i = 0; i < n; i++)
        if (out[i] != (float)rt_normal(key, (uint64_t)(first + i)))
          fail_msg("rt_normal_fill(first %lld, n %lld)[%lld] = %.9g, rt_normal %.9g", (long long)first,
                   (long long)n, (long long)i, out[i], rt_normal(key, (uint64_t)(first + i)));
      assert_true(out[n] == 12345.0f);   // nothing written past n
    }
}

char *openblas_get_corename(void);

// The pool of n threads (rt_threads_setup as a program's start): OMP_NUM_THREADS n, and with
// whole each GEMM in one piece (OPENBLAS_NUM_THREADS=1), else in as many as threads.
static void use_threads(int n, bool whole) {
  char env[8];
  snprintf(env, sizeof env, "%d", n);
  setenv("OMP_NUM_THREADS", env, 1);
  if (whole) setenv("OPENBLAS_NUM_THREADS", "1", 1);
  else unsetenv("OPENBLAS_NUM_THREADS");
  rt_threads_setup(1);
}

// rt_matmul on 1, 2 and 3 threads gives the same bits, whatever the shape: tall, wide (where a
// split of c's columns rounded differently), transposed or not, accumulating, and whole GEMMs
// that OpenBLAS's OpenMP build once split by itself. Each GEMM is in as many pieces as threads
// on the OpenBLAS kernels whose rows are computed alike in any piece (runtime/kernels/ffn.c:
// Haswell's, which Zen runs, and Prescott's); on others (SkylakeX's choose kernels by the size
// of the call) each GEMM is whole (OPENBLAS_NUM_THREADS=1), on a pool of 1, 2 and 3 threads.
static void test_matmul_split(void **state) {
  static const struct { int m, n, k; } shapes[] = {
      {200, 300, 64}, {150, 700, 40}, {517, 96, 33}, {40, 256, 64}, {101, 1000, 20}, {1000, 12, 300},
  };
  const char *core = openblas_get_corename();
  bool split = core && (strcasecmp(core, "haswell") == 0 || strcasecmp(core, "zen") == 0 ||
                        strcasecmp(core, "prescott") == 0);
  printf("# OpenBLAS core %s: each GEMM %s\n", core ? core : "?", split ? "in as many pieces as threads" : "whole");
  for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
    int m = shapes[s].m, n = shapes[s].n, k = shapes[s].k;
    float *a = malloc((size_t)m * k * sizeof *a), *b = malloc((size_t)k * n * sizeof *b);
    float *c0 = malloc((size_t)m * n * sizeof *c0), *want = malloc((size_t)m * n * sizeof *want);
    float *got = malloc((size_t)m * n * sizeof *got);
    assert_non_null(a && b && c0 && want && got);
    fill(a, (int64_t)m * k, -1, 1);
    fill(b, (int64_t)k * n, -1, 1);
    fill(c0, (int64_t)m * n, -1, 1);
    for (int t = 0; t < 8; t++) {
      bool ta = t & 1, tb = t & 2, acc = t & 4;
      for (int threads = 1; threads <= 3; threads++) {
        use_threads(threads, !split);
        float *c = threads == 1 ? want : got;
        memcpy(c, c0, (size_t)m * n * sizeof *c);
        rt_matmul(a, b, c, m, n, k, ta, tb, acc);
        if (threads > 1 && memcmp(want, got, (size_t)m * n * sizeof *got) != 0)
          fail_msg("rt_matmul m %d n %d k %d ta %d tb %d accumulate %d: %d threads (%d pieces) differ from 1", m, n,
                   k, ta, tb, acc, rt_threads(), rt_gemm_pieces());
      }
    }
    free(a), free(b), free(c0), free(want), free(got);
  }
  use_threads(1, false);
}

// rt_expert_matmul at a size that runs in the pool (one region: row kinds, the GEMM calls handed
// out largest first, the rows outside the segments): every expert's rows as the slots leave them
// (full, live then zero, live then copies of one row, gaps, none), equal to a double reference
// and bit-identical on 1, 2 and 3 threads, both products a model takes (ta = 0 forward, ta = 1
// the weights' gradient).
static void test_expert_matmul_team(void **state) {
  enum { E = 4, S = 320, N = 192, K = 96 };
  for (int ta = 0; ta <= 1; ta++) {
    int m = ta ? K : S, k = ta ? S : K;   // ta = 1: a [S, K] and b [S, N] per expert, c [K, N]
    int acols = K, bsize = ta ? S * N : K * N;
    float *a = malloc((size_t)E * S * acols * sizeof *a), *b = malloc((size_t)E * bsize * sizeof *b);
    float *want = malloc((size_t)E * m * N * sizeof *want), *got = malloc((size_t)E * m * N * sizeof *got);
    assert_non_null(a && b && want && got);
    fill(a, (int64_t)E * S * acols, -1, 1);
    fill(b, (int64_t)E * bsize, -1, 1);
    for (int e = 0; e < E; e++)
      for (int r = 0; r < S; r++) {   // the slot rows of a
        float *row = a + ((size_t)e * S + r) * acols;
        bool zero = (e == 1 && r >= 200) || (e == 2 && r % 37 < 20) || e == 3;
        if (zero) memset(row, 0, acols * sizeof *row);
        if (!ta && e == 1 && r >= 150 && r < 200) memcpy(row, row - acols, acols * sizeof *row);   // act(b1) copies
      }
    for (int threads = 1; threads <= 3; threads++) {
      use_threads(threads, false);
      float *c = threads == 1 ? want : got;
      for (int64_t i = 0; i < (int64_t)E * m * N; i++) c[i] = NAN;   // every row written
      rt_expert_matmul(a, b, c, E, m, N, k, ta, false);
      if (threads > 1 && memcmp(want, got, (size_t)E * m * N * sizeof *got) != 0)
        fail_msg("rt_expert_matmul ta %d: %d threads differ from 1", ta, threads);
    }
    for (int e = 0; e < E; e++)
      for (int i = 0; i < m; i++)
        for (int j = 0; j < N; j++) {
          double ref = 0;
          for (int p = 0; p < k; p++) {
            double x = ta ? a[((size_t)e * S + p) * K + i] : a[((size_t)e * S + i) * K + p];
            double y = ta ? b[((size_t)e * S + p) * N + j] : b[(size_t)e * K * N + (size_t)p * N + j];
            ref += x * y;
          }
          float v = want[((size_t)e * m + i) * N + j];
          if (!(fabs(v - ref) <= 1e-4 * (1 + fabs(ref))))
            fail_msg("rt_expert_matmul ta %d expert %d c[%d,%d] = %g, want %g", ta, e, i, j, v, ref);
        }
    free(a), free(b), free(want), free(got);
  }
  use_threads(1, false);
}

// The GEMM epilogues (rt_matmul_rows, rt_expert_matmul_rows): the rows function sees each row of
// the product once and final (it writes y = 2c + 1 and counts the row; after the call y must equal
// 2c + 1 of the final c), on 1, 2 and 3 threads; a GEMM run in pieces says so (true), and the
// expert GEMM's rows outside the filled slots (zero rows, copies) go through it too.
static int rows_seen[4 * 320];
static void rows_twice_plus_one(const void *const *x, int64_t lo, int64_t hi) {
  const float *c = x[0];
  float *y = (float *)x[1];
  int n = (int)(intptr_t)x[2];
  for (int64_t r = lo; r < hi; r++) {
    rows_seen[r]++;
    for (int j = 0; j < n; j++) y[r * n + j] = 2 * c[r * n + j] + 1;
  }
}

static void check_rows(const char *what, int threads, bool ran, const float *c, const float *y, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    if (ran && rows_seen[r] != 1) fail_msg("%s, %d threads: row %d went through the epilogue %d times", what, threads, r, rows_seen[r]);
    for (int j = 0; ran && j < n; j++)
      if (y[r * n + j] != 2 * c[r * n + j] + 1) fail_msg("%s, %d threads: row %d was not final in the epilogue", what, threads, r);
  }
}

static void test_gemm_rows(void **state) {
  enum { E = 4, S = 320, N = 192, K = 96 };
  float *a = malloc((size_t)E * S * K * sizeof *a), *b = malloc((size_t)E * K * N * sizeof *b);
  float *c = malloc((size_t)E * S * N * sizeof *c), *y = malloc((size_t)E * S * N * sizeof *y);
  assert_non_null(a && b && c && y);
  fill(a, (int64_t)E * S * K, -1, 1);
  fill(b, (int64_t)E * K * N, -1, 1);
  for (int r = 0; r < S; r++) {   // expert 1: live rows, copies of one row, zero rows; expert 3 empty
    float *row = a + ((size_t)S + r) * K;
    if (r >= 200) memset(row, 0, K * sizeof *row);
    else if (r >= 150) memcpy(row, row - K, K * sizeof *row);
    memset(a + ((size_t)3 * S + r) * K, 0, K * sizeof *row);
  }
  for (int threads = 1; threads <= 3; threads++) {
    use_threads(threads, false);
    const void *args[] = {c, y, (void *)(intptr_t)N};
    memset(rows_seen, 0, sizeof rows_seen);
    bool ran = rt_matmul_rows(a, b, c, E * S, N, K, false, false, rows_twice_plus_one, args);
    if (rt_gemm_pieces() > 1 && !ran)   // (a build without OpenMP has one thread: every GEMM whole)
      fail_msg("rt_matmul_rows of [%d, %d] x [%d, %d] in %d pieces ran whole", E * S, K, K, N, rt_gemm_pieces());
    check_rows("rt_matmul_rows", threads, ran, c, y, E * S, N);
    memset(rows_seen, 0, sizeof rows_seen);
    for (int64_t i = 0; i < (int64_t)E * S * N; i++) c[i] = y[i] = NAN;
    ran = rt_expert_matmul_rows(a, b, c, E, S, N, K, false, rows_twice_plus_one, args);
    if (!ran) fail_msg("rt_expert_matmul_rows on %d threads did not run its epilogue", threads);
    check_rows("rt_expert_matmul_rows", threads, ran, c, y, E * S, N);
  }
  free(a), free(b), free(c), free(y);
  use_threads(1, false);
}

static void test_gate_noise_layout(void **state) {
  enum { S = 4, E = 3 };
  float x[S * E], y[S * E], y2[2 * E];
  fill(x, S * E, -1, 1);
  RtStep st = {.step = 3, .seed = 9, .token0 = 10};
  rt_gate_noise(x, y, S, E, 2.0f, 1, st.seed, st.step, st.token0);
  uint64_t key = rt_key(rt_key(rt_key(9, RT_STREAM_NOISE), 3), 1);
  for (int t = 0; t < S; t++)
    for (int j = 0; j < E; j++) {
      double want = x[t * E + j] + 2.0 * rt_normal(key, (uint64_t)(10 + t) * E + j) / E;
      assert_float_equal(y[t * E + j], want, 1e-6);
    }
  // A rank that starts two tokens later draws the same numbers for the same tokens.
  RtStep later = st;
  later.token0 = 12;
  rt_gate_noise(x + 2 * E, y2, 2, E, 2.0f, 1, later.seed, later.step, later.token0);
  assert_memory_equal(y2, y + 2 * E, sizeof y2);
  // sigma 0: a copy.
  rt_gate_noise(x, y, S, E, 0.0f, 1, st.seed, st.step, st.token0);
  assert_memory_equal(y, x, sizeof y);
}

static void test_step_begin_forward(void **state) {
  RtStep st = {.mse = 1, .aux_total = 2, .aux = 3, .z = 4, .dropped = 5, .routed = 6,
               .route_hash = 7, .step = 8};
  rt_step_begin_forward(&st);
  assert_true(st.mse == 0 && st.aux_total == 0 && st.aux == 0 && st.z == 0);
  assert_true(st.dropped == 0 && st.routed == 0 && st.route_hash == 0);
  assert_int_equal(st.step, 8);
}

// rt_layout_chunk with any chunk count r <= rows: chunk j holds slots [j*rows/r, (j+1)*rows/r)
// (floor division) of every block, sizes from a hand-written table for rows 5; the bytes past the
// chunk stay untouched, and rt_layout_concat of chunks 0..r-1 in order (runs of different
// sizes) gives x back exactly.
static void test_layout_chunk_uneven(void **state) {
  (void)state;
  enum { OUTER = 2, BLOCKS = 3, ROWS = 5, INNER = 2, N = OUTER * BLOCKS * ROWS * INNER };
  static const int sizes[ROWS + 1][ROWS] = {
      {0}, {5}, {2, 3}, {1, 2, 2}, {1, 1, 1, 2}, {1, 1, 1, 1, 1},
  };
  float x[N], piece[N + 8], acc[N], cat[N];
  for (int i = 0; i < N; i++)
    x[i] = (float)i;
  for (int r = 1; r <= ROWS; r++) {
    int acc_rows = 0;
    for (int j = 0; j < r; j++) {
      int c = sizes[r][j], n = OUTER * BLOCKS * c * INNER;
      for (int i = 0; i < N + 8; i++)
        piece[i] = -1.0f;
      rt_layout_chunk(x, piece, OUTER, BLOCKS, ROWS, INNER * (int64_t)sizeof(float), r, j);
      for (int o = 0; o < OUTER * BLOCKS; o++)
        for (int s = 0; s < c; s++)
          for (int k = 0; k < INNER; k++)
            assert_float_equal(piece[(o * c + s) * INNER + k], x[(o * ROWS + acc_rows + s) * INNER + k], 0);
      for (int i = n; i < N + 8; i++)
        assert_float_equal(piece[i], -1.0f, 0);
      if (j == 0) {
        memcpy(acc, piece, (size_t)n * sizeof *acc);
      } else {
        rt_layout_concat(acc, piece, cat, OUTER, BLOCKS, acc_rows, c, INNER * (int64_t)sizeof(float));
        memcpy(acc, cat, (size_t)OUTER * BLOCKS * (acc_rows + c) * INNER * sizeof *acc);
      }
      acc_rows += c;
    }
    assert_int_equal(acc_rows, ROWS);
    assert_memory_equal(acc, x, sizeof x);
  }
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_fd_softmax),
      cmocka_unit_test(test_fd_gate_gather),
      cmocka_unit_test(test_fd_aux_loss),
      cmocka_unit_test(test_fd_z_loss),
      cmocka_unit_test(test_fd_gelu),
      cmocka_unit_test(test_fd_relu),
      cmocka_unit_test(test_fd_relu2),
      cmocka_unit_test(test_fd_bias),
      cmocka_unit_test(test_fd_matmul),
      cmocka_unit_test(test_fd_expert_matmul),
      cmocka_unit_test(test_fd_order_encode),
      cmocka_unit_test(test_fd_order_decode),
      cmocka_unit_test(test_fd_mse),
      cmocka_unit_test(test_fd_gate_noise),
      cmocka_unit_test(test_matmul_values),
      cmocka_unit_test(test_bias_grad_wide),
      cmocka_unit_test(test_activation_values),
      cmocka_unit_test(test_softmax_values),
      cmocka_unit_test(test_topk_ties),
      cmocka_unit_test(test_gate_gather_values),
      cmocka_unit_test(test_gate_locations),
      cmocka_unit_test(test_order_round_trip),
      cmocka_unit_test(test_loss_values),
      cmocka_unit_test(test_optimizers),
      cmocka_unit_test(test_rng_constants),
      cmocka_unit_test(test_normal_moments),
      cmocka_unit_test(test_normal_fill),
      cmocka_unit_test(test_matmul_split),
      cmocka_unit_test(test_expert_matmul_team),
      cmocka_unit_test(test_gemm_rows),
      cmocka_unit_test(test_exp_poly),
      cmocka_unit_test(test_gate_noise_layout),
      cmocka_unit_test(test_step_begin_forward),
      cmocka_unit_test(test_layout_chunk_uneven),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
