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

// ---- prelude: the slot rows and the choices that fill them ----
// order.encode and order.decode.grad_y write every row of their [e, g*cap, m] result, empty slots
// zero (no separate zeroing): one block per MK_SLOT_ROWS rows (the rule's grid: blocks y.0*y.1/16).
// The block finds which kept choice fills each of its rows (from[r], -1: none), then writes its
// rows whole. It finds them in the slot map of the routing (mk_slot_map, written by the launch's
// first kernel: codegen/lower.c's slot_map), or, without one (map NULL: MOEC_SLOT_MAP=0, and the
// library's mk_order_encode and _decode_grad_y), by a pass over every choice, which costs each
// block s k reads: (s k)^2 / 16 in all, where the map costs s k + the slots.
#define MK_SLOT_ROWS 16

// The kept choice that fills slot row `slot` by the map, -1: none. An entry counts only when the
// choice it names is kept and fills that very slot, so the map needs no clearing: an entry this
// routing did not write (an earlier step's, or never written) names no such choice (kept choices
// have distinct slots).
__device__ __forceinline__ int mk_map_choice(const int *map, i64 slot, const int *idx, const int *loc, int s, int k,
                                             int g, int cap) {
  int c = map[slot];
  if (c < 0 || (i64)c >= (i64)s * k || !mk_kept(loc, c, cap)) return -1;
  return mk_slot(idx, loc, c, mk_group_of(s, g, c / k), cap, g) == slot ? c : -1;
}

// Whether a kept choice fills one of the MK_SLOT_ROWS slot rows of chunk q, by the map's witness
// of the chunk (after its `rows` entries: any kept choice of the chunk, checked as above).
__device__ __forceinline__ bool mk_map_chunk(const int *map, i64 rows, i64 q, const int *idx, const int *loc, int s,
                                             int k, int g, int cap) {
  int c = map[rows + q];
  if (c < 0 || (i64)c >= (i64)s * k || !mk_kept(loc, c, cap)) return false;
  return mk_slot(idx, loc, c, mk_group_of(s, g, c / k), cap, g) / MK_SLOT_ROWS == q;
}

// from[r]: the kept choice that fills slot row r0 + r (-1: none): from the map, or without one a
// pass over every choice. With top (two ints; the map's only): the last kept location of the
// blocks of slots (expert and routing group, cap rows each) that the rows' first and last fall
// in, or INT_MAX where a kept choice lies past the rows in that block of slots (what a kernel
// writing no row past the counts from the routing needs: whether a row is at or below that last
// location); the chunks past the rows' own answer whether one does (the last of them, which may
// hold the next block's rows too, row by row).
__device__ void mk_slot_choices(const int *map, const int *idx, const int *loc, int *from, i64 r0, i64 rows, int s,
                                int k, int g, int cap, int *top = nullptr) {
  __shared__ int past_rows[2];
  i64 b[2] = {r0 / cap, (r0 + MK_SLOT_ROWS - 1) / cap};
  for (int r = threadIdx.x; r < MK_SLOT_ROWS; r += blockDim.x) from[r] = -1;
  if (threadIdx.x < 2) {
    past_rows[threadIdx.x] = 0;
    if (top) top[threadIdx.x] = -1;
  }
  __syncthreads();
  if (map) {
    for (int r = threadIdx.x; r < MK_SLOT_ROWS; r += blockDim.x)
      if (r0 + r < rows) from[r] = mk_map_choice(map, r0 + r, idx, loc, s, k, g, cap);
    for (int x = 0; top && x < 2; x++) {
      i64 end = (b[x] + 1) * cap, q0 = r0 / MK_SLOT_ROWS + 1, q1 = (end - 1) / MK_SLOT_ROWS;   // q1: may hold more
      for (i64 q = q0 + threadIdx.x; q < q1; q += blockDim.x)
        if (mk_map_chunk(map, rows, q, idx, loc, s, k, g, cap)) past_rows[x] = 1;
      for (i64 r = q1 * MK_SLOT_ROWS + threadIdx.x; q1 >= q0 && r < end; r += blockDim.x)
        if (mk_map_choice(map, r, idx, loc, s, k, g, cap) >= 0) past_rows[x] = 1;
    }
  } else {
    for (i64 c = threadIdx.x; c < (i64)s * k; c += blockDim.x) {
      if (!mk_kept(loc, c, cap)) continue;
      i64 slot = mk_slot(idx, loc, c, mk_group_of(s, g, (int)(c / k)), cap, g), r = slot - r0;
      if (r >= 0 && r < MK_SLOT_ROWS) from[r] = (int)c;   // kept choices have distinct slots
    }
  }
  __syncthreads();
  if (top && threadIdx.x == 0)
    for (int x = 0; x < 2; x++) {
      if (past_rows[x]) top[x] = 0x7fffffff;
      for (int r = 0; !past_rows[x] && r < MK_SLOT_ROWS; r++)
        if (from[r] >= 0 && (r0 + r) / cap == b[x] && loc[from[r]] > top[x]) top[x] = loc[from[r]];
    }
  __syncthreads();
}

