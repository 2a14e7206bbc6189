// gate_order: the gate and the order of one MoE layer, done the sparse way (`order tutel`:
// index-based encode/decode kernels) against the dense way (`order gshard`: a one-hot dispatch
// mask and combine weights [S, E*C] and GEMMs), forward and backward, for each gate routing.
//
// Both ways run the same gate (logits x·Wg, softmax / sigmoid / xmoe's cosine router, top-k,
// gather, locations; expert choice: softmax over tokens and rt_expert_choice) and its backward;
// only the order differs:
//   sparse fwd  rt_order_encode, rt_order_decode
//   sparse bwd  rt_order_encode_grad, rt_order_decode_grad_y, rt_order_decode_grad_gates
//   dense fwd   rt_dispatch_mask, rt_combine_weights, disp = mask^T x, out = cw y
//   dense bwd   dx = mask ddisp, dy = cw^T dout, dcw = dout y^T, rt_combine_weights_grad
// The experts themselves are left out (the same in both): y and ddisp are fixed random tensors
// standing in for the expert outputs and the gradient coming back from the experts. Before any
// timing, the two ways' outputs and gradients are compared (max |a - b| / max |b| <= 1e-4).
//
// Reported: the median of 5 runs after 1 warm-up, in milliseconds, and speedup = dense total /
// sparse total. OK when the sparse way wins for every gate, else FAILED (exit 1). GEMMs use
// OpenBLAS's threads (OPENBLAS_NUM_THREADS), the index kernels one thread.
//
// Build and run from the repository root, after `make` (which builds build/libmoert.a); the
// cc command is one line:
//   mkdir -p build/bench
//   cc -O2 -std=c11 -D_GNU_SOURCE -Iruntime -I/usr/include/x86_64-linux-gnu/openblas-pthread
//      bench/gate_order.c build/libmoert.a -lopenblas -lcjson -lm -o build/bench/gate_order
//   build/bench/gate_order [--tokens S] [--model M] [--experts E] [--runs N]
// (defaults S = 8192, M = 1024, E = 16, 5 runs; capacity factor 1.25).
#include <cblas.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "moert.h"

#define CAPACITY_FACTOR 1.25
#define MAX_REL_ERR 1e-4
#define XMOE_PROJ 16   // xmoe's low-rank routing dimension (`proj 16`)

typedef enum GateKind { GATE_GSHARD, GATE_SIGMOID, GATE_XMOE, GATE_EXPERT_CHOICE } GateKind;

typedef struct GateSpec {
  const char *name;
  GateKind kind;
  int k;   // choices per token; expert choice: 0 (every token has E choices, idx = iota)
} GateSpec;

static const GateSpec gate_specs[] = {
    {"gshard k=1", GATE_GSHARD, 1},
    {"gshard k=2", GATE_GSHARD, 2},
    {"sigmoid k=1", GATE_SIGMOID, 1},
    {"xmoe k=1", GATE_XMOE, 1},
    {"expert_choice", GATE_EXPERT_CHOICE, 0},
};

// Every buffer of one configuration. kc = choices per token, c = capacity per expert.
typedef struct Bench {
  const GateSpec *gate;
  int s, m, e, kc, c, d;
  // gate
  float *x, *wg, *logits, *scores, *gates;
  int32_t *idx, *loc;
  float *wp, *emb, *temp, *h, *hn, *en, *cosine;   // xmoe
  float *dgates, *dscores, *dlogits, *dwg, *dx_gate;
  float *dcos, *dhn, *den, *dh, *demb, *dwp, *dtemp;   // xmoe
  // order
  float *y, *ddisp, *dout;                 // fixed stand-ins for the experts
  float *disp, *out, *dx_order, *dy;       // results
  float *mask, *cw, *dcw;                  // dense only
} Bench;

static void *xcalloc(size_t n, size_t size) {
  void *p = calloc(n ? n : 1, size);
  if (!p) {
    fprintf(stderr, "gate_order: out of memory (%zu x %zu bytes)\n", n, size);
    exit(1);
  }
  return p;
}

static uint64_t rand_state = 2024;

static void fill(float *x, size_t n, float scale) {
  for (size_t i = 0; i < n; i++) {
    uint64_t z = rt_mix(rand_state++);
    x[i] = scale * (float)(2.0 * rt_uniform(z) - 1.0);
  }
}

