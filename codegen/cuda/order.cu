// The orders: encode (dispatch by location), decode (the gated combine) and the dense GShard
// order's mask and combine weights; the siblings of runtime/kernels/order.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- prelude: the dense order's scatter ----
// dispatch_mask / combine_weights: one block per token; the token's row of [s, e*g*cap] is
// zeroed, then its kept choices set (to the gate, or 1 when gates is NULL).
__device__ void mk_scatter_choices(const int *idx, const int *loc, const float *gates, float *out, int s, int k, int e,
                                   int g, int cap) {
  if (g < 1) g = 1;
  i64 width = (i64)e * g * cap;
  MK_FOR_BLOCKS(t, s) {
    float *row = out + t * width;
    for (i64 i = threadIdx.x; i < width; i += blockDim.x) row[i] = 0.0f;
    __syncthreads();
    if (threadIdx.x == 0) {
      int gi = mk_group_of(s, g, (int)t);
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) row[mk_slot(idx, loc, c, gi, cap, g)] = gates ? gates[c] : 1.0f;
      }
    }
    __syncthreads();
  }
}

// ---- mk_order_encode ----
// After mk_zero on disp: one block per choice copies the token's row to its slot (slots of kept
// choices are distinct, so nothing races).
extern "C" __global__ void mk_order_encode(const float *x, const int *idx, const int *loc, float *disp, int s, int m,
                                           int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    if (!mk_kept(loc, c, cap)) continue;
    int t = (int)(c / k);
    float *dst = disp + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;
    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] = x[(i64)t * m + i];
  }
}

// ---- prelude: the combine's rows, over a storer ----
// order.encode.grad and order.decode write each element of their result once, out(i, v) with i
// its index in [s, m]: the kernels below store to memory, the fused kernels (codegen/fused.c,
// ir/scalar.def's IR_STORE) compute elementwise ops after them (the residual add) in the storer.
// One block per token: the sum of its kept choices' slot rows (times the gate), in choice order.
template <class S> __device__ void mk_order_encode_grad_store(const float *ddisp, const int *idx, const int *loc, S out,
                                                              int s, int m, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) acc += ddisp[mk_slot(idx, loc, c, gi, cap, g) * m + i];
      }
      out(t * m + i, acc);
    }
  }
}
template <class S> __device__ void mk_order_decode_store(const float *y, const int *idx, const int *loc, const float *gates,
                                                         S out, int s, int m, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(t, s) {
    int gi = mk_group_of(s, g, (int)t);
    for (int i = threadIdx.x; i < m; i += blockDim.x) {
      float acc = 0.0f;
      for (int j = 0; j < k; j++) {
        i64 c = t * k + j;
        if (mk_kept(loc, c, cap)) acc += gates[c] * y[mk_slot(idx, loc, c, gi, cap, g) * m + i];
      }
      out(t * m + i, acc);
    }
  }
}

// ---- mk_order_encode_grad ----
// One block per token: the sum of its kept choices' slot rows, in choice order.
extern "C" __global__ void mk_order_encode_grad(const float *ddisp, const int *idx, const int *loc, float *dx, int s,
                                                int m, int k, int e, int g, int cap) {
  mk_order_encode_grad_store(ddisp, idx, loc, [&](i64 i, float v) { dx[i] = v; }, s, m, k, e, g, cap);
}

// ---- mk_order_decode ----
// One block per token: sum over kept choices of gate * expert output row, in choice order.
extern "C" __global__ void mk_order_decode(const float *y, const int *idx, const int *loc, const float *gates,
                                           float *out, int s, int m, int k, int e, int g, int cap) {
  mk_order_decode_store(y, idx, loc, gates, [&](i64 i, float v) { out[i] = v; }, s, m, k, e, g, cap);
}

// ---- mk_order_decode_grad_y ----
// After mk_zero on dy: one block per kept choice writes gate * dout row to its slot.
extern "C" __global__ void mk_order_decode_grad_y(const float *dout, const int *idx, const int *loc,
                                                  const float *gates, float *dy, int s, int m, int k, int e, int g,
                                                  int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    if (!mk_kept(loc, c, cap)) continue;
    int t = (int)(c / k);
    float *dst = dy + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m;
    float w = gates[c];
    for (int i = threadIdx.x; i < m; i += blockDim.x) dst[i] += w * dout[(i64)t * m + i];
  }
}

// ---- mk_order_decode_grad_gates ----
// One block (MK_BLOCK threads) per choice: <dout row, slot row> in double.
extern "C" __global__ void mk_order_decode_grad_gates(const float *dout, const float *y, const int *idx,
                                                      const int *loc, float *dgates, int s, int m, int k, int e,
                                                      int g, int cap) {
  if (g < 1) g = 1;
  MK_FOR_BLOCKS(c, (i64)s * k) {
    bool keep = mk_kept(loc, c, cap);   // the same for the whole block
    if (!keep) {
      if (threadIdx.x == 0) dgates[c] = 0.0f;
      continue;
    }
    int t = (int)(c / k);
    const float *src = y + mk_slot(idx, loc, c, mk_group_of(s, g, t), cap, g) * m, *dr = dout + (i64)t * m;
    double dot = 0.0;
    for (int i = threadIdx.x; i < m; i += blockDim.x) dot += (double)dr[i] * src[i];
    dot = mk_block_sum(dot);
    if (threadIdx.x == 0) dgates[c] = (float)dot;
  }
}

// ---- mk_dispatch_mask ----
extern "C" __global__ void mk_dispatch_mask(const int *idx, const int *loc, float *mask, int s, int k, int e, int g,
                                            int cap) {
  mk_scatter_choices(idx, loc, 0, mask, s, k, e, g, cap);
}

// ---- mk_combine_weights ----
extern "C" __global__ void mk_combine_weights(const int *idx, const int *loc, const float *gates, float *cw, int s,
                                              int k, int e, int g, int cap) {
  mk_scatter_choices(idx, loc, gates, cw, s, k, e, g, cap);
}

// ---- mk_combine_weights_grad ----
extern "C" __global__ void mk_combine_weights_grad(const float *dcw, const int *idx, const int *loc, float *dgates,
                                                   int s, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  i64 width = (i64)e * g * cap;
  MK_FOR(c, (i64)s * k) {
    i64 t = c / k;
    dgates[c] = mk_kept(loc, c, cap) ? dcw[t * width + mk_slot(idx, loc, c, mk_group_of(s, g, (int)t), cap, g)] : 0.0f;
  }
}
