// Unit tests of the least-squares line of sched/fit.c (the fit behind `moec tune`):
//  - exact synthetic points on the paper's size grids (GEMM 2^19..12*2^19, communication
//    2^18..24*2^18) give back alpha and beta to 1e-12 relative, and r^2 = 1 (to 1e-12);
//  - a negative coefficient comes back as fitted (clamping is the writer's business);
//  - seeded Gaussian noise: r^2 in (0.9, 1), alpha and beta close to the truth;
//  - degenerate inputs (no point, one point, all sizes equal, a NaN) fail with a sentence and
//    leave zeros, never NaN;
//  - the relative fit (tune's GEMMs): exact points come back; with one large outlier the small
//    sizes still fit to their own relative error, where the plain fit's intercept goes negative;
//    an intercept that stays negative falls back to a line through the origin; a time <= 0 fails;
//  - the anchored fit (tune's collectives): alpha is the given measurement, beta the slope of the
//    points from x_from on, never negative; no such point fails.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "sched/fit.h"

static void assert_rel(double got, double want, double tol, const char *what) {
  double err = fabs(got - want) / (want != 0 ? fabs(want) : 1.0);
  if (!(err <= tol)) fail_msg("%s: got %.17g, want %.17g (relative error %.3g > %.3g)", what, got, want, err, tol);
}

// Points n = k * unit, k = 1..count, t = alpha + beta * n, exactly as a double computes it.
static int grid(double unit, int count, double alpha, double beta, double *x, double *y) {
  for (int k = 1; k <= count; k++) {
    x[k - 1] = k * unit;
    y[k - 1] = alpha + beta * x[k - 1];
  }
  return count;
}

static void test_exact_points(void **state) {
  // The paper's coefficients (lang/manual.md §10) and a few of other magnitudes.
  static const struct { double unit; int count; double alpha, beta; } cases[] = {
    {524288, 12, 4.26e-2, 2.29e-11},    // Testbed-A gemm
    {524288, 12, 9.24e-2, 4.42e-11},    // Testbed-B gemm
    {262144, 24, 2.87e-1, 2.21e-7},     // Testbed-A alltoall
    {262144, 24, 5.11e-1, 4.95e-6},     // Testbed-A allreduce
    {262144, 24, 3.20e-2, 1.68e-7},     // Testbed-B allgather
    {262144, 4, 1.5, 3e-6},             // a --quick grid
    {1, 2, 7.0, 0.25},                  // two points
    {1000, 10, 10.0, 1e-5},             // intercept dominates (100 x the slope term)
  };
  double x[32], y[32];
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    int n = grid(cases[c].unit, cases[c].count, cases[c].alpha, cases[c].beta, x, y);
    FitLine f;
    char err[256] = "";
    assert_true(fit_line(x, y, n, &f, err, sizeof err));
    assert_rel(f.alpha, cases[c].alpha, 1e-12, "alpha");
    assert_rel(f.beta, cases[c].beta, 1e-12, "beta");
    assert_rel(f.r2, 1.0, 1e-12, "r2");
    assert_int_equal(f.points, n);
  }
}

static void test_zero_and_negative_coefficients(void **state) {
  double x[24], y[24];
  FitLine f;
  // alpha = 0: its error is judged against the largest time.
  int n = grid(262144, 24, 0.0, 2e-7, x, y);
  assert_true(fit_line(x, y, n, &f, NULL, 0));
  assert_true(fabs(f.alpha) <= 1e-12 * y[n - 1]);
  assert_rel(f.beta, 2e-7, 1e-12, "beta");
  // A negative intercept is returned as fitted, not clamped.
  n = grid(524288, 12, -0.01, 3e-11, x, y);
  assert_true(fit_line(x, y, n, &f, NULL, 0));
  assert_rel(f.alpha, -0.01, 1e-12, "negative alpha");
  assert_rel(f.beta, 3e-11, 1e-12, "beta");
  // Constant times: slope 0, r^2 defined as 1 (the line is exact).
  for (int i = 0; i < 5; i++) x[i] = i + 1, y[i] = 0.5;
  assert_true(fit_line(x, y, 5, &f, NULL, 0));
  assert_rel(f.alpha, 0.5, 1e-12, "constant alpha");
  assert_true(fabs(f.beta) <= 1e-15);
  assert_true(f.r2 == 1.0);
}

