// The feed-forward CUDA kernels beside cuBLAS's GEMMs: biases (dense and per expert) and the
// activations GELU, ReLU, SiLU; the siblings of runtime/kernels/ffn.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: GELU ----
// GELU's s = 1 / (1 + exp(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3), as runtime/kernels/ffn.c.
#define MK_GELU_C 0.7978845608028654f
#define MK_GELU_A 0.044715f
__device__ float mk_gelu_s(float v) { return 1.0f / (1.0f + mk_exp(-2.0f * MK_GELU_C * (v + MK_GELU_A * v * v * v))); }

// ---- mk_bias ----
extern "C" __global__ void mk_bias(const float *x, const float *b, float *y, int rows, int n) {
  MK_FOR(i, (i64)rows * n) y[i] = x[i] + b[i % n];
}

// ---- mk_bias_grad ----
// One thread per column, rows summed in order in double: deterministic, as rt_bias_grad.
extern "C" __global__ void mk_bias_grad(const float *dy, float *db, int rows, int n) {
  MK_FOR(c, n) {
    double acc = 0.0;
    for (int r = 0; r < rows; r++) acc += dy[(i64)r * n + c];
    db[c] = (float)acc;
  }
}

// ---- mk_expert_bias ----
extern "C" __global__ void mk_expert_bias(const float *x, const float *b, float *y, int e, int rows, int n) {
  MK_FOR(i, (i64)e * rows * n) y[i] = x[i] + b[(i / ((i64)rows * n)) * n + i % n];
}

// ---- mk_expert_bias_grad ----
// One thread per column; eight independent sums over the rows (row r into sum r % 8), added in a
// fixed order at the end, so that eight loads are in flight instead of one.
extern "C" __global__ void mk_expert_bias_grad(const float *dy, float *db, int e, int rows, int n) {
  MK_FOR(i, (i64)e * n) {
    i64 ex = i / n, c = i % n;
    const float *d = dy + ex * rows * n + c;
    double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int r = 0;
    for (; r + 8 <= rows; r += 8)
      for (int u = 0; u < 8; u++) acc[u] += d[(i64)(r + u) * n];
    for (; r < rows; r++) acc[r % 8] += d[(i64)r * n];
    db[i] = (float)(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
  }
}

// ---- mk_gelu ----
// The tanh GELU as x * s, s = 1 / (1 + exp(-2u)) = 0.5 (1 + tanh(u)), as rt_gelu computes it
// (cols, the row width, lets the CPU kernel copy repeated rows; every element is computed here).
extern "C" __global__ void mk_gelu(const float *x, float *y, i64 n, i64 cols) {
  MK_FOR(i, n) {
    float v = x[i];
    y[i] = v * mk_gelu_s(v);
  }
}

// ---- mk_gelu_grad ----
// +0 where dy is zero (an expert's empty slots), without the exp, as rt_gelu_grad.
extern "C" __global__ void mk_gelu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) {
    if (dy[i] == 0.0f) {
      dx[i] = 0.0f;
      continue;
    }
    float v = x[i], s = mk_gelu_s(v);
    float du = MK_GELU_C * (1.0f + 3.0f * MK_GELU_A * v * v);
    dx[i] = dy[i] * (s + 2.0f * v * s * (1.0f - s) * du);
  }
}

// ---- mk_relu ----
extern "C" __global__ void mk_relu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

// ---- mk_relu_grad ----
extern "C" __global__ void mk_relu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) dx[i] = x[i] > 0.0f ? dy[i] : 0.0f;
}

// ---- mk_silu ----
// s = 1 / (1 + mk_exp(-x)): the float operations of rt_silu.
extern "C" __global__ void mk_silu(const float *x, float *y, i64 n) {
  MK_FOR(i, n) y[i] = x[i] * (1.0f / (1.0f + mk_exp(-x[i])));
}

// ---- mk_silu_grad ----
extern "C" __global__ void mk_silu_grad(const float *dy, const float *x, float *dx, i64 n) {
  MK_FOR(i, n) {
    float sg = 1.0f / (1.0f + mk_exp(-x[i]));
    dx[i] = dy[i] * sg * (1.0f + x[i] * (1.0f - sg));
  }
}
