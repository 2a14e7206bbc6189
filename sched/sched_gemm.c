// GEMM times by shape: the profile's `gemm_at` grid (moec tune measures it, cli/tune.c),
// interpolated. A CPU or GPU GEMM's speed per multiply-accumulate depends on its shape: narrow
// ones (few rows, as a pipeline's chunks make them, or a small k or n) run several times slower per
// multiply-accumulate than wide ones, so one line t = alpha + beta·m·k·n fitted at one shape
// misprices the others (manual §10, "GEMMs by shape").
#include <math.h>

#include "sched/sched.h"

enum { AXIS_MAX = 32 };

typedef struct Axis {
  double v[AXIS_MAX];   // distinct values, ascending
  int n;
} Axis;

static void axis_add(Axis *a, double x) {
  int i = 0;
  while (i < a->n && a->v[i] < x) i++;
  if (i < a->n && a->v[i] == x) return;
  if (a->n == AXIS_MAX) return;
  for (int j = a->n; j > i; j--) a->v[j] = a->v[j - 1];
  a->v[i] = x;
  a->n++;
}

// The bracketing indices of x on the axis and the weight of the upper one, in log space,
// clamped to the ends.
static void axis_at(const Axis *a, double x, int *lo, int *hi, double *w) {
  *lo = *hi = 0;
  *w = 0;
  if (a->n <= 1 || x <= a->v[0]) return;
  if (x >= a->v[a->n - 1]) {
    *lo = *hi = a->n - 1;
    return;
  }
  int i = 0;
  while (a->v[i + 1] < x) i++;
  *lo = i, *hi = i + 1;
  *w = (log(x) - log(a->v[i])) / (log(a->v[i + 1]) - log(a->v[i]));
}

// log(ms per multiply-accumulate) at the grid point (m, k, n): its own measurement, else (a shape
// the sweep left out as too large) the one with the most rows measured at that k and n, else the
// nearest measured point (in log space).
static double log_eff(const SchedCluster *c, double m, double k, double n) {
  int best = -1, near = -1;
  double best_m = 0, near_d = INFINITY;
  for (int i = 0; i < c->ngemm_at; i++) {
    const SchedGemmAt *g = &c->gemm_at[i];
    if (g->m == m && g->k == k && g->n == n) return log(g->ms / (g->m * g->k * g->n));
    if (g->k == k && g->n == n && g->m > best_m) best = i, best_m = g->m;
    double d = fabs(log(g->m / m)) + fabs(log(g->k / k)) + fabs(log(g->n / n));
    if (d < near_d) near = i, near_d = d;
  }
  const SchedGemmAt *g = &c->gemm_at[best >= 0 ? best : near];
  return log(g->ms / (g->m * g->k * g->n));
}

double sched_gemm_ms(const SchedCluster *c, double m, double k, double n) {
  double macs = m * k * n;
  if (c->ngemm_at <= 0) return c->gemm.alpha + c->gemm.beta * macs;
  Axis am = {0}, ak = {0}, an = {0};
  for (int i = 0; i < c->ngemm_at; i++) {
    axis_add(&am, c->gemm_at[i].m);
    axis_add(&ak, c->gemm_at[i].k);
    axis_add(&an, c->gemm_at[i].n);
  }
  int m0, m1, k0, k1, n0, n1;
  double wm, wk, wn;
  axis_at(&am, m, &m0, &m1, &wm);
  axis_at(&ak, k, &k0, &k1, &wk);
  axis_at(&an, n, &n0, &n1, &wn);
  double e = 0;
  for (int corner = 0; corner < 8; corner++) {
    int im = corner & 1 ? m1 : m0, ik = corner & 2 ? k1 : k0, in = corner & 4 ? n1 : n0;
    double w = (corner & 1 ? wm : 1 - wm) * (corner & 2 ? wk : 1 - wk) * (corner & 4 ? wn : 1 - wn);
    if (w > 0) e += w * log_eff(c, am.v[im], ak.v[ik], an.v[in]);
  }
  return exp(e) * macs;
}

SchedCoef sched_gemm_chunks(const SchedCluster *c, double count, double m, double k, double n) {
  if (c->ngemm_at <= 0 || m <= 0) return (SchedCoef){c->gemm.alpha * count, c->gemm.beta};
  double r = m >= 4 ? 4 : m;   // chunks of at least one row
  double x1 = count * m * k * n, x4 = x1 / r;
  double t1 = count * sched_gemm_ms(c, m, k, n), t4 = count * sched_gemm_ms(c, m / r, k, n);
  if (r <= 1 || x1 <= x4) return (SchedCoef){0, t1 / x1};
  double beta = (t1 - t4) / (x1 - x4), alpha = t1 - beta * x1;
  if (beta < 0 || alpha < 0) alpha = 0, beta = t1 / x1;   // narrow chunks no slower: by size alone
  return (SchedCoef){alpha, beta};
}