static void bench_create(Bench *b, const GateSpec *gate, int s, int m, int e) {
  *b = (Bench){.gate = gate, .s = s, .m = m, .e = e, .d = XMOE_PROJ};
  int k = gate->kind == GATE_EXPERT_CHOICE ? 1 : gate->k;
  b->kc = gate->kind == GATE_EXPERT_CHOICE ? e : gate->k;
  b->c = (int)ceil(k * CAPACITY_FACTOR * s / e);
  size_t se = (size_t)s * e, sm = (size_t)s * m, skc = (size_t)s * b->kc;
  size_t rows = (size_t)e * b->c, rm = rows * m, sr = (size_t)s * rows;
  b->x = xcalloc(sm, sizeof(float));
  b->wg = xcalloc((size_t)m * e, sizeof(float));
  b->logits = xcalloc(se, sizeof(float));
  b->scores = xcalloc(se, sizeof(float));
  b->gates = xcalloc(skc, sizeof(float));
  b->idx = xcalloc(skc, sizeof(int32_t));
  b->loc = xcalloc(skc, sizeof(int32_t));
  b->dgates = xcalloc(skc, sizeof(float));
  b->dscores = xcalloc(se, sizeof(float));
  b->dlogits = xcalloc(se, sizeof(float));
  b->dwg = xcalloc((size_t)m * e, sizeof(float));
  b->dx_gate = xcalloc(sm, sizeof(float));
  if (gate->kind == GATE_XMOE) {
    size_t sd = (size_t)s * b->d, ed = (size_t)e * b->d;
    b->wp = xcalloc((size_t)m * b->d, sizeof(float));
    b->emb = xcalloc(ed, sizeof(float));
    b->temp = xcalloc(1, sizeof(float));
    b->h = xcalloc(sd, sizeof(float));
    b->hn = xcalloc(sd, sizeof(float));
    b->en = xcalloc(ed, sizeof(float));
    b->cosine = xcalloc(se, sizeof(float));
    b->dcos = xcalloc(se, sizeof(float));
    b->dhn = xcalloc(sd, sizeof(float));
    b->den = xcalloc(ed, sizeof(float));
    b->dh = xcalloc(sd, sizeof(float));
    b->demb = xcalloc(ed, sizeof(float));
    b->dwp = xcalloc((size_t)m * b->d, sizeof(float));
    b->dtemp = xcalloc(1, sizeof(float));
    fill(b->wp, (size_t)m * b->d, 1.0f / sqrtf((float)m));
    fill(b->emb, ed, 1.0f);
    b->temp[0] = 0.07f;
  }
  b->y = xcalloc(rm, sizeof(float));
  b->ddisp = xcalloc(rm, sizeof(float));
  b->dout = xcalloc(sm, sizeof(float));
  b->disp = xcalloc(rm, sizeof(float));
  b->out = xcalloc(sm, sizeof(float));
  b->dx_order = xcalloc(sm, sizeof(float));
  b->dy = xcalloc(rm, sizeof(float));
  b->mask = xcalloc(sr, sizeof(float));
  b->cw = xcalloc(sr, sizeof(float));
  b->dcw = xcalloc(sr, sizeof(float));
  fill(b->x, sm, 1.0f);
  fill(b->wg, (size_t)m * e, 1.0f / sqrtf((float)m));
  fill(b->y, rm, 1.0f);
  fill(b->ddisp, rm, 1.0f);
  fill(b->dout, sm, 1.0f);
}

static void bench_destroy(Bench *b) {
  float *floats[] = {b->x, b->wg, b->logits, b->scores, b->gates, b->dgates, b->dscores,
                     b->dlogits, b->dwg, b->dx_gate, b->wp, b->emb, b->temp, b->h, b->hn, b->en,
                     b->cosine, b->dcos, b->dhn, b->den, b->dh, b->demb, b->dwp, b->dtemp, b->y,
                     b->ddisp, b->dout, b->disp, b->out, b->dx_order, b->dy, b->mask, b->cw,
                     b->dcw};
  for (size_t i = 0; i < sizeof floats / sizeof *floats; i++)
    free(floats[i]);
  free(b->idx);
  free(b->loc);
}

// ---- the gate, forward and backward (the same for both orders) ----

