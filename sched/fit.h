// Least-squares fit of the linear performance models t(n) = alpha + beta * n (lang/manual.md §8, paper
// §4.1 eq. (1) and §6.2): `moec tune` fits one per microbenchmark, the tests check it on
// synthetic points. No MPI, no IR: the solver is LAPACK's dgels (QR) from OpenBLAS.
#ifndef FIT_H
#define FIT_H

#include <stdbool.h>
#include <stddef.h>

typedef struct FitLine {
  double alpha, beta;   // t = alpha + beta * n; kept as fitted, negative values included
  double r2;            // coefficient of determination, 1 - SS_res / SS_tot (1 when SS_tot = 0)
  int points;
} FitLine;

// Fits y = alpha + beta * x to the points (x[i], y[i]), i < n, by least squares. Needs at least
// two points with different x, all finite. On failure returns false and writes one sentence
// (no trailing period) to err (err_size bytes; err may be NULL); out is then all NaN-free zeros.
bool fit_line(const double *x, const double *y, int n, FitLine *out, char *err, size_t err_size);

// The same line with each point weighted by 1/y: relative errors count, so that small sizes are
// fitted as well as large ones (GEMMs from a few tokens to whole capacities). Needs every y > 0.
// Should the intercept come out negative, the line through the origin with the same weighting.
bool fit_line_relative(const double *x, const double *y, int n, FitLine *out, char *err, size_t err_size);
// A line whose intercept is given (a measured fixed cost): beta = sum (y - alpha) x / sum x^2
// over the points with x >= x_from, at least 0; r2 over all points.
bool fit_anchored(const double *x, const double *y, int n, double alpha, double x_from, FitLine *out,
                  char *err, size_t err_size);
// Sets line->r2 and line->points from the points.
void fit_r2(const double *x, const double *y, int n, FitLine *line);

#endif