// Every row of [e, g*cap, m] through out(i, v) (a fused kernel writes the bf16 copy there too):
// the element of a slot that choice c fills is fill(c, col), an empty slot's zero. Without past
// (and with the map), the rows past their block of slots' last kept location are not written (nothing reads them:
// codegen/launch.c; NaN where MK_POISON), but each block of slots' row 0 (a weight gradient of an
// expert nobody was routed to sums it) and the rows of the blocks of slots between the first and
// the last one of the block's rows (cap below MK_SLOT_ROWS).
template <class S, class F> __device__ void mk_slot_rows_store(const int *map, const int *idx, const int *loc, S out,
                                                               F fill, int s, int m, int k, int e, int g, int cap,
                                                               bool past = true) {
  __shared__ int from[MK_SLOT_ROWS], top[2];
  if (g < 1) g = 1;
  if (!map) past = true;   // only the map tells a block that no kept choice lies past its rows
  i64 rows = (i64)e * g * cap;
  MK_FOR_BLOCKS(b, (rows + MK_SLOT_ROWS - 1) / MK_SLOT_ROWS) {
    i64 r0 = b * MK_SLOT_ROWS, g0 = r0 / cap, g1 = (r0 + MK_SLOT_ROWS - 1) / cap;
    mk_slot_choices(map, idx, loc, from, r0, rows, s, k, g, cap, past ? nullptr : top);
    for (i64 i = threadIdx.x; i < (i64)MK_SLOT_ROWS * m; i += blockDim.x) {
      i64 r = i / m, col = i % m, at = r0 + r, l = at % cap;
      if (at >= rows) break;
      int c = from[r];
      bool unread = !past && l != 0 && ((at / cap == g0 && l > top[0]) || (at / cap == g1 && l > top[1]));
      if (!unread) out(at * m + col, c < 0 ? 0.0f : fill(c, col));
      else if (MK_POISON) out(at * m + col, MK_NAN);
    }
    __syncthreads();   // from[] and top[] serve the block's next rows
  }
}

// ---- mk_slot_map ----
// The slot map of a routing, for the kernels over slot rows of the same launch: map[slot] = the
// kept choice that fills slot row `slot` of [e, g*cap], and after those rows map[rows + q] = one
// of the kept choices in chunk q (rows MK_SLOT_ROWS q ..), written by whichever of them stores
// last. Entries of empty slots and chunks are left as they are (mk_map_choice, mk_map_chunk).
extern "C" __global__ void mk_slot_map(const int *idx, const int *loc, int *map, int s, int k, int e, int g, int cap) {
  if (g < 1) g = 1;
  i64 rows = (i64)e * g * cap;
  MK_FOR(c, (i64)s * k) {
    if (!mk_kept(loc, c, cap)) continue;
    i64 slot = mk_slot(idx, loc, c, mk_group_of(s, g, (int)(c / k)), cap, g);
    map[slot] = (int)c;
    map[rows + slot / MK_SLOT_ROWS] = (int)c;
  }
}

// ---- prelude: encode over a storer ----
// The token's row of each kept choice in its slot, the empty slots zero (map: mk_slot_rows_store's).
template <class S> __device__ void mk_order_encode_store(const int *map, const float *x, const int *idx, const int *loc,
                                                         S out, int s, int m, int k, int e, int g, int cap,
                                                         bool past = true) {
  mk_slot_rows_store(map, idx, loc, out, [&](int c, i64 col) { return x[(i64)(c / k) * m + col]; }, s, m, k, e, g, cap,
                     past);
}

// ---- mk_order_encode ----
extern "C" __global__ void mk_order_encode(const float *x, const int *idx, const int *loc, float *disp, int s, int m,
                                           int k, int e, int g, int cap) {
  mk_order_encode_store(nullptr, x, idx, loc, [&](i64 i, float v) { disp[i] = v; }, s, m, k, e, g, cap);
}

// ---- mk_order_encode_map ----
// The same from the launch's slot map (mk_slot_map); past 0: no row written past the counts from
// the routing but each block of slots' row 0.
extern "C" __global__ void mk_order_encode_map(const float *x, const int *idx, const int *loc, const int *map,
                                               float *disp, int s, int m, int k, int e, int g, int cap, int past) {
  mk_order_encode_store(map, x, idx, loc, [&](i64 i, float v) { disp[i] = v; }, s, m, k, e, g, cap, past != 0);
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

// ---- prelude: decode_grad_y over a storer ----
// Each kept choice's slot gets gate * dout row (0 + gate * dout, as rt_order_decode_grad_y), the
// empty slots zero (map: mk_slot_rows_store's).
template <class S> __device__ void mk_order_decode_grad_y_store(const int *map, const float *dout, const int *idx,
                                                                const int *loc, const float *gates, S out, int s, int m,
                                                                int k, int e, int g, int cap, bool past = true) {
  mk_slot_rows_store(map, idx, loc, out, [&](int c, i64 col) { return 0.0f + gates[c] * dout[(i64)(c / k) * m + col]; },
                     s, m, k, e, g, cap, past);
}

// ---- mk_order_decode_grad_y ----
extern "C" __global__ void mk_order_decode_grad_y(const float *dout, const int *idx, const int *loc,
                                                  const float *gates, float *dy, int s, int m, int k, int e, int g,
                                                  int cap) {
  mk_order_decode_grad_y_store(nullptr, dout, idx, loc, gates, [&](i64 i, float v) { dy[i] = v; }, s, m, k, e, g, cap);
}

// ---- mk_order_decode_grad_y_map ----
// The same from the launch's slot map (mk_slot_map); past 0: no row written past the counts from
// the routing but each block of slots' row 0.
extern "C" __global__ void mk_order_decode_grad_y_map(const float *dout, const int *idx, const int *loc,
                                                      const float *gates, const int *map, float *dy, int s, int m,
                                                      int k, int e, int g, int cap, int past) {
  mk_order_decode_grad_y_store(map, dout, idx, loc, gates, [&](i64 i, float v) { dy[i] = v; }, s, m, k, e, g, cap,
                               past != 0);
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
