// Layout copies around the expert-parallel collectives and chunked execution; the siblings of
// runtime/kernels/layout.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- mk_expert_major ----
// [blocks*experts, rows, m] seen as [blocks, experts, chunk] -> [experts, blocks, chunk].
extern "C" __global__ void mk_expert_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {
  i64 chunk = rows * m;
  MK_FOR(i, (i64)blocks * experts * chunk) {
    i64 o = i / chunk, w = i % chunk, ex = o / blocks, r = o % blocks;
    y[i] = x[(r * experts + ex) * chunk + w];
  }
}

// ---- mk_rank_major ----
extern "C" __global__ void mk_rank_major(const float *x, float *y, int blocks, int experts, i64 rows, i64 m) {
  i64 chunk = rows * m;
  MK_FOR(i, (i64)blocks * experts * chunk) {
    i64 o = i / chunk, w = i % chunk, r = o / experts, ex = o % experts;
    y[i] = x[(ex * blocks + r) * chunk + w];
  }
}

// ---- mk_layout_chunk ----
// Bytes: x [outer*blocks, rows, inner] -> slots [lo, hi) of every run, lo = index*rows/chunks,
// hi = (index+1)*rows/chunks (floor division: any chunks <= rows, sizes differ by at most one).
extern "C" __global__ void mk_layout_chunk(const unsigned char *x, unsigned char *y, i64 outer, i64 blocks, i64 rows,
                                           i64 inner, i64 chunks, i64 index) {
  i64 lo = index * rows / chunks, run = ((index + 1) * rows / chunks - lo) * inner;
  MK_FOR(i, outer * blocks * run) {
    i64 o = i / run, w = i % run;
    y[i] = x[(o * rows + lo) * inner + w];
  }
}

// ---- mk_layout_concat ----
extern "C" __global__ void mk_layout_concat(const unsigned char *a, const unsigned char *b, unsigned char *y,
                                            i64 outer, i64 blocks, i64 rows_a, i64 rows_b, i64 inner) {
  i64 ra = rows_a * inner, rb = rows_b * inner, run = ra + rb;
  MK_FOR(i, outer * blocks * run) {
    i64 o = i / run, w = i % run;
    y[i] = w < ra ? a[o * ra + w] : b[o * rb + (w - ra)];
  }
}
