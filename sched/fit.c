// The least-squares line behind every .cluster coefficient.
//
// The design matrix is [1, x]. Sizes run to millions of elements while the intercept column is
// 1, so x is divided by the power of two s >= max|x| first: the columns then have comparable
// norms (the condition number stays near that of [1, t] with t in (0, 1]), and since dividing
// by a power of two is exact, beta = (slope in t) / s loses nothing. LAPACK's dgels solves the
// scaled problem by QR, never by the normal equations, so exact points come back exactly (to
// rounding) and r^2 is computed from the residuals of the returned line.
#include "fit.h"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

// LAPACK (exported by OpenBLAS), Fortran calling convention: every argument by reference, and
// the hidden length of the character argument trans at the end.
extern void dgels_(const char *trans, const int *m, const int *n, const int *nrhs, double *a,
                   const int *lda, double *b, const int *ldb, double *work, const int *lwork,
                   int *info, size_t trans_len);

static bool fail(char *err, size_t err_size, FitLine *out, const char *fmt, ...) {
  *out = (FitLine){0};
  if (err && err_size) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, err_size, fmt, ap);
    va_end(ap);
  }
  return false;
}

// The line minimising sum (w_i * (y_i - alpha - beta x_i))^2; w NULL: every weight 1.
static bool fit_weighted(const double *x, const double *y, const double *w, int n, FitLine *out,
                         char *err, size_t err_size) {
  if (n < 2)
    return fail(err, err_size, out, "a line needs at least 2 points, got %d", n < 0 ? 0 : n);
  double xmax = 0;
  bool distinct = false;
  for (int i = 0; i < n; i++) {
    if (!isfinite(x[i]) || !isfinite(y[i]))
      return fail(err, err_size, out, "point %d is not finite (n = %g, t = %g)", i, x[i], y[i]);
    if (fabs(x[i]) > xmax) xmax = fabs(x[i]);
    distinct |= x[i] != x[0];
  }
  if (!distinct)
    return fail(err, err_size, out, "all %d points have the same size n = %g, so the slope is undetermined", n, x[0]);

  int exponent;
  frexp(xmax, &exponent);               // xmax < 2^exponent
  double scale = ldexp(1.0, exponent);

  const int rows = n, cols = 2, nrhs = 1;
  double *a = malloc(sizeof(double) * 2 * (size_t)rows), *b = malloc(sizeof(double) * (size_t)rows);
  if (!a || !b) {
    free(a);
    free(b);
    return fail(err, err_size, out, "out of memory fitting %d points", n);
  }
  for (int i = 0; i < rows; i++) {     // column-major [rows x 2]
    double wi = w ? w[i] : 1.0;
    a[i] = wi;
    a[rows + i] = wi * x[i] / scale;
    b[i] = wi * y[i];
  }
  int info = 0, lwork = -1;
  double query;
  dgels_("N", &rows, &cols, &nrhs, a, &rows, b, &rows, &query, &lwork, &info, 1);
  lwork = info == 0 && query >= 1 ? (int)query : rows + 64;
  double *work = malloc(sizeof(double) * (size_t)lwork);
  if (!work) {
    free(a);
    free(b);
    return fail(err, err_size, out, "out of memory fitting %d points", n);
  }
  dgels_("N", &rows, &cols, &nrhs, a, &rows, b, &rows, work, &lwork, &info, 1);
  double alpha = b[0], beta = b[1] / scale;
  free(work);
  free(a);
  free(b);
  if (info != 0)
    return fail(err, err_size, out, "LAPACK dgels failed (info %d): the sizes do not determine a line", info);
  if (!isfinite(alpha) || !isfinite(beta))
    return fail(err, err_size, out, "the fitted line is not finite");

  double mean = 0;
  for (int i = 0; i < n; i++) mean += y[i];
  mean /= n;
  double ss_tot = 0, ss_res = 0;
  for (int i = 0; i < n; i++) {
    double r = y[i] - (alpha + beta * x[i]), d = y[i] - mean;
    ss_res += r * r;
    ss_tot += d * d;
  }
  // All times equal: the horizontal line through them is exact, whatever rounding left over.
  *out = (FitLine){alpha, beta, ss_tot > 0 ? 1.0 - ss_res / ss_tot : 1.0, n};
  return true;
}

bool fit_line(const double *x, const double *y, int n, FitLine *out, char *err, size_t err_size) {
  return fit_weighted(x, y, NULL, n, out, err, err_size);
}

bool fit_line_relative(const double *x, const double *y, int n, FitLine *out, char *err, size_t err_size) {
  if (n < 0) n = 0;
  double *w = malloc(sizeof(double) * (size_t)(n > 0 ? n : 1));
  if (!w) return fail(err, err_size, out, "out of memory fitting %d points", n);
  for (int i = 0; i < n; i++) {
    if (!(y[i] > 0) || !isfinite(y[i])) {
      free(w);
      return fail(err, err_size, out, "point %d has the time %g; a relative fit needs times above 0", i, y[i]);
    }
    w[i] = 1.0 / y[i];
  }
  bool ok = fit_weighted(x, y, w, n, out, err, err_size);
  free(w);
  if (ok && out->alpha < 0) {
    // The smallest sizes run faster than the line says: through the origin instead, still
    // relative: minimise sum ((y - beta x) / y)^2, beta = sum(x/y) / sum((x/y)^2).
    double num = 0, den = 0;
    for (int i = 0; i < n; i++) {
      num += x[i] / y[i];
      den += (x[i] / y[i]) * (x[i] / y[i]);
    }
    *out = (FitLine){0.0, den > 0 ? num / den : 0.0, 0, n};
    fit_r2(x, y, n, out);
  }
  return ok;
}

void fit_r2(const double *x, const double *y, int n, FitLine *line) {
  double mean = 0;
  for (int i = 0; i < n; i++) mean += y[i];
  mean = n > 0 ? mean / n : 0;
  double ss_tot = 0, ss_res = 0;
  for (int i = 0; i < n; i++) {
    double r = y[i] - (line->alpha + line->beta * x[i]), d = y[i] - mean;
    ss_res += r * r;
    ss_tot += d * d;
  }
  line->r2 = ss_tot > 0 ? 1.0 - ss_res / ss_tot : 1.0;
  line->points = n;
}

bool fit_anchored(const double *x, const double *y, int n, double alpha, double x_from, FitLine *out,
                  char *err, size_t err_size) {
  double num = 0, den = 0;
  int used = 0;
  for (int i = 0; i < n; i++) {
    if (!isfinite(x[i]) || !isfinite(y[i]))
      return fail(err, err_size, out, "point %d is not finite (n = %g, t = %g)", i, x[i], y[i]);
    if (x[i] < x_from) continue;
    num += (y[i] - alpha) * x[i];
    den += x[i] * x[i];
    used++;
  }
  if (used < 1 || !(den > 0))
    return fail(err, err_size, out, "no point of size %g or more with n > 0 to fit the slope on", x_from);
  *out = (FitLine){alpha, num / den > 0 ? num / den : 0.0, 0, n};
  fit_r2(x, y, n, out);
  return true;
}