static void gate_forward(Bench *b, RtStep *st) {
  int s = b->s, m = b->m, e = b->e, k = b->kc;
  switch (b->gate->kind) {
  case GATE_GSHARD:
  case GATE_SIGMOID:
    rt_matmul(b->x, b->wg, b->logits, s, e, m, false, false, false);
    if (b->gate->kind == GATE_GSHARD)
      rt_softmax(b->logits, b->scores, s, e);
    else
      rt_sigmoid(b->logits, b->scores, (int64_t)s * e);
    rt_topk(b->scores, b->idx, s, e, k, 1, 1, 0);
    rt_gate_gather(b->scores, b->idx, b->gates, s, e, k, b->gate->kind == GATE_GSHARD && k > 1, 1.0f);
    rt_gate_locations(b->idx, b->loc, st, s, k, e, 1, b->c);
    break;
  case GATE_XMOE:
    // cosine(l2norm(x Wp), l2norm(emb)) / temperature, then as gshard.
    rt_matmul(b->x, b->wp, b->h, s, b->d, m, false, false, false);
    rt_l2norm(b->h, b->hn, s, b->d);
    rt_l2norm(b->emb, b->en, e, b->d);
    rt_matmul(b->hn, b->en, b->cosine, s, e, b->d, false, true, false);
    rt_div_scalar(b->cosine, b->temp, b->logits, (int64_t)s * e);
    rt_softmax(b->logits, b->scores, s, e);
    rt_topk(b->scores, b->idx, s, e, k, 1, 1, 0);
    rt_gate_gather(b->scores, b->idx, b->gates, s, e, k, k > 1, 1.0f);
    rt_gate_locations(b->idx, b->loc, st, s, k, e, 1, b->c);
    break;
  case GATE_EXPERT_CHOICE:
    rt_matmul(b->x, b->wg, b->logits, s, e, m, false, false, false);
    rt_softmax_tokens(b->logits, b->scores, s, e, 1);
    rt_iota(b->idx, s, e);
    (rt_expert_choice(b->scores, b->loc, s, e, 1, b->c), rt_expert_choice_stats(st, b->loc, s, e, 1, b->c));
    rt_gate_gather(b->scores, b->idx, b->gates, s, e, e, false, 1.0f);
    break;
  }
}

// From b->dgates (filled by the order's backward) to the gate's parameter and input gradients.
static void gate_backward(Bench *b) {
  int s = b->s, m = b->m, e = b->e, k = b->kc;
  bool renorm = b->gate->kind != GATE_SIGMOID && b->gate->kind != GATE_EXPERT_CHOICE && k > 1;
  rt_gate_gather_grad(b->dgates, b->scores, b->idx, b->dscores, s, e, k, renorm, 1.0f);
  switch (b->gate->kind) {
  case GATE_GSHARD: rt_softmax_grad(b->dscores, b->scores, b->dlogits, s, e); break;
  case GATE_SIGMOID: rt_sigmoid_grad(b->dscores, b->scores, b->dlogits, (int64_t)s * e); break;
  case GATE_EXPERT_CHOICE:
    rt_softmax_tokens_grad(b->dscores, b->scores, b->dlogits, s, e, 1);
    break;
  case GATE_XMOE:
    rt_softmax_grad(b->dscores, b->scores, b->dlogits, s, e);
    rt_div_scalar_grad_x(b->dlogits, b->temp, b->dcos, (int64_t)s * e);
    rt_div_scalar_grad_s(b->dlogits, b->cosine, b->temp, b->dtemp, (int64_t)s * e);
    rt_matmul(b->dcos, b->en, b->dhn, s, b->d, e, false, false, false);
    rt_matmul(b->dcos, b->hn, b->den, e, b->d, s, true, false, false);
    rt_l2norm_grad(b->dhn, b->h, b->dh, s, b->d);
    rt_l2norm_grad(b->den, b->emb, b->demb, e, b->d);
    rt_matmul(b->x, b->dh, b->dwp, m, b->d, s, true, false, false);
    rt_matmul(b->dh, b->wp, b->dx_gate, s, m, b->d, false, true, false);
    return;
  }
  rt_matmul(b->x, b->dlogits, b->dwg, m, e, s, true, false, false);
  rt_matmul(b->dlogits, b->wg, b->dx_gate, s, m, e, false, true, false);
}

// ---- the order, both ways ----

static void sparse_forward(Bench *b) {
  rt_zero(b->disp, (int64_t)b->e * b->c * b->m);
  rt_order_encode(b->x, b->idx, b->loc, b->disp, b->s, b->m, b->kc, b->e, 1, b->c);
  rt_order_decode(b->y, b->idx, b->loc, b->gates, b->out, b->s, b->m, b->kc, b->e, 1, b->c);
}

