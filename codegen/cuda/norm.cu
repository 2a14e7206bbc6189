// Row normalisations (L2, RMSNorm, LayerNorm) and the learned scales by column or row, one block
// per row reducing in double; the siblings of runtime/kernels/norm.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: row reductions of the norms ----
// A row's sum of squares and, when dy is not NULL, its dot product with dy, reduced by the
// block in double (the l2norm and rmsnorm kernels). The _f forms read the row through loaders
// x(i), dy(i) (i the column): the kernels below pass the row's memory, the fused kernels
// (codegen/fused.c) the element of a chain of elementwise ops, with the same float operations.
template <class X, class D> __device__ void mk_row_ss_dot_f(X x, D dy, bool has_dy, int n, double *ss, double *dot) {
  double a = 0.0, b = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float xi = x(i);
    a += (double)xi * xi;
    if (has_dy) b += (double)dy(i) * xi;
  }
  *ss = mk_block_sum(a);
  if (has_dy) *dot = mk_block_sum(b);
}
__device__ void mk_row_ss_dot(const float *x, const float *dy, int n, double *ss, double *dot) {
  mk_row_ss_dot_f([&](int i) { return x[i]; }, [&](int i) { return dy[i]; }, dy != NULL, n, ss, dot);
}

// A row's mean and 1 / sqrt(variance + eps) (biased), reduced by the block in double (the
// layernorm kernels).
template <class X> __device__ void mk_row_moments_f(X x, int n, float eps, double *mean, double *inv) {
  double s = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) s += x(i);
  *mean = mk_block_sum(s) / n;
  double ss = 0.0;
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    double d = x(i) - *mean;
    ss += d * d;
  }
  *inv = 1.0 / sqrt(mk_block_sum(ss) / n + (double)eps);
}

// ---- prelude: the norms of one row, over loaders and a storer ----
// One row of rmsnorm, rmsnorm_grad, layernorm, layernorm_grad (runtime/kernels/norm.c): the
// operands read through loaders x(i), dy(i) and the result written through y(i, v), i the
// column. The kernels below pass the row's memory; the fused kernels (codegen/fused.c) compute
// a chain of elementwise ops into the loaders (its prologue) and after the storer (its epilogue).
template <class X, class Y> __device__ void mk_rmsnorm_row(X x, Y y, int n, float eps) {
  double ss;
  mk_row_ss_dot_f(x, x, false, n, &ss, (double *)NULL);
  float inv = (float)(1.0 / sqrt(ss / n + (double)eps));
  for (int i = threadIdx.x; i < n; i += blockDim.x) y(i, x(i) * inv);
}
template <class D, class X, class Y> __device__ void mk_rmsnorm_grad_row(D dy, X x, Y dx, int n, float eps) {
  double ss, dot;
  mk_row_ss_dot_f(x, dy, true, n, &ss, &dot);
  double inv = 1.0 / sqrt(ss / n + (double)eps);
  float scale = (float)inv, proj = (float)(inv * inv * inv * dot / n);
  for (int i = threadIdx.x; i < n; i += blockDim.x) dx(i, dy(i) * scale - x(i) * proj);
}
template <class X, class Y> __device__ void mk_layernorm_row(X x, Y y, int n, float eps) {
  double mean, inv;
  mk_row_moments_f(x, n, eps, &mean, &inv);
  for (int i = threadIdx.x; i < n; i += blockDim.x) y(i, (float)((x(i) - mean) * inv));
}
template <class D, class X, class Y> __device__ void mk_layernorm_grad_row(D dy, X x, Y dx, int n, float eps) {
  double mean, inv, sd = 0.0, sdx = 0.0;
  mk_row_moments_f(x, n, eps, &mean, &inv);
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    float d = dy(i);
    sd += d;
    sdx += d * ((x(i) - mean) * inv);
  }
  sd = mk_block_sum(sd) / n;
  sdx = mk_block_sum(sdx) / n;
  for (int i = threadIdx.x; i < n; i += blockDim.x) dx(i, (float)(inv * (dy(i) - sd - (x(i) - mean) * inv * sdx)));
}