// xorshift64* and Box-Muller: the same noise on every machine.
static uint64_t rng_state;
static double uniform01(void) {
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return ((rng_state * 2685821657736338717ull) >> 11) * 0x1.0p-53 + 0x1.0p-54;
}
static double normal01(void) {
  double u1 = uniform01(), u2 = uniform01();
  return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

static void test_noisy_points(void **state) {
  // Testbed-A alltoall over the paper's 24 communication sizes, 1 % noise of the largest time.
  const double alpha = 2.87e-1, beta = 2.21e-7;
  double x[24], y[24];
  int n = grid(262144, 24, alpha, beta, x, y);
  for (uint64_t seed = 1; seed <= 20; seed++) {
    rng_state = 0x9e3779b97f4a7c15ull * seed;
    double sigma = 0.01 * y[n - 1];
    double noisy[24];
    for (int i = 0; i < n; i++) noisy[i] = y[i] + sigma * normal01();
    FitLine f;
    assert_true(fit_line(x, noisy, n, &f, NULL, 0));
    if (!(f.r2 > 0.9 && f.r2 < 1.0)) fail_msg("seed %llu: r2 %.9f not in (0.9, 1)", (unsigned long long)seed, f.r2);
    // Standard errors here: alpha ~ 0.4 sigma, beta ~ 0.03 sigma / 2^18; allow about 4 of them.
    if (fabs(f.alpha - alpha) > 2 * sigma) fail_msg("seed %llu: alpha %g far from %g", (unsigned long long)seed, f.alpha, alpha);
    if (fabs(f.beta - beta) > 0.05 * beta) fail_msg("seed %llu: beta %g far from %g", (unsigned long long)seed, f.beta, beta);
  }
}

static void assert_fails(const double *x, const double *y, int n, const char *needle) {
  FitLine f = {NAN, NAN, NAN, -1};
  char err[256] = "";
  assert_false(fit_line(x, y, n, &f, err, sizeof err));
  if (!strstr(err, needle)) fail_msg("error '%s' does not say '%s'", err, needle);
  assert_true(f.alpha == 0 && f.beta == 0 && f.r2 == 0 && f.points == 0);   // zeros, not NaN
}

static void test_degenerate_inputs(void **state) {
  double x[4] = {262144, 262144, 262144, 262144}, y[4] = {1.0, 1.1, 0.9, 1.05};
  assert_fails(x, y, 0, "at least 2 points, got 0");
  assert_fails(x, y, 1, "at least 2 points, got 1");
  assert_fails(x, y, 4, "same size");
  double xs[3] = {1, 2, 3}, ys[3] = {1, NAN, 3};
  assert_fails(xs, ys, 3, "not finite");
  ys[1] = INFINITY;
  assert_fails(xs, ys, 3, "not finite");
  assert_false(fit_line(xs, ys, 3, &(FitLine){0}, NULL, 0));   // err may be NULL
}

static void test_relative_fit(void **state) {
  double x[12], y[12];
  int n = grid(524288, 12, 5e-2, 1.6e-8, x, y);
  FitLine f;
  assert_true(fit_line_relative(x, y, n, &f, NULL, 0));
  assert_rel(f.alpha, 5e-2, 1e-9, "alpha");
  assert_rel(f.beta, 1.6e-8, 1e-9, "beta");
  // Small sizes at a fixed cost of 0.1 and a slope, and one large size 30 % slower than the line:
  // the plain least squares bends to the large point and misses the small ones by up to 14 %;
  // the relative fit misses them by less than 10 %, and by less than the plain fit.
  double xs[6] = {1e5, 2e5, 4e5, 8e5, 1.6e6, 1e9}, ys[6];
  for (int i = 0; i < 6; i++) ys[i] = 0.1 + 1e-7 * xs[i];
  ys[5] *= 1.3;
  FitLine plain, rel;
  assert_true(fit_line(xs, ys, 6, &plain, NULL, 0));
  assert_true(fit_line_relative(xs, ys, 6, &rel, NULL, 0));
  double worst_plain = 0, worst_rel = 0;
  for (int i = 0; i < 5; i++) {
    worst_plain = fmax(worst_plain, fabs(plain.alpha + plain.beta * xs[i] - ys[i]) / ys[i]);
    worst_rel = fmax(worst_rel, fabs(rel.alpha + rel.beta * xs[i] - ys[i]) / ys[i]);
  }
  if (!(worst_rel < 0.1 && worst_rel < worst_plain))
    fail_msg("small sizes: relative fit off by %.3g, plain fit by %.3g", worst_rel, worst_plain);
  // Times that fall faster than any line with a positive intercept: through the origin.
  double xo[3] = {1, 2, 4}, yo[3] = {0.5, 2, 4.2};
  assert_true(fit_line_relative(xo, yo, 3, &f, NULL, 0));
  assert_true(f.alpha == 0 && f.beta > 0);
  double bad[3] = {1, 0, 2};
  char err[200] = "";
  assert_false(fit_line_relative(xo, bad, 3, &f, err, sizeof err));
  assert_non_null(strstr(err, "above 0"));
}

static void test_anchored_fit(void **state) {
  // A fixed cost measured at a tiny size and a slope from 2^18 floats on.
  double x[6] = {256, 2048, 16384, 262144, 524288, 1048576}, y[6];
  for (int i = 0; i < 6; i++) y[i] = 0.011 + 1.7e-5 * x[i];
  FitLine f;
  assert_true(fit_anchored(x, y, 6, y[0], 262144, &f, NULL, 0));
  assert_rel(f.alpha, y[0], 1e-12, "alpha");
  assert_rel(f.beta, 1.7e-5, 1e-3, "beta");
  assert_true(f.r2 > 0.999999 && f.points == 6);
  // Times that fall with size (noise) give a slope of 0, not a negative one.
  double down[3] = {5, 4, 3};
  assert_true(fit_anchored(x, down, 3, 5, 0, &f, NULL, 0));
  assert_true(f.beta == 0);
  char err[200] = "";
  assert_false(fit_anchored(x, y, 3, 0.01, 1e9, &f, err, sizeof err));
  assert_non_null(strstr(err, "no point"));
}

int main(void) {
  const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_relative_fit),
    cmocka_unit_test(test_anchored_fit),
    cmocka_unit_test(test_exact_points),
    cmocka_unit_test(test_zero_and_negative_coefficients),
    cmocka_unit_test(test_noisy_points),
    cmocka_unit_test(test_degenerate_inputs),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