static void sparse_backward(Bench *b) {
  rt_order_encode_grad(b->ddisp, b->idx, b->loc, b->dx_order, b->s, b->m, b->kc, b->e, 1, b->c);
  rt_zero(b->dy, (int64_t)b->e * b->c * b->m);
  rt_order_decode_grad_y(b->dout, b->idx, b->loc, b->gates, b->dy, b->s, b->m, b->kc, b->e, 1,
                         b->c);
  rt_order_decode_grad_gates(b->dout, b->y, b->idx, b->loc, b->dgates, b->s, b->m, b->kc, b->e,
                             1, b->c);
}

static void dense_forward(Bench *b) {
  int rows = b->e * b->c;
  rt_dispatch_mask(b->idx, b->loc, b->mask, b->s, b->kc, b->e, 1, b->c);
  rt_combine_weights(b->idx, b->loc, b->gates, b->cw, b->s, b->kc, b->e, 1, b->c);
  rt_matmul(b->mask, b->x, b->disp, rows, b->m, b->s, true, false, false);
  rt_matmul(b->cw, b->y, b->out, b->s, b->m, rows, false, false, false);
}

static void dense_backward(Bench *b) {
  int rows = b->e * b->c;
  rt_matmul(b->mask, b->ddisp, b->dx_order, b->s, b->m, rows, false, false, false);
  rt_matmul(b->cw, b->dout, b->dy, rows, b->m, b->s, true, false, false);
  rt_matmul(b->dout, b->y, b->dcw, b->s, rows, b->m, false, true, false);
  rt_combine_weights_grad(b->dcw, b->idx, b->loc, b->dgates, b->s, b->kc, b->e, 1, b->c);
}

// ---- one run ----

static double now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1e3 + ts.tv_nsec * 1e-6;
}

// Forward and backward of gate + order; the times of the two halves in ms.
static void run_once(Bench *b, bool dense, double *fwd_ms, double *bwd_ms, RtStep *st) {
  double t0 = now_ms();
  gate_forward(b, st);
  if (dense)
    dense_forward(b);
  else
    sparse_forward(b);
  double t1 = now_ms();
  if (dense)
    dense_backward(b);
  else
    sparse_backward(b);
  gate_backward(b);
  double t2 = now_ms();
  *fwd_ms = t1 - t0;
  *bwd_ms = t2 - t1;
}

// ---- agreement of the two ways ----

typedef struct Saved {
  const char *name;
  float **field;   // the buffer in Bench
  size_t n;
  float *copy;
} Saved;

static double rel_err(const float *a, const float *b, size_t n) {
  double diff = 0.0, scale = 0.0;
  for (size_t i = 0; i < n; i++) {
    diff = fmax(diff, fabs((double)a[i] - b[i]));
    scale = fmax(scale, fabs((double)b[i]));
  }
  return scale > 0.0 ? diff / scale : diff;
}

// Runs both ways once and compares every result; prints the worst and returns whether it is
// within MAX_REL_ERR.
static bool verify(Bench *b, double *worst) {
  size_t rows = (size_t)b->e * b->c;
  size_t sm = (size_t)b->s * b->m, param = b->gate->kind == GATE_XMOE ? (size_t)b->m * b->d
                                                                       : (size_t)b->m * b->e;
  Saved saved[] = {
      {"dispatch", &b->disp, rows * b->m, NULL},
      {"combined", &b->out, sm, NULL},
      {"dx (order)", &b->dx_order, sm, NULL},
      {"dy", &b->dy, rows * b->m, NULL},
      {"dgates", &b->dgates, (size_t)b->s * b->kc, NULL},
      {"dx (gate)", &b->dx_gate, sm, NULL},
      {"dW (gate)", b->gate->kind == GATE_XMOE ? &b->dwp : &b->dwg, param, NULL},
  };
  enum { NSAVED = sizeof saved / sizeof *saved };
  double fwd, bwd;
  run_once(b, false, &fwd, &bwd, NULL);
  for (int i = 0; i < NSAVED; i++) {
    saved[i].copy = xcalloc(saved[i].n, sizeof(float));
    memcpy(saved[i].copy, *saved[i].field, saved[i].n * sizeof(float));
  }
  run_once(b, true, &fwd, &bwd, NULL);
  *worst = 0.0;
  const char *worst_name = "";
  for (int i = 0; i < NSAVED; i++) {
    double err = rel_err(*saved[i].field, saved[i].copy, saved[i].n);
    if (err > *worst || isnan(err)) {
      *worst = err;
      worst_name = saved[i].name;
    }
    free(saved[i].copy);
  }
  bool ok = *worst <= MAX_REL_ERR;
  if (!ok)
    printf("# %s: dense and sparse disagree on %s: max rel err %.3e > %.0e\n", b->gate->name,
           worst_name, *worst, MAX_REL_ERR);
  return ok;
}

