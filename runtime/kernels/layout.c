// Layout copies, the siblings of codegen/cuda/layout.cu; pure copies, so exact.
//
// Around the expert-parallel collectives: after the EP AlltoAll a rank holds R blocks (one per
// peer) of [El, C, M]: its El experts' slots from each peer. The experts want their rows
// together, [El, R*C, M] (rt_expert_major); the combine goes back the other way (rt_rank_major).
// Copies of contiguous [C, M] rows, so the two are exact inverses.
//
// Chunked execution (passes/schedule.c splits a layer's expert region into r chunks along the
// capacity dimension). A tensor [outer, blocks*rows, ...] is seen as [outer, blocks, rows, inner
// bytes]: after the EP/ESP layout ops an expert's slots are `blocks` runs of `rows` slots (one run
// per peer), and chunk j holds slots [j*rows/r, (j+1)*rows/r) of every run, integer floor
// division: any r with 1 <= r <= rows, the chunks' sizes differ by at most one slot (rows 5, r 3:
// 1, 2, 2) and none is empty. rt_layout_concat assembles runs of different sizes, so
// concatenating chunks 0..r-1 in order gives x back.
#include <string.h>

#include "moert.h"

void rt_expert_major(const float *x, float *y, int blocks, int experts, int64_t rows, int64_t m) {
  int64_t chunk = rows * m;  // one block's slots of one expert
  for (int r = 0; r < blocks; r++)
    for (int e = 0; e < experts; e++)
      memcpy(y + ((int64_t)e * blocks + r) * chunk, x + ((int64_t)r * experts + e) * chunk, sizeof(float) * (size_t)chunk);
}

void rt_rank_major(const float *x, float *y, int blocks, int experts, int64_t rows, int64_t m) {
  int64_t chunk = rows * m;
  for (int r = 0; r < blocks; r++)
    for (int e = 0; e < experts; e++)
      memcpy(y + ((int64_t)r * experts + e) * chunk, x + ((int64_t)e * blocks + r) * chunk, sizeof(float) * (size_t)chunk);
}

void rt_layout_chunk(const void *x, void *y, int64_t outer, int64_t blocks, int64_t rows, int64_t inner,
                     int64_t chunks, int64_t index) {
  int64_t lo = index * rows / chunks, c = (index + 1) * rows / chunks - lo;
  const unsigned char *src = x;
  unsigned char *dst = y;
  for (int64_t o = 0; o < outer * blocks; o++)
    memcpy(dst + o * c * inner, src + (o * rows + lo) * inner, (size_t)(c * inner));
}

void rt_layout_concat(const void *a, const void *b, void *y, int64_t outer, int64_t blocks, int64_t rows_a,
                      int64_t rows_b, int64_t inner) {
  const unsigned char *pa = a, *pb = b;
  unsigned char *dst = y;
  int64_t rows = rows_a + rows_b;
  for (int64_t o = 0; o < outer * blocks; o++) {
    memcpy(dst + o * rows * inner, pa + o * rows_a * inner, (size_t)(rows_a * inner));
    memcpy(dst + (o * rows + rows_a) * inner, pb + o * rows_b * inner, (size_t)(rows_b * inner));
  }
}