// ---- mk_l2norm ----
// One block (MK_BLOCK threads) per row.
extern "C" __global__ void mk_l2norm(const float *x, float *y, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    double ss;
    mk_row_ss_dot(xr, NULL, n, &ss, NULL);
    float inv = (float)(1.0 / sqrt(ss + 1e-12));
    for (int i = threadIdx.x; i < n; i += blockDim.x) yr[i] = xr[i] * inv;
  }
}

// ---- mk_l2norm_grad ----
extern "C" __global__ void mk_l2norm_grad(const float *dy, const float *x, float *dx, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    double ss, dot;
    mk_row_ss_dot(xr, dr, n, &ss, &dot);
    double norm = sqrt(ss + 1e-12);
    float inv = (float)(1.0 / norm), proj = (float)(dot / (norm * norm * norm));
    for (int i = threadIdx.x; i < n; i += blockDim.x) out[i] = dr[i] * inv - xr[i] * proj;
  }
}

// ---- mk_rmsnorm ----
// One block (MK_BLOCK threads) per row; as rt_rmsnorm (runtime/kernels/norm.c).
extern "C" __global__ void mk_rmsnorm(const float *x, float *y, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    mk_rmsnorm_row([&](int i) { return xr[i]; }, [&](int i, float v) { yr[i] = v; }, n, eps);
  }
}

// ---- mk_rmsnorm_grad ----
extern "C" __global__ void mk_rmsnorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    mk_rmsnorm_grad_row([&](int i) { return dr[i]; }, [&](int i) { return xr[i]; }, [&](int i, float v) { out[i] = v; }, n, eps);
  }
}

// ---- mk_layernorm ----
// One block per row; as rt_layernorm (runtime/kernels/norm.c).
extern "C" __global__ void mk_layernorm(const float *x, float *y, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n;
    float *yr = y + r * n;
    mk_layernorm_row([&](int i) { return xr[i]; }, [&](int i, float v) { yr[i] = v; }, n, eps);
  }
}

// ---- mk_layernorm_grad ----
extern "C" __global__ void mk_layernorm_grad(const float *dy, const float *x, float *dx, int rows, int n, float eps) {
  MK_FOR_BLOCKS(r, rows) {
    const float *xr = x + r * n, *dr = dy + r * n;
    float *out = dx + r * n;
    mk_layernorm_grad_row([&](int i) { return dr[i]; }, [&](int i) { return xr[i]; }, [&](int i, float v) { out[i] = v; }, n, eps);
  }
}

// ---- mk_scale_cols ----
extern "C" __global__ void mk_scale_cols(const float *x, const float *w, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] * w[i % n];
}

// ---- mk_scale_cols_grad_w ----
// The column sums of dy * x in double (ffn.cu's mk_column_sums), one block per tile of columns
// (cg_cuda_column_tiles), as rt_scale_cols_grad_w.
extern "C" __global__ void mk_scale_cols_grad_w(const float *dy, const float *x, float *dw, int rows, int n) {
  mk_column_sums(dy, x, dw, 1, rows, n);
}

// ---- mk_scale_rows ----
extern "C" __global__ void mk_scale_rows(const float *x, const float *g, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] * g[i / n];
}

// ---- mk_scale_rows_grad_g ----
// One thread per row, columns summed in order in double, as rt_scale_rows_grad_g.
extern "C" __global__ void mk_scale_rows_grad_g(const float *dy, const float *x, float *dg, int rows, int n) {
  MK_FOR(r, rows) {
    double acc = 0.0;
    for (int i = 0; i < n; i++) acc += (double)dy[r * n + i] * x[r * n + i];
    dg[r] = (float)acc;
  }
}