static int compare_double(const void *pa, const void *pb) {
  double a = *(const double *)pa, b = *(const double *)pb;
  return (a > b) - (a < b);
}

static double median(double *v, int n) {
  qsort(v, (size_t)n, sizeof *v, compare_double);
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Medians of `runs` runs after one warm-up.
static void time_way(Bench *b, bool dense, int runs, double *fwd_ms, double *bwd_ms,
                     RtStep *stats) {
  double *fwd = xcalloc((size_t)runs, sizeof *fwd), *bwd = xcalloc((size_t)runs, sizeof *bwd);
  double f, w;
  run_once(b, dense, &f, &w, NULL);
  for (int r = 0; r < runs; r++) {
    rt_step_begin_forward(stats);
    run_once(b, dense, &fwd[r], &bwd[r], stats);
  }
  *fwd_ms = median(fwd, runs);
  *bwd_ms = median(bwd, runs);
  free(fwd);
  free(bwd);
}

// ---- command line ----

static int parse_int(const char *flag, const char *value, int lo) {
  char *end;
  long v = value ? strtol(value, &end, 10) : 0;
  if (!value || *end || end == value || v < lo || v > 1 << 24) {
    fprintf(stderr, "gate_order: %s needs a whole number >= %d\n", flag, lo);
    exit(2);
  }
  return (int)v;
}

int main(int argc, char **argv) {
  int s = 8192, m = 1024, e = 16, runs = 5;
  static const char *const flags[] = {"--tokens", "--model", "--experts", "--runs"};
  int *slots[] = {&s, &m, &e, &runs};
  const int least[] = {1, 1, 2, 1};
  for (int i = 1; i < argc; i += 2) {
    int which = -1;
    for (int f = 0; f < 4; f++)
      if (strcmp(argv[i], flags[f]) == 0)
        which = f;
    if (which < 0) {
      fprintf(stderr, "usage: %s [--tokens S] [--model M] [--experts E] [--runs N]\n", argv[0]);
      return 2;
    }
    *slots[which] = parse_int(argv[i], i + 1 < argc ? argv[i + 1] : NULL, least[which]);
  }
  printf("# gate_order: gate + order forward/backward, sparse (tutel: index encode/decode) vs "
         "dense (gshard: dispatch mask, combine weights, GEMMs); experts excluded\n");
  printf("# S %d tokens, M %d, E %d experts, capacity factor %.2f (C = ceil(k*%.2f*S/E); "
         "expert_choice k = 1), one routing group\n", s, m, e, CAPACITY_FACTOR, CAPACITY_FACTOR);
  printf("# threads: OpenBLAS %d (GEMMs), index kernels 1; median of %d runs after 1 warm-up, "
         "ms\n", openblas_get_num_threads(), runs);
  printf("# check before timing: max |dense - sparse| / max |sparse| <= %.0e for dispatch, "
         "combined, dx, dy, dgates and the gate's dx, dW\n", MAX_REL_ERR);
  printf("%-14s %6s %9s %12s %12s %12s %12s %9s %8s %9s\n", "gate", "C", "dense MB",
         "sparse fwd", "sparse bwd", "dense fwd", "dense bwd", "speedup", "dropped", "rel err");
  bool ok = true;
  for (size_t g = 0; g < sizeof gate_specs / sizeof *gate_specs; g++) {
    Bench b;
    bench_create(&b, &gate_specs[g], s, m, e);
    double dense_mb = 3.0 * s * (double)e * b.c * sizeof(float) / 1e6;   // mask, cw, dcw
    double err;
    bool agree = verify(&b, &err);
    double sf, sb, df, db;
    RtStep stats = {0};
    time_way(&b, false, runs, &sf, &sb, &stats);
    double dropped = stats.routed ? (double)stats.dropped / stats.routed : 0.0;
    time_way(&b, true, runs, &df, &db, &stats);
    double speedup = (df + db) / (sf + sb);
    printf("%-14s %6d %9.0f %12.3f %12.3f %12.3f %12.3f %8.1fx %8.4f %9.1e\n", b.gate->name, b.c,
           dense_mb, sf, sb, df, db, speedup, dropped, err);
    fflush(stdout);
    if (!agree || !(speedup > 1.0))
      ok = false;
    bench_destroy(&b);
  }
  printf("%s\n", ok ? "OK" : "FAILED");
  return ok ? 0 : 1;
}
